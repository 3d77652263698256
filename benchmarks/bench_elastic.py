"""Horovod Elastic, technique by technique: what a lost rank and a rank removed and added
back cost -- steps lost, seconds until training goes on -- and whether the replicas end
identical. Each (technique, fault) is its own job, 3 ranks on this machine (one slot per host
name), ``--min-np 2``, the job and body of tests/test_torch_elastic.py:

* ``kill``: rank 2 SIGKILLs itself mid-step at step 13 (commits every 4 steps);
* ``remove``: rank 0 takes a host out of the discovery file at step 13 and puts it back 3 s
  later (a new rank joins).

    .venv/bin/python -m benchmarks.bench_elastic [--seeds 1] [--cases none threshold ...]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from benchmarks.common import markdown_table, report
from hvdsync.testing import run_elastic
from tests.test_torch_elastic import CASES, GLOO_TIMEOUT_S, elastic_body


def _figures(scenario: str, ranks: list[dict]) -> dict:
    """From every process's result: the final size, steps lost, seconds from each event to
    training going on, and whether the replicas are identical and finite."""
    original = [r for r in ranks if r["resets"]]
    events = original[0]["events"]
    resets = original[0]["resets"]
    recover = {}
    if scenario == "kill":
        recover["lost rank"] = max(r["resets"][0]["resumed"] for r in original) - events["killed"]
    else:
        recover["removed"] = max(r["resets"][0]["resumed"] for r in original) - events["removed"]
        if len(resets) > 1:
            recover["added"] = max(r["resets"][1]["resumed"] for r in original) - events["added"]
    lost = max(x["reached"] - x["from_step"] for r in original for x in r["resets"])
    case = next(iter(ranks[0]["params"]))
    identical = all(np.array_equal(ranks[0]["params"][case], r["params"][case]) for r in ranks)
    finite = all(np.isfinite(r["params"][case]).all() for r in ranks)
    return dict(size=len(ranks), sizes=[x["size"] for x in resets], steps_lost=lost,
                recover_s=recover, identical=identical, finite=finite)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1, help="runs of each job")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = ap.parse_args(argv)
    rows, data = [], {}
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT_S)}
    for case in args.cases:
        for scenario in ("kill", "remove"):
            runs = [_figures(scenario, run_elastic(elastic_body, np=3, min_np=2,
                                                   args=(scenario, (case,)), timeout=300,
                                                   env=env))
                    for _ in range(args.seeds)]
            data[f"{case}/{scenario}"] = runs
            for what in runs[0]["recover_s"]:
                secs = [r["recover_s"][what] for r in runs if what in r["recover_s"]]
                rows.append([case, scenario, what, " -> ".join(map(str, runs[0]["sizes"])),
                             max(r["steps_lost"] for r in runs), statistics.mean(secs),
                             max(secs), all(r["identical"] and r["finite"] for r in runs)])
    table = markdown_table(["technique", "fault", "event", "sizes", "steps lost (max)",
                            "s to go on (mean)", "s (max)", "replicas identical, finite"],
                           rows)
    report("elastic", f"Horovod Elastic on this machine, 3 ranks, --min-np 2, "
           f"{args.seeds} run(s) per cell (Gloo timeout {GLOO_TIMEOUT_S} s)", table,
           {"args": vars(args), "runs": data}, "benchmarks.bench_elastic", argv)


if __name__ == "__main__":
    main()
