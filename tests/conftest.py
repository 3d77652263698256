"""The shared rank jobs: one launch runs the rank bodies of every collected test file that
declares them, so a session pays a rank's start once per rank count instead of once per
fixture -- a TensorFlow rank ~4 s of CPU (3-6 s of wall per job on 2 cores), a torch one ~1.8 s
(2-3.5 s per job). Three families, each its own job (a torch file's ranks do not import
TensorFlow; a launcher is a backend):

* ``shared_job`` (Keras): a test file takes part by defining, at module level::

      def shared_job_cases(np_: int, directory: str) -> dict[str, tuple]:
          # case name -> (function, *args), run on every rank as ``function(*args)``;
          # ``directory``: a temporary folder for files (one per rank count); {} to sit out
          ...

* ``torch_job`` (torch, ``horovodrun``, Horovod's tensor fusion off: sums in a fixed order,
  so results compare bit for bit across cases at 3 ranks too): the same with
  ``torch_job_cases``; :func:`tests.models.job_group` names a fixture's cases ``group/name``;
* ``torchrun_job`` (torch, ``torchrun``: the torch.distributed backend): ``torchrun_job_cases``.

A fixture reads every rank's result with ``shared_job(request.module, np_)`` (or
``torch_job(request.module, np_, group)``, the same for ``torchrun_job``): a dict, case
name -> list of per-rank results. Only the files collected for the session join the job, so
running one file runs only its own cases. (Under pytest-xdist every worker collects every
file: a worker that needs the job runs all of it.)

What does not belong here: bodies that need their own environment (``env=``), fresh processes
(checkpoints resumed in a new job), a rank that dies or fails on purpose, or a process that
must end in a given state. A body leaves the process as it found it (torch's default dtype,
global policies): the job's next cases run in it.

The session's summary names each job's slowest cases, and any case over :data:`SLOW_CASE_S`
(a stall shows there with the case's name; under pytest-xdist the workers keep theirs).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest

from tests.keras_models import one_tensorflow_thread
from tests.models import one_torch_thread, run_cases, timed_call

#: the job's time bound: a hang becomes a failure with every rank's output after this long
BASE_TIMEOUT_S, PER_CASE_TIMEOUT_S = 300, 60
#: and sooner, a rank that waits this long in one eager collective (hvdsync's watchdog) ends
#: the job -- a case's legitimate waits (a peer tracing its step) take seconds
COLLECTIVE_TIMEOUT_S = 120

#: per family: the module-level function that declares a file's cases, the case every rank
#: runs first (a framework's threads are fixed once it starts: a case that does not set them,
#: an example, must not decide them for the ones after), the job's environment, its launcher
FAMILIES: dict[str, tuple[str, tuple, dict[str, str], str]] = {
    "keras": ("shared_job_cases", (one_tensorflow_thread,), {}, "horovodrun"),
    "torch": ("torch_job_cases", (one_torch_thread,), {"HOROVOD_FUSION_THRESHOLD": "0"},
              "horovodrun"),
    "torchrun": ("torchrun_job_cases", (one_torch_thread,), {}, "torchrun"),
}
#: per job (family, rank count): each case's seconds on its slowest rank, for the summary
CASE_SECONDS: dict[tuple[str, int], dict[str, float]] = {}
#: a case slower than this is named in the summary as well (a stall shows up here first)
SLOW_CASE_S = 60


def run_family_job(family: str, modules: list, np_: int, directory: str,
                   env: Optional[dict[str, str]] = None) -> dict[str, list]:
    """One shared job of ``family`` on ``np_`` ranks: the cases that ``modules`` declare (those
    without the family's hook sit out), after the family's first case; per case name, every
    rank's ``(result, seconds)``. ``env``: more for the ranks (tests/time_job.py)."""
    hook, first, family_env, launcher = FAMILIES[family]
    cases = {f"{mod.__name__}:{name}": case
             for mod in modules if hasattr(mod, hook)
             for name, case in getattr(mod, hook)(np_, directory).items()}
    cases = {f"conftest:{first[0].__name__}": first, **cases}
    return run_cases(timed_call, np_, cases,
                     timeout=BASE_TIMEOUT_S + PER_CASE_TIMEOUT_S * len(cases),
                     env={"HVDSYNC_TIMEOUT_SECONDS": str(COLLECTIVE_TIMEOUT_S), **family_env,
                          **(env or {})},
                     launcher=launcher)


def slowest_rank_seconds(timed: dict[str, list]) -> dict[str, float]:
    """Per case of :func:`run_family_job`'s answer, its slowest rank's seconds."""
    return {name: max(s for _, s in ranks) for name, ranks in timed.items()}


def _jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          family: str) -> Callable[..., dict]:
    modules = list(dict.fromkeys(item.module for item in request.session.items
                                 if getattr(item, "module", None) is not None))
    results: dict[int, dict | BaseException] = {}

    def run(np_: int) -> dict:
        directory = str(tmp_path_factory.mktemp(f"{family}_job_np{np_}"))
        timed = run_family_job(family, modules, np_, directory)
        CASE_SECONDS[family, np_] = slowest_rank_seconds(timed)
        return {name: [r for r, _ in ranks] for name, ranks in timed.items()}

    def of(module: Any, np_: int, group: Optional[str] = None) -> dict:
        """``module``'s cases in the job on ``np_`` ranks (run on the first request); with
        ``group``, those named ``group/...``, without the prefix."""
        if np_ not in results:
            try:
                results[np_] = run(np_)
            except Exception as e:  # kept: every later request fails alike, without a rerun
                results[np_] = e
        if isinstance(results[np_], BaseException):
            raise results[np_]
        prefix = f"{module.__name__}:" + (f"{group}/" if group is not None else "")
        return {name[len(prefix):]: ranks for name, ranks in results[np_].items()
                if name.startswith(prefix)}

    return of


@pytest.fixture(scope="session")
def shared_job(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """The Keras files' shared rank job (module docstring)."""
    return _jobs(request, tmp_path_factory, "keras")


@pytest.fixture(scope="session")
def torch_job(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """The torch files' shared rank job (module docstring)."""
    return _jobs(request, tmp_path_factory, "torch")


@pytest.fixture(scope="session")
def torchrun_job(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """The torch files' shared ``torchrun`` job (module docstring)."""
    return _jobs(request, tmp_path_factory, "torchrun")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Where the shared jobs' time went: per job, its slowest cases, and any case slower than
    :data:`SLOW_CASE_S` (its slowest rank's seconds)."""
    for (family, np_), seconds in sorted(CASE_SECONDS.items()):
        ranked = sorted(seconds.items(), key=lambda kv: -kv[1])
        shown = ranked[:5] + [kv for kv in ranked[5:] if kv[1] > SLOW_CASE_S]
        terminalreporter.write_line(
            f"shared {family} job, {np_} ranks: {len(seconds)} cases, "
            f"{sum(seconds.values()):.1f} s; slowest: "
            + ", ".join(f"{name} {s:.1f} s" for name, s in shown))
