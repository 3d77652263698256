"""The shared rank job: one launch runs the rank bodies of every collected test file that
declares them, so a session pays a TensorFlow rank's start (~4 s of CPU per rank, 3-6 s of
wall per job on 2 cores) once per rank count instead of once per fixture.

A test file takes part by defining, at module level::

    def shared_job_cases(np_: int, directory: str) -> dict[str, tuple]:
        # case name -> (function, *args), run on every rank as ``function(*args)``;
        # ``directory``: a temporary folder for files (one per rank count); {} to sit out
        ...

and reading every rank's result in a fixture with ``shared_job(request.module, np_)``
(a dict: case name -> list of per-rank results). Only the files collected for the session
join the job, so running one file runs only its own cases. (Under pytest-xdist every worker
collects every file: a worker that needs the job runs all of it.)

What does not belong here: bodies that need their own environment (``env=``), fresh processes
(checkpoints resumed in a new job), another launcher, or a rank that dies on purpose.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from tests.keras_models import one_tensorflow_thread
from tests.models import call, run_cases

#: the job's time bound: a hang becomes a failure with every rank's output after this long
BASE_TIMEOUT_S, PER_CASE_TIMEOUT_S = 300, 60
#: and sooner, a rank that waits this long in one eager collective (hvdsync's watchdog) ends
#: the job -- a case's legitimate waits (a peer tracing its step) take seconds
COLLECTIVE_TIMEOUT_S = 120


@pytest.fixture(scope="session")
def shared_job(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Callable[[Any, int], dict]:
    modules = list(dict.fromkeys(item.module for item in request.session.items
                                 if getattr(item, "module", None) is not None))
    results: dict[int, dict | BaseException] = {}

    def run(np_: int) -> dict:
        directory = str(tmp_path_factory.mktemp(f"shared_job_np{np_}"))
        cases = {f"{mod.__name__}:{name}": case
                 for mod in modules if hasattr(mod, "shared_job_cases")
                 for name, case in mod.shared_job_cases(np_, directory).items()}
        # first, whichever files take part: TensorFlow's threads are fixed once it starts, so
        # a case that does not set them (an example) must not decide them for the ones after
        cases = {"conftest:one TensorFlow thread": (one_tensorflow_thread,), **cases}
        return run_cases(call, np_, cases,
                         timeout=BASE_TIMEOUT_S + PER_CASE_TIMEOUT_S * len(cases),
                         env={"HVDSYNC_TIMEOUT_SECONDS": str(COLLECTIVE_TIMEOUT_S)})

    def of(module: Any, np_: int) -> dict:
        """``module``'s cases in the job on ``np_`` ranks (run on the first request)."""
        if np_ not in results:
            try:
                results[np_] = run(np_)
            except Exception as e:  # kept: every later request fails alike, without a rerun
                results[np_] = e
        if isinstance(results[np_], BaseException):
            raise results[np_]
        prefix = f"{module.__name__}:"
        return {name[len(prefix):]: ranks for name, ranks in results[np_].items()
                if name.startswith(prefix)}

    return of
