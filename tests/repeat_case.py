"""Repeat one case of the shared rank job many times, to find a rare hang or divergence.

A hang that shows up once in tens of fits does not show in one suite run; this runs one case
of a test file's ``shared_job_cases`` (tests/conftest.py) ``--fits`` times in each of
``--jobs`` real jobs, with hvdsync's collective watchdog shortened so that a hang fails the
job in ``--timeout`` seconds with every rank's output, checks that every fit ends with the
same parameters (bit for bit: a race shows as a difference), and prints how many jobs
finished alike::

    python -m tests.repeat_case tests.test_keras_techniques delay_flush --fits 50 --jobs 5

(the check of benchmarks/results/keras_lab_notes.md, "Host flags": before the fix 8 hangs in
~350 fits, after it none in 250). Not part of the suite: minutes of real ranks for one case.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from typing import Any, Optional

import numpy as np

from hvdsync.testing import RanksFailed, run_ranks
from tests.keras_models import one_tensorflow_thread


def _final(result: Any) -> Optional[dict]:
    """The parameters a fit ended with (``final``, or its last recorded ``weights``)."""
    if not isinstance(result, dict):
        return None
    return result.get("final") or (result["weights"][-1] if result.get("weights") else None)


def repeat(module: str, case: str, np_: int, fits: int) -> int:
    """On a rank: the case ``fits`` times (its body and arguments as the shared job has them);
    how many fits ended with parameters (:func:`_final`) other than the first's, bit for bit
    -- a fit is deterministic, so any difference is a race."""
    one_tensorflow_thread()
    cases = importlib.import_module(module).shared_job_cases(np_, tempfile.mkdtemp())
    fn, *args = cases[case]
    first, differed = _final(fn(*args)), 0
    for _ in range(fits - 1):
        final = _final(fn(*args))
        if first is not None and (final.keys() != first.keys() or not all(
                np.array_equal(final[k], first[k]) for k in first)):
            differed += 1
    return differed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module", help="a test module with shared_job_cases, e.g. "
                        "tests.test_keras_techniques")
    parser.add_argument("case", help="one of its cases")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--fits", type=int, default=50, help="repetitions in one job")
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=30,
                        help="seconds a rank waits in a collective before the job fails")
    a = parser.parse_args(argv)
    cases = importlib.import_module(a.module).shared_job_cases(a.np, tempfile.mkdtemp())
    if a.case not in cases:
        parser.error(f"{a.module} has no case {a.case!r} on {a.np} ranks: {sorted(cases)}")
    failed = 0
    for job in range(1, a.jobs + 1):
        try:
            differed = run_ranks(repeat, np=a.np, args=(a.module, a.case, a.np, a.fits),
                                 timeout=a.timeout + 60 * a.fits,
                                 env={"HVDSYNC_TIMEOUT_SECONDS": str(a.timeout)})
            print(f"job {job}: {a.fits} fits finished; per rank, fits whose parameters "
                  f"differ from the first's: {differed}", flush=True)
            failed += any(differed)
        except RanksFailed as e:
            failed += 1
            print(f"job {job}: FAILED\n{e}", flush=True)
    print(f"{a.case}: {a.jobs - failed} of {a.jobs} jobs of {a.fits} fits finished alike")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
