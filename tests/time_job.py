"""Time a shared rank job's cases, to see where the suite's time goes.

Runs the cases that the given test files declare for one family's shared job
(tests/conftest.py: ``keras``, ``torch`` or ``torchrun``) in one real job on ``--np`` ranks,
as the suite does, with extra environment variables for the ranks (``NAME=VALUE``), and prints
the job's wall time, the ranks' CPU (user and system), and the slowest cases::

    python -m tests.time_job keras tests.test_keras_compiled tests.test_keras_compositions
    python -m tests.time_job torch tests.test_torch_parity --env HOROVOD_CYCLE_TIME=20

(benchmarks/results/suite_timings.md, "Horovod's cycle time, measured"). ``--json FILE``
writes every case's seconds (its slowest rank's). Not part of the suite: minutes of real ranks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
import time

from tests.conftest import FAMILIES, run_family_job, slowest_rank_seconds


def time_job(family: str, modules: list[str], np_: int, env: dict[str, str]
             ) -> tuple[dict[str, float], dict[str, float]]:
    """Every case's seconds (slowest rank) and the job's totals: wall, and the ranks' user and
    system CPU (the launcher's children, reaped when the job ends)."""
    hook = FAMILIES[family][0]
    imported = [importlib.import_module(name) for name in modules]
    for module in imported:
        if not hasattr(module, hook):
            raise SystemExit(f"{module.__name__} declares no {hook}: not part of the {family} "
                             "job")
    start, before = time.perf_counter(), os.times()
    timed = run_family_job(family, imported, np_, tempfile.mkdtemp(), env)
    after = os.times()
    totals = dict(wall=time.perf_counter() - start,
                  user=after.children_user - before.children_user,
                  system=after.children_system - before.children_system)
    return slowest_rank_seconds(timed), totals


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("modules", nargs="+", help="test modules, e.g. tests.test_keras_compiled")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="for the ranks, e.g. HOROVOD_CYCLE_TIME=20")
    parser.add_argument("--json", help="write every case's seconds here")
    parser.add_argument("--show", type=int, default=10, help="the slowest cases shown")
    a = parser.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in a.env)
    seconds, totals = time_job(a.family, a.modules, a.np, env)
    print(f"{a.family} job, {a.np} ranks, {len(seconds)} cases: {totals['wall']:.1f} s wall, "
          f"ranks' CPU {totals['user']:.1f} s user + {totals['system']:.1f} s system")
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:a.show]:
        print(f"  {s:7.1f} s  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(seconds, f, indent=1)


if __name__ == "__main__":
    main()
