"""Accumulation thresholds on scikit-learn digits: accuracy vs how much is sent, compared with
dense (every layer every step) in one run, mean over seeds.

    .venv/bin/python -m benchmarks.bench_threshold [--np 2] [--seeds 3] [--epochs 8]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import markdown_table, report, shows_progress
from hvdsync.testing import run_ranks
from hvdsync.testing import progress

CONFIGS = {
    "dense (hvdsync, no threshold)": None,
    "threshold 0.3, max_skip 8": dict(threshold=0.3, max_skip=8),
    "threshold 0.6, max_skip 8": dict(threshold=0.6, max_skip=8),
    "threshold 1.0, max_skip 8": dict(threshold=1.0, max_skip=8),
    "relative 0.05, max_skip 8": dict(threshold=0.05, relative=True, max_skip=8),
}


def seeds_body(threshold, epochs: int, seeds: list[int]) -> list[dict]:
    from examples.torch.train_digits import train
    out = []
    for i, seed in enumerate(seeds):
        progress.step(i, len(seeds), f"threshold={threshold}, seed {seed}")
        r = train(epochs=epochs, seed=seed, threshold=threshold, verbose=False)
        t = r["stats"]["total"]
        out.append(dict(accuracy=r["accuracy"], skipped=t["layers_skipped"],
                        sent=t["layers_sent"], bytes_sent=t["bytes_sent"],
                        bytes_dense=t["bytes_dense"]))
    return out


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=8)
    args = ap.parse_args(argv)
    seeds = list(range(args.seeds))
    rows, data = [], {}
    dense_acc = None
    for name, cfg in CONFIGS.items():
        runs = run_ranks(seeds_body, np=args.np, args=(cfg, args.epochs, seeds), timeout=900)[0]
        acc = statistics.mean(r["accuracy"] for r in runs)
        skip = statistics.mean(r["skipped"] / (r["skipped"] + r["sent"]) for r in runs)
        sent = statistics.mean(r["bytes_sent"] / r["bytes_dense"] for r in runs)
        dense_acc = acc if dense_acc is None else dense_acc
        rows.append([name, acc * 100, (acc - dense_acc) * 100, skip * 100, sent])
        data[name] = dict(config=cfg, runs=runs, accuracy=acc, skip_ratio=skip, bytes_ratio=sent)
    table = markdown_table(["config", "accuracy %", "vs dense (pt)", "layer-sends skipped %",
                            "bytes sent / dense"], rows)
    report(f"threshold_digits_np{args.np}",
           f"accumulation threshold, digits MLP, {args.np} ranks, {args.epochs} epochs, "
           f"mean of {args.seeds} seeds", table, {"args": vars(args), "configs": data},
           "benchmarks.bench_threshold", argv)


if __name__ == "__main__":
    main()
