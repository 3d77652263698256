"""``select=``'s selectors at equal bytes: hypernet (hvdsync's objective), the seed design's
hypernet, largest residual norm, random and round-robin, each pushing a quarter of the dense
bytes per step (``budget=0.25``, a layer at least every 9 steps), next to plain Horovod, in
one job per workload through the standard suite (:mod:`benchmarks.bench_suite`): same
initial weights and data streams, 2 ranks x 1 core, 100 Mbit/s links, 3 seeds.

    .venv/bin/python -m benchmarks.bench_select [--workloads digits_mlp teacher_cnn stdlib_lm]
                                                [--seeds 3] [--nets 100]

The table reads at equal bytes (the metric after the workload's steps: every selector sent
the same bytes) and at equal wall time (the metric at the end: every method trained for
Horovod's training time), with the time to Horovod's final metric. Results:
``benchmarks/results/select_budget_np2.{md,json}`` and plots.
"""

from __future__ import annotations

import argparse

from benchmarks import bench_suite


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["digits_mlp", "teacher_cnn", "stdlib_lm"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--nets", nargs="+", default=["100"])
    ap.add_argument("--name", default="select_budget_np2")
    args = ap.parse_args(argv)
    methods = ["horovod"] + [f"hvdsync {label} @25%" for label in bench_suite.SELECTORS]
    bench_suite.main(["--workloads", *args.workloads, "--np", "2", "--nets", *args.nets,
                      "--seeds", str(args.seeds), "--name", args.name, "--methods", *methods])


if __name__ == "__main__":
    main()
