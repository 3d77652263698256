"""The fixed cost per step: what each technique adds to a short step, counted the way a GPU
pays for it, against Horovod's optimizer and torch's own equivalents.

    python -m benchmarks.bench_fixed_cost                      # everything (~15 min on 2 cores)
    python -m benchmarks.bench_fixed_cost --part ops           # ops and collectives only
    python -m benchmarks.bench_fixed_cost --part time --rounds 30

The model is compute-light on purpose: an MLP of ``--depths`` Linear layers (width 256,
batch 32, momentum SGD), so that what the wrapper adds is not hidden by the model's own work.

* **Ops dispatched per step** (``--part ops``): every aten op of a step, counted with a
  ``TorchDispatchMode`` on rank 0 of a real 2-rank job (Horovod over Gloo), with the torch
  adapter's statistics in the form a GPU runs them (``select=``'s dot products take an op per
  tensor on a CPU instead, where that is faster: hvdsync/torch/foreach.py, ``GPU_FORM_ON_CPU``),
  averaged over
  ``--window`` steps (a multiple of the outer synchronization's schedule: ``delay="streaming"``
  syncs a fragment every 2 steps). On a GPU each op that is not a view is a kernel launch
  (~5-10 us of host time each); views cost a dispatch but no kernel. Rows are the ops *added*
  to the bare optimizer's step (the no-exchange floor, which dispatches the model's forward,
  backward and update), for every depth, with the growth per added layer from the smallest to
  the largest depth. Collectives per step: hvdsync's own count (``opt.stats``); Horovod's and
  DDP's are the calls they make into the engine (counted by wrapping them).
* **Where the ops go**: for the 12-layer model, each method's added ops by the function of
  hvdsync (or Horovod) that dispatched them.
* **Host time per step** (``--part time``): 1 rank and 2 ranks x 1 core on loopback, the
  methods interleaved round by round (the order rotating), each round ``--steps`` steps after
  a warm-up step; the figure is the ratio to Horovod's optimizer in the same round, averaged
  over rounds with a 95 % interval (Student t), as ``bench_overhead`` computes it. On one rank
  Horovod's optimizer is the bare optimizer (it registers no hooks); hvdsync keeps its hooks
  and techniques but sends nothing.
* **Where the microseconds go** (``--part time``): one process, cProfile over ``--steps``
  steps of each method; hvdsync's own functions with the most time per step.

Results: ``benchmarks/results/fixed_cost.{json,md}`` (docs/benchmarks.md, "Fixed cost per
step").
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import time
from typing import Any

from benchmarks.bench_overhead import RATIO_COLUMNS, ratio_cells, summarize
from benchmarks.common import markdown_table, report, shows_progress
from hvdsync.testing import run_ranks
from hvdsync.testing import progress

#: method -> (kind, hvdsync keywords): "bare" is the wrapped optimizer alone (no exchange)
METHODS: dict[str, tuple[str, Any]] = {
    "bare optimizer (no exchange)": ("bare", None),
    "bare + clip_grad_norm_(foreach)": ("bare+clip", None),
    "horovod": ("horovod", None),
    "horovod: synchronize, clip_grad_norm_, step": ("horovod+clip", None),
    "ddp": ("ddp", None),
    "hvdsync (nothing on)": ("hvdsync", {}),
    "clip=": ("hvdsync", dict(clip=dict(max_norm=1e9))),
    "clip= global": ("hvdsync", dict(clip=dict(max_norm=1e9, mode="global"))),
    "clip= ema + ratio": ("hvdsync", dict(clip=dict(ema=(0.9, 2.0), ratio=1e3, warmup=1))),
    "threshold=0": ("hvdsync", dict(threshold=0.0)),
    "select= (every layer)": ("hvdsync", dict(select=dict(k=1.0))),
    "delay= staleness 0": ("hvdsync", dict(delay=dict(staleness=0))),
    "delay= staleness 2": ("hvdsync", dict(delay=dict(staleness=2, average_every=8))),
    'delay="streaming"': ("hvdsync", dict(delay="streaming")),
    "lowrank=4": ("hvdsync", dict(lowrank=dict(rank=4, warmup_steps=0))),
}
#: the methods whose host time is measured by default (the rest: ops only)
TIMED = ["bare optimizer (no exchange)", "horovod", "hvdsync (nothing on)", "clip=",
         "horovod: synchronize, clip_grad_norm_, step", "threshold=0", "select= (every layer)",
         "delay= staleness 0", 'delay="streaming"', "lowrank=4"]
WIDTH, BATCH, DDP_PORT = 256, 32, 29541


def mlp(depth: int, width: int = WIDTH):
    import torch
    from torch import nn
    torch.manual_seed(0)
    layers = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def build(name: str, depth: int, horovod: Any, hvd: Any, width: int = WIDTH):
    """``(optimizer, step function)`` for ``name`` on an MLP of ``depth`` layers."""
    import torch
    from torch import nn
    kind, options = METHODS[name]
    model = mlp(depth, width)
    base = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    net, opt, clip = model, base, kind.endswith("+clip")
    if kind.startswith("horovod"):
        opt = horovod.DistributedOptimizer(base, named_parameters=model.named_parameters())
    elif kind == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
    elif kind == "hvdsync":
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       **options)
    g = torch.Generator().manual_seed(1 + hvd.rank())
    x, y = torch.randn(BATCH, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        if clip and kind == "horovod+clip":
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, foreach=True)
            with opt.skip_synchronize():
                opt.step()
            return
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, foreach=True)
        opt.step()
    return opt, step


def op_counter(callers: bool = True):
    """A dispatch-mode counter: ops, views among them, and (``callers``) each op's caller in
    hvdsync or Horovod (the first frame of theirs on the stack)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    roots = tuple(os.path.dirname(__import__(m).__file__) + os.sep for m in ("hvdsync",))
    try:
        roots += (os.path.dirname(__import__("horovod").__file__) + os.sep,)
    except ImportError:
        pass
    torch_root = os.path.dirname(__import__("torch").__file__) + os.sep
    # the model's, the loss's and the wrapped optimizer's own code (and the harness's)
    theirs = tuple(torch_root + p for p in ("optim" + os.sep, "nn" + os.sep + "modules",
                                            "autograd" + os.sep, "_tensor.py"))
    harness = os.path.join(roots[0], "testing.py")

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = self.views = 0
            self.by_caller: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.views += bool(getattr(func, "is_view", False))
            if not callers:
                return func(*args, **(kwargs or {}))
            frame, caller = sys._getframe(1), "model, loss, optimizer (torch)"
            while frame is not None:
                path = frame.f_code.co_filename
                if path.startswith(theirs) or path == harness:
                    break
                if path.startswith(roots):
                    caller = (path.split(os.sep + "site-packages" + os.sep)[-1]
                              .split("hvdsync" + os.sep, 1)[-1].replace(os.sep, "/")
                              + ":" + frame.f_code.co_name)
                    if "horovod" in path and "hvdsync" not in path:
                        caller = "horovod/" + caller.rsplit("horovod/", 1)[-1]
                    break
                frame = frame.f_back
            self.by_caller[caller] += 1
            return func(*args, **(kwargs or {}))
    return Counter


def ops_body(methods: list[str], depths: list[int], window: int, warmup: int,
             width: int = WIDTH, callers: bool = True) -> dict:
    """One rank: per method and depth, ops (and views) per step over ``window`` steps after
    ``warmup``; collectives per step; the ops by caller (tests/test_fixed_cost.py runs it in
    the shared torch job, without DDP)."""
    import horovod.torch as horovod
    import torch
    import torch.distributed as dist

    import hvdsync.torch as hvd
    from hvdsync.torch import foreach
    horovod.init()
    hvd.init()
    gpu_form, foreach.GPU_FORM_ON_CPU = foreach.GPU_FORM_ON_CPU, True  # what a GPU dispatches
    if "ddp" in [METHODS[m][0] for m in methods]:  # (the bench's own job: its process group)
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {hvd.rank() % os.cpu_count()})
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{DDP_PORT}",
                                rank=hvd.rank(), world_size=hvd.size())
    # the engine calls Horovod's optimizer makes (hvdsync counts its own: stats)
    calls = collections.Counter()
    import horovod.torch.optimizer as hvd_optimizer
    original = hvd_optimizer.allreduce_async_

    def counted(*a, **k):
        calls["horovod"] += 1
        return original(*a, **k)
    Counter = op_counter(callers)
    out: dict = {}
    hvd_optimizer.allreduce_async_ = counted
    try:
        for d, depth in enumerate(depths):
            for i, name in enumerate(methods):
                progress.step(d * len(methods) + i, len(depths) * len(methods),
                              f"{name}, {depth} layers")
                opt, step = build(name, depth, horovod, hvd, width)
                for _ in range(warmup):
                    step()
                horovod.allreduce(torch.zeros(1), name=f"go.{depth}.{name}")  # in step
                before = opt.stats.total.collectives if hasattr(opt, "stats") else 0
                calls.clear()
                counter = Counter()
                with counter:
                    for _ in range(window):
                        step()
                if hasattr(opt, "stats"):
                    collectives = (opt.stats.total.collectives - before) / window
                else:  # (DDP's reducer calls the process group from C++: not counted here)
                    collectives = (None if METHODS[name][0] == "ddp"
                                   else calls["horovod"] / window)
                out.setdefault(name, {})[depth] = dict(
                    ops=counter.ops / window, views=counter.views / window,
                    collectives=collectives,
                    by_caller={k: v / window for k, v in counter.by_caller.most_common()})
                if hasattr(opt, "flush"):
                    opt.flush()
    finally:
        hvd_optimizer.allreduce_async_ = original
        foreach.GPU_FORM_ON_CPU = gpu_form
    return out


def time_body(methods: list[str], depth: int, rounds: int, steps: int) -> dict:
    """One rank: per round and method, the slowest rank's seconds per step (interleaved)."""
    import horovod.torch as horovod
    import torch

    import hvdsync.torch as hvd
    horovod.init()
    hvd.init()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {hvd.rank() % os.cpu_count()})
    runs = {name: build(name, depth, horovod, hvd)[1] for name in methods}
    per_round: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for i, name in enumerate(order):
            progress.step(r * len(order) + i, rounds * len(order),
                          f"round {r + 1}/{rounds}, {name}")
            runs[name]()  # warm-up
            horovod.allreduce(torch.zeros(1), name=f"go.{r}.{name}")  # start together
            t0 = time.perf_counter()
            for _ in range(steps):
                runs[name]()
            local = (time.perf_counter() - t0) / steps
            per_round[name].append(horovod.allreduce(
                torch.tensor([local], dtype=torch.float64), op=horovod.Max,
                name=f"t.{r}.{name}").item())
    return per_round


def profile_body(methods: list[str], depth: int, steps: int) -> dict:
    """One process: cProfile over ``steps`` steps of each method; hvdsync's functions by own
    time per step (microseconds), the top ones."""
    import horovod.torch as horovod
    import torch

    import hvdsync.torch as hvd
    horovod.init()
    hvd.init()
    torch.set_num_threads(1)
    out = {}
    for i, name in enumerate(methods):
        progress.step(i, len(methods), f"profiling {name}")
        _, step = build(name, depth, horovod, hvd)
        for _ in range(3):
            step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        stats = pstats.Stats(prof).stats
        total = sum(tt for (_, _, _), (_, _, tt, _, _) in stats.items())
        own = {}
        for (path, line, fn), (_, _, tt, _, _) in stats.items():
            if os.sep + "hvdsync" + os.sep in path:
                key = path.split(os.sep + "hvdsync" + os.sep, 1)[-1] + ":" + fn
                own[key] = own.get(key, 0.0) + tt
        out[name] = dict(total_us=1e6 * total / steps,
                         hvdsync_us=1e6 * sum(own.values()) / steps,
                         top={k: 1e6 * v / steps for k, v in
                              sorted(own.items(), key=lambda kv: -kv[1])[:6]})
    return out


def ops_tables(args: argparse.Namespace, data: dict) -> list[str]:
    """Ops per step by depth, and where they go (``--part ops``)."""
    methods = ["bare optimizer (no exchange)"] + [
        m for m in args.methods if m != "bare optimizer (no exchange)"]
    counted = data["ops"] = run_ranks(ops_body, np=2, args=(methods, args.depths, args.window,
                                                            args.warmup), timeout=3600)[0]
    floor = counted["bare optimizer (no exchange)"]
    lo, hi = min(args.depths), max(args.depths)
    rows = []
    for name in methods:
        c = counted[name]
        added = {d: c[d]["ops"] - floor[d]["ops"] for d in args.depths}
        growth = (added[hi] - added[lo]) / (hi - lo) if hi > lo else 0.0
        kernels = c[12]["ops"] - c[12]["views"] - (floor[12]["ops"] - floor[12]["views"]) \
            if 12 in c else None
        coll = c[12 if 12 in c else lo]["collectives"]
        rows.append([name] + [f"{added[d]:+.0f}" for d in args.depths]
                    + [f"{growth:+.2f}", "-" if kernels is None else f"{kernels:+.0f}",
                       "-" if coll is None else f"{coll:.1f}"])
    floors = ", ".join(f"{d} layers {floor[d]['ops']:.0f}" for d in args.depths)
    tables = [f"Ops dispatched per step added to the bare optimizer's (its own: {floors}); "
              f"2 ranks (Horovod, Gloo), rank 0, mean of {args.window} steps\n\n"
              + markdown_table(["method"] + [f"{d} layers" for d in args.depths]
                               + [f"per added layer ({lo}->{hi})",
                                  "12 layers, kernels (no views)",
                                  "collectives/step (12 layers)"], rows)]
    if 12 in args.depths:
        rows = []
        for name in methods:
            base = floor[12]["by_caller"]
            extra = {k: v - base.get(k, 0.0) for k, v in counted[name][12]["by_caller"].items()}
            top = [f"{k} {v:+.0f}" for k, v in sorted(extra.items(), key=lambda kv: -kv[1])
                   if abs(v) >= 0.5][:5]
            rows.append([name, "; ".join(top) or "-"])
        tables.append("Where the added ops go (12 layers; by the function that dispatched "
                      "them)\n\n" + markdown_table(["method", "added ops by caller"], rows))
    return tables


def time_tables(args: argparse.Namespace, data: dict) -> list[str]:
    """Host time per step on 1 and 2 ranks, and where the microseconds go (``--part time``)."""
    timed = ["horovod"] + [m for m in args.timed if m != "horovod"]
    rows = []
    data["time"] = {}
    for np_ in (1, 2):
        per_rank = run_ranks(time_body, np=np_, args=(timed, args.depth, args.rounds,
                                                      args.steps), timeout=3600)
        summary = data["time"][np_] = summarize(per_rank[0], base="horovod")
        for name in timed:
            rows.append([np_, name, f"{summary[name]['step_ms']:.2f}",
                         *ratio_cells(summary[name])])
    tables = [f"Host time per step, {args.depth}-layer MLP, loopback, 1 core per rank, "
              f"{args.rounds} interleaved rounds x {args.steps} steps (ratios to horovod in "
              "the same round)\n\n"
              + markdown_table(["ranks", "method", "ms/step (median)", *RATIO_COLUMNS], rows)]
    prof = data["profile"] = run_ranks(profile_body, np=1,
                                       args=(timed, args.depth, args.steps), timeout=3600)[0]
    rows = [[name, f"{p['total_us']:.0f}", f"{p['hvdsync_us']:.0f}",
             "; ".join(f"{k} {v:.0f}" for k, v in list(p["top"].items())[:4]) or "-"]
            for name, p in prof.items()]
    tables.append(f"Where the microseconds go (1 process, cProfile over {args.steps} steps; "
                  "cProfile's own cost inflates Python, so read the shares, not the totals)"
                  "\n\n" + markdown_table(["method", "us/step (profiled)",
                                            "in hvdsync's functions",
                                            "hvdsync's top functions (us/step)"], rows))
    return tables


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["ops", "time", "all"], default="all")
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 12, 48, 96])
    ap.add_argument("--window", type=int, default=8, help="steps counted (ops)")
    ap.add_argument("--warmup", type=int, default=12, help="steps before counting (ops)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--timed", nargs="+", choices=list(METHODS), default=TIMED)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per method per round")
    ap.add_argument("--depth", type=int, default=12, help="the model of the host times")
    ap.add_argument("--name", default="fixed_cost")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (the interval needs a spread)")
    data: dict = {"width": WIDTH, "batch": BATCH}
    tables = []
    if args.part in ("ops", "all"):
        tables += ops_tables(args, data)
    if args.part in ("time", "all"):
        tables += time_tables(args, data)
    report(args.name, "Fixed cost per step", "\n\n".join(tables), data,
           "benchmarks.bench_fixed_cost", argv)


if __name__ == "__main__":
    main()
