"""Horovod Elastic, technique by technique: what a lost rank and a rank removed and added
back cost -- steps lost, seconds until training goes on -- and whether the replicas end
identical. 3 ranks on this machine (one slot per host name), ``--min-np 2``, the jobs and
bodies of tests/test_torch_elastic.py (torch: each (technique, fault) its own job) and
tests/test_keras_elastic.py (``--framework keras``: ``model.fit`` with Horovod's elastic
callbacks, every technique's model in the one job, hit by the same fault; ``keras-torch``: the
same on Keras' torch backend, TensorFlow hidden):

* ``kill``: rank 2 SIGKILLs itself mid-step at step 13 (commits every 4 steps);
* ``remove``: rank 0 takes a host out of the discovery file at step 13; once the job went on
  as 2 ranks, the host is put back (a new rank joins).

    .venv/bin/python -m benchmarks.bench_elastic [--seeds 1] [--cases none threshold ...]
    .venv/bin/python -m benchmarks.bench_elastic --framework keras|keras-torch [--seeds 1]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from benchmarks.common import markdown_table, report, shows_progress
from hvdsync.testing import progress, run_elastic
from tests.test_keras_elastic import BACKENDS, GLOO_TIMEOUT, keras_elastic_body
from tests.test_keras_elastic import CASES as KERAS_CASES
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

    def arrays(r: dict, case: str) -> list:  # torch: one flat array; Keras: by variable
        p = r["params"][case]
        return list(p.values()) if isinstance(p, dict) else [p]
    cases = list(ranks[0]["params"])
    identical = all(np.array_equal(a, b) for r in ranks for case in cases
                    for a, b in zip(arrays(ranks[0], case), arrays(r, case)))
    finite = all(np.isfinite(a).all() for r in ranks for case in cases for a in arrays(r, case))
    return dict(size=len(ranks), sizes=[x["size"] for x in resets], steps_lost=lost,
                recover_s=recover, identical=identical, finite=finite)


def _job(framework: str, scenario: str, case: str) -> list[dict]:
    if framework.startswith("keras"):
        backend = BACKENDS["torch" if framework == "keras-torch" else "tensorflow"]
        return run_elastic(keras_elastic_body, np=3, min_np=2, args=(scenario,), timeout=300,
                           env={"HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT[scenario]),
                                **backend})
    return run_elastic(elastic_body, np=3, min_np=2, args=(scenario, (case,)), timeout=300,
                       env={"HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT_S)})


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1, help="runs of each job")
    ap.add_argument("--framework", choices=["torch", "keras", "keras-torch"], default="torch")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES),
                    help="torch: the techniques, one job each (Keras runs all in one job)")
    args = ap.parse_args(argv)
    rows, data = [], {}
    cases = (args.cases if args.framework == "torch"
             else ["all at once: " + ", ".join(KERAS_CASES)])
    for case in cases:
        for scenario in ("kill", "remove"):
            runs = []
            for seed in range(args.seeds):
                progress.cell(f"{case}, {scenario} a rank, run {seed + 1}/{args.seeds}")
                runs.append(_figures(scenario, _job(args.framework, scenario, case)))
            data[f"{case}/{scenario}"] = runs
            for what in runs[0]["recover_s"]:
                secs = [r["recover_s"][what] for r in runs if what in r["recover_s"]]
                rows.append([case, scenario, what, " -> ".join(map(str, runs[0]["sizes"])),
                             max(r["steps_lost"] for r in runs), statistics.mean(secs),
                             max(secs), all(r["identical"] and r["finite"] for r in runs)])
    table = markdown_table(["technique", "fault", "event", "sizes", "steps lost (max)",
                            "s to go on (mean)", "s (max)", "replicas identical, finite"],
                           rows)
    keras = args.framework.startswith("keras")
    timeout = (f"Gloo timeout {GLOO_TIMEOUT['kill']} s, {GLOO_TIMEOUT['remove']} s with a "
               "removal" if keras else f"Gloo timeout {GLOO_TIMEOUT_S} s")
    on = {"torch": "", "keras": ", Keras 3 fit", "keras-torch": ", Keras 3 fit, torch backend"}
    report("elastic_" + args.framework.replace("-", "_") if keras else "elastic",
           f"Horovod Elastic on this machine{on[args.framework]}, 3 ranks, "
           f"--min-np 2, {args.seeds} run(s) per cell ({timeout})", table,
           {"args": vars(args), "runs": data}, "benchmarks.bench_elastic", argv)


if __name__ == "__main__":
    main()
