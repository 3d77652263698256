"""Local updates with stale global gradients (delay=) vs Horovod: time per step and accuracy
on planted-teacher data, on loopback and on an emulated slow network, side by side in one run.

    .venv/bin/python -m benchmarks.bench_delay [--np 2 4] [--nets loopback 1000 100]
        [--steps 300] [--width 256 --depth 6 --batch 128]

``--nets``: ``loopback`` (horovodrun on this host) and/or link rates in Mbit/s, each rank in
its own network namespace (benchmarks/network.py; needs root, skipped with a message
otherwise). Every method of one (network, ranks) cell runs in the same job one after the
other from the same initial weights and data: plain Horovod, hvdsync with nothing enabled,
and hvdsync ``delay=`` settings. Reported: median step time and its ratio to Horovod's,
held-out accuracy after ``--steps`` steps (after ``flush()``), the share of steps that had to
wait, and the mean lag of the folded global gradients. Time per step is the wall time of
all steps (and the final ``flush()``) divided by the steps, on the slowest rank: a median
would hide the steps that wait, which is where a comm-bound run spends its time.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import markdown_table, report, shows_progress
from benchmarks.network import EmulatedNetwork, namespaces_unavailable, run_ranks_on
from hvdsync.testing import progress

METHODS = {
    "horovod": None,
    "hvdsync (nothing on)": {},
    "delay s=1 K=8": dict(delay=dict(staleness=1, average_every=8)),
    "delay s=2 K=16": dict(delay=dict(staleness=2, average_every=16)),
    "delay s=4 K=32": dict(delay=dict(staleness=4, average_every=32)),
}


def methods_body(methods: list[str], steps: int, width: int, depth: int, batch: int,
                 seed: int) -> dict:
    """On each rank: train every method in turn from the same start; per method the step
    times, held-out accuracy and delay stats."""
    import horovod.torch as horovod
    import torch
    from torch import nn

    import hvdsync.torch as hvd
    from examples.torch.train_teacher import Teacher, student
    hvd.init()
    torch.set_num_threads(1)
    teacher = Teacher()
    x_test, y_test = teacher.batch(torch.Generator().manual_seed(10**6 + seed), 4000)
    out = {}
    for name in ["warm-up", *methods]:
        torch.manual_seed(seed)
        model = student(depth, width)
        base = torch.optim.Adam(model.parameters(), lr=2e-3)
        kwargs = METHODS.get(name)
        if kwargs is None:
            opt = horovod.DistributedOptimizer(base, named_parameters=model.named_parameters())
        else:
            opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           **kwargs)
        g = torch.Generator().manual_seed(seed * 1000 + hvd.rank())
        data = [teacher.batch(g, batch) for _ in range(steps if name != "warm-up" else 20)]
        hvd.allreduce(torch.zeros(1), name=f"start.{name}")  # start together
        start = time.perf_counter()
        for i, (x, y) in enumerate(data, 1):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            progress.step(i, len(data), f"{name}, seed {seed}")
        if kwargs is not None:
            opt.flush()
        wall = time.perf_counter() - start
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        total = opt.stats.as_dict()["total"] if kwargs is not None else {}
        status = opt.delay_status if kwargs is not None else {}
        hist = status.get("staleness", {})
        out[name] = dict(step_s=wall / len(data), accuracy=acc,
                         waited=total.get("waited", 0) / steps,
                         mean_lag=(sum(k * v for k, v in hist.items()) / sum(hist.values())
                                   if hist else 0.0),
                         bytes_per_step=total.get("bytes_sent", 0) / steps)
    return out


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--nets", nargs="+", default=["loopback", "1000", "100"],
                    help="'loopback' and/or link rates in Mbit/s")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=128, help="per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    args = ap.parse_args(argv)
    reason = namespaces_unavailable()
    rows, data = [], {}
    for net_name in args.nets:
        if net_name != "loopback" and reason:
            print(f"skipping the {net_name} Mbit/s network: {reason}")
            continue
        for np_ in args.np:
            progress.cell(f"{np_} ranks, {net_name}" + ("" if net_name == "loopback" else " Mbit/s"))
            call = (args.methods, args.steps, args.width, args.depth, args.batch, args.seed)
            if net_name == "loopback":
                label = "loopback"
                res = run_ranks_on(None, methods_body, np_, args=call, timeout=1800)
            else:
                with EmulatedNetwork(np_, rate_mbit=float(net_name)) as net:
                    label = net.describe()
                    res = run_ranks_on(net, methods_body, np_, args=call, timeout=1800)
            # a step ends when the slowest rank's does: the max over ranks
            per = {m: dict(step_s=max(r[m]["step_s"] for r in res),
                           accuracy=statistics.mean(r[m]["accuracy"] for r in res),
                           waited=statistics.mean(r[m]["waited"] for r in res),
                           mean_lag=statistics.mean(r[m]["mean_lag"] for r in res),
                           bytes_per_step=res[0][m]["bytes_per_step"])
                   for m in args.methods}
            data[f"{net_name}/np{np_}"] = dict(network=label, ranks=np_, methods=per)
            base = per.get("horovod")
            for m, v in per.items():
                rows.append([label, np_, m, round(v["step_s"] * 1e3, 1),
                             round(base["step_s"] / v["step_s"], 2) if base else "-",
                             f"{v['accuracy'] * 100:.1f}", f"{v['waited'] * 100:.0f} %",
                             round(v["mean_lag"], 2)])
            print(markdown_table(["network", "ranks", "method", "step ms", "speedup",
                                  "accuracy %", "steps waited", "mean lag"],
                                 rows[-len(per):]), flush=True)
    headers = ["network", "ranks", "method", "time/step ms (slowest rank)",
               "speedup vs horovod", "held-out accuracy %",
               "steps that waited", "mean lag (steps)"]
    model = f"{args.depth}-layer MLP width {args.width}, batch {args.batch}/rank, Adam"
    report("delay_teacher", f"delay= vs Horovod, {model}, {args.steps} steps",
           markdown_table(headers, rows), dict(model=model, steps=args.steps, cells=data),
           "benchmarks.bench_delay", argv)


if __name__ == "__main__":
    main()
