"""Step time of hvdsync's pipelined per-layer clipping vs Horovod's documented clipping
pattern (``synchronize(); clip_grad_norm_(); with skip_synchronize(): step()``), same model,
same ranks, interleaved in one run. Ratios, not absolute times, are what to read.

    .venv/bin/python -m benchmarks.bench_clipping [--np 2] [--width 512] [--depth 8]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import markdown_table, median_step_time, report, shows_progress
from hvdsync.testing import run_ranks
from hvdsync.testing import progress

METHODS = ["horovod (no clip)", "horovod sync->clip_grad_norm_->step", "hvdsync (no clip)",
           "hvdsync clip max_norm per layer", "hvdsync clip ema+ratio per layer"]


def bench_body(width: int, depth: int, batch: int, steps: int, reps: int) -> dict:
    import copy

    import horovod.torch as horovod_hvd
    import torch

    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    base = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())])
    x = torch.randn(batch, width)
    y = torch.randn(batch, width)

    def make(method):
        model = copy.deepcopy(base)
        sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        named = model.named_parameters()
        if method.startswith("horovod"):
            opt = horovod_hvd.DistributedOptimizer(sgd, named_parameters=named)
        elif "max_norm" in method:
            opt = hvd.DistributedOptimizer(sgd, named_parameters=named, clip=dict(max_norm=1.0))
        elif "ema" in method:
            opt = hvd.DistributedOptimizer(sgd, named_parameters=named,
                                           clip=dict(ema=(0.9, 2.0), ratio=0.1, warmup=2))
        else:
            opt = hvd.DistributedOptimizer(sgd, named_parameters=named)

        def step():
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if method == "horovod sync->clip_grad_norm_->step":
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        return step

    steppers = {m: make(m) for m in METHODS}
    for s in steppers.values():  # warm up
        for _ in range(3):
            s()
    times = {m: [] for m in METHODS}
    for rep in range(reps):  # interleave methods so drift hits all of them alike
        for i, (m, s) in enumerate(steppers.items()):
            progress.step(rep * len(steppers) + i, reps * len(steppers), f"rep {rep + 1}, {m}")
            times[m].append(median_step_time(s, steps))
    return {m: statistics.median(v) for m, v in times.items()}


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    res = run_ranks(bench_body, np=args.np, timeout=900,
                    args=(args.width, args.depth, args.batch, args.steps, args.reps))
    # A step is as slow as its slowest rank.
    step = {m: max(r[m] for r in res) for m in METHODS}
    ref = step["horovod sync->clip_grad_norm_->step"]
    rows = [[m, step[m] * 1e3, step[m] / ref] for m in METHODS]
    table = markdown_table(["method", "step ms", "ratio vs horovod clip pattern"], rows)
    report(f"clipping_cpu_np{args.np}_{args.depth}x{args.width}_b{args.batch}",
           f"clipping step time, {args.np} ranks (Gloo, CPU), MLP {args.depth}x{args.width}, "
           f"batch {args.batch}", table, {"args": vars(args), "step_seconds": step},
           "benchmarks.bench_clipping", argv)


if __name__ == "__main__":
    main()
