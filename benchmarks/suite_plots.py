"""The bench suite's plots (benchmarks/bench_suite.py): the held-out metric against training
time per cell, and bytes per step per method."""

from __future__ import annotations

import math
import statistics

from benchmarks.common import RESULTS
from benchmarks.workloads import METRIC_LABEL, as_shown


def plot(results: dict, name: str) -> list[str]:
    """the held-out metric vs training time per cell, and bytes per step per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = list(results)
    cols = min(3, len(cells))
    rows = math.ceil(len(cells) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax, cell in zip(axes.flat, cells):
        s = results[cell]
        metric = s.get("metric", "accuracy")
        for m, v in s["methods"].items():
            t, a = zip(*v["curve"])
            ax.plot(t, [as_shown(metric, x) for x in a], marker=".", label=m,
                    linewidth=2.2 if m.startswith("hvdsync rec") else 1.2)
        target = as_shown(metric, s["target"])
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        if s.get("early_targets"):  # a longer cell: Horovod's score at the usual steps
            ax.axhline(as_shown(metric, statistics.mean(s["early_targets"])), color="grey",
                       linestyle="--", linewidth=1)
        ax.set_title(cell, fontsize=9)
        ax.set_xlabel("training time, slowest rank (s)")
        ax.set_ylabel(METRIC_LABEL[metric])
        if metric == "loss":
            ax.set_ylim(top=target + 1.5)
        else:
            ax.set_ylim(bottom=max(0, target - 40))
    for ax in list(axes.flat)[len(cells):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    acc_path = RESULTS / f"{name}_accuracy.png"
    fig.savefig(acc_path, dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 3.8), squeeze=False)
    for ax, cell in zip(axes.flat, cells):
        ms = results[cell]["methods"]
        base = ms["horovod"]["bytes_per_step"]
        ax.barh(list(ms), [v["bytes_per_step"] / base for v in ms.values()])
        ax.set_title(cell, fontsize=9)
        ax.set_xlabel("bytes per rank per step / plain Horovod")
        ax.invert_yaxis()
    fig.tight_layout()
    bytes_path = RESULTS / f"{name}_bytes.png"
    fig.savefig(bytes_path, dpi=90)
    plt.close(fig)
    return [str(acc_path), str(bytes_path)]
