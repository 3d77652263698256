"""Selected layer pushes: accuracy at a fixed byte budget for the hypernet selector vs two
simple selectors (largest residual norm, uniform random) and dense, side by side in one run.

    .venv/bin/python -m benchmarks.bench_select [--np 2] [--seeds 3] [--k 0.25]

Workloads: the digits MLP (3 layers: k = 25 % pushes 1 layer per step) and a 12-layer MLP on
planted-teacher data (3 layers per step). Every selector pushes the same number of layers
per step with the same wait bound, so the bytes are the same up to which layers (of
different sizes) are picked; the table shows them.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import markdown_table, report
from hvdsync.testing import run_ranks

SELECTORS = ("hypernet", "norm", "random")


def seeds_body(workload: str, select: dict | None, seeds: list[int]) -> list[dict]:
    if workload == "digits":
        from examples.torch.train_digits import train
        runs = [train(epochs=8, seed=s, select=select, verbose=False) for s in seeds]
    else:
        from examples.torch.train_teacher import train
        runs = [train(steps=600, seed=s, select=select, verbose=False) for s in seeds]
    return [dict(accuracy=r["accuracy"], bytes_sent=r["stats"]["total"]["bytes_sent"],
                 bytes_dense=r["stats"]["total"]["bytes_dense"],
                 sent=r["stats"]["total"]["layers_sent"], steps=r["stats"]["total"]["step"])
            for r in runs]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--k", type=float, default=0.25, help="fraction of layers per step")
    ap.add_argument("--max-wait", type=int, default=4)
    args = ap.parse_args(argv)
    seeds = list(range(args.seeds))
    rows, data = [], {}
    for workload in ("digits", "teacher12"):
        configs = {"dense": None}
        for sel in SELECTORS:
            configs[f"{sel} top-{args.k:g}"] = dict(k=args.k, selector=sel,
                                                   max_wait=args.max_wait)
        dense_acc = None
        for name, cfg in configs.items():
            runs = run_ranks(seeds_body, np=args.np, args=(workload, cfg, seeds),
                             timeout=900)[0]
            acc = statistics.mean(r["accuracy"] for r in runs)
            sd = statistics.stdev(r["accuracy"] for r in runs) if len(runs) > 1 else 0.0
            dense_acc = acc if dense_acc is None else dense_acc
            ratio = statistics.mean(r["bytes_sent"] / r["bytes_dense"] for r in runs)
            per_step = statistics.mean(r["sent"] / r["steps"] for r in runs)
            rows.append([workload, name, f"{acc * 100:.2f} +- {sd * 100:.2f}",
                         round((acc - dense_acc) * 100, 2), round(per_step, 2), ratio])
            data[f"{workload}/{name}"] = dict(config=cfg, runs=runs, accuracy=acc, std=sd,
                                              bytes_ratio=ratio, layers_per_step=per_step)
    table = markdown_table(["workload", "selector", "accuracy % (mean +- sd)", "vs dense (pt)",
                            "layers pushed/step", "bytes sent / dense"], rows)
    report(f"select_np{args.np}", f"selected layer pushes, {args.np} ranks, mean of "
           f"{args.seeds} seeds", table, {"args": vars(args), "results": data},
           "benchmarks.bench_select", argv)


if __name__ == "__main__":
    main()
