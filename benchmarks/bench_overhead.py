"""Step overhead of hvdsync when nothing is skipped, against Horovod's own optimizer.

    python -m benchmarks.bench_overhead                       # CNN and digits, 2 ranks
    python -m benchmarks.bench_overhead --workloads teacher_cnn --rounds 20

Each rank pins itself to one core (2 ranks on 2 cores) and builds every method on its own
copy of the same model: plain ``horovod.torch.DistributedOptimizer``; hvdsync with nothing
enabled; and each technique configured so that it sends everything (``clip`` with a limit
never reached, ``threshold=0``, ``select`` with every layer, ``delay`` with staleness 0).
Rounds interleave the methods (the order rotates every round), each method trains
``--steps`` steps per round after one warm-up step, and a round's time per step is the
slowest rank's. The figure per method is the ratio to Horovod's time per step *in the same
round*, averaged over rounds, with a 95 % confidence interval (Student t over rounds): the
machine's drift cancels in the ratio, and the interval says whether an overhead is resolved.
Loopback links by default: what is measured is hvdsync's own work per step, not the network;
``--net 100`` runs the ranks on 100 Mbit/s emulated links (root), where the step is the
exchange and what counts is how well sends overlap backward.
``--backend torch`` runs hvdsync on torch.distributed instead of Horovod (docs/backends.md),
with DDP (``ddp``, ``ddp fp16``) in the same rounds; Horovod's optimizer stays the baseline
of both, so the two runs' ratios compare the engines. ``--baseline-tree <checkout>`` adds
each hvdsync method as that checkout's code too (``<method> @base``,
:mod:`benchmarks.baseline_tree`), in the same rounds: a change's host time against the code
before it, as the ratio of the two in each round.
Results: ``benchmarks/results/overhead_np<N>[_<rate>mbit][_torch].{json,md}``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any

from benchmarks.common import markdown_table, report, shows_progress
from benchmarks.network import EmulatedNetwork, namespaces_unavailable, run_ranks_on
from benchmarks.workloads import WORKLOADS
from hvdsync.testing import run_ranks
from hvdsync.testing import progress

METHODS: dict[str, Any] = {
    "horovod": None,
    "hvdsync": {},
    "clip (never clips)": dict(clip=dict(max_norm=1e9)),
    "threshold=0": dict(threshold=0.0),
    "select (every layer)": dict(select=dict(k=1.0)),
    "delay staleness=0": dict(delay=dict(staleness=0)),
    "hvdsync fp16": dict(compression="fp16"),
    "lowrank (rank 4)": dict(lowrank=dict(rank=4, warmup_steps=0)),
    # the cost of the entry tags (hvdsync.safety.entries): the same, with the tag round left out
    "hvdsync, no entry tags": dict(_entry_tags=False),
    "threshold=0, no entry tags": dict(threshold=0.0, _entry_tags=False),
    "ddp": "ddp",  # torch's DDP on the same process group (--backend torch only)
    "ddp fp16": "ddp fp16",
}
#: where the ranks' torch.distributed process group meets (--backend torch)
DDP_PORT = 29533

# two-sided 95 % Student t quantiles by degrees of freedom (scipy is not a dependency)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
        10: 2.23, 11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 19: 2.09, 24: 2.06,
        29: 2.05}


def t95(df: int) -> float:
    """The quantile for ``df`` degrees of freedom (the next smaller tabulated one: wider)."""
    if df < 1:
        return math.inf
    return _T95[max(k for k in _T95 if k <= df)]


#: a method's suffix for the baseline checkout's code (``--baseline-tree``)
BASE = " @base"


def overhead_body(workload: str, methods: list[str], rounds: int, steps: int,
                  backend: str = "horovod", addr: str = "127.0.0.1", iface: str = "lo") -> dict:
    """One rank: every method on its own model copy, rounds interleaved; per round and
    method the slowest rank's seconds per step. ``backend="torch"``: hvdsync runs on a
    torch.distributed process group (on ``addr``'s interface ``iface``), shared with DDP."""
    import horovod.torch as horovod
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import hvdsync.torch as hvd
    horovod.init()  # the harness (start together, the slowest rank's time) and the baseline
    if backend == "torch":
        os.environ["GLOO_SOCKET_IFNAME"] = iface
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{DDP_PORT}",
                                rank=horovod.rank(), world_size=horovod.size())
    hvd.init(backend=backend)
    versions = {"": hvd}
    if any(name.endswith(BASE) for name in methods):  # (benchmarks.baseline_tree)
        import importlib
        versions[BASE] = importlib.import_module("hvdsync_base.torch")
        versions[BASE].init(backend=backend)
    os.sched_setaffinity(0, {hvd.rank() % os.cpu_count()})
    torch.set_num_threads(1)
    w = WORKLOADS[workload]
    torch.manual_seed(0)
    template = w.make_model(False)
    next_batch = w.batches(hvd.rank(), hvd.size(), 0)
    batches = [next_batch() for _ in range(steps + 1)]
    runs = {}
    for name in methods:
        model = w.make_model(False)
        model.load_state_dict(template.state_dict())
        base = w.make_optimizer(model, hvd.size())
        version = BASE if name.endswith(BASE) else ""
        net, spec, lib = model, METHODS[name.removesuffix(BASE)], versions[version]
        if spec is None:
            opt = horovod.DistributedOptimizer(base, named_parameters=model.named_parameters())
        elif isinstance(spec, str):  # DDP
            net, opt = nn.parallel.DistributedDataParallel(model), base
            if spec == "ddp fp16":
                net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            options = dict(spec)
            tags = options.pop("_entry_tags", True)
            if options.get("compression") == "fp16":
                options["compression"] = lib.Compression.fp16
            opt = lib.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           **options)
            if not tags:  # no tag round before a step's first collective
                opt._comm.entries.before = lambda what="": 0
        runs[name] = (net, opt)

    def train(name: str, batch_list) -> None:
        net, opt = runs[name]
        for x, y in batch_list:
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

    per_round: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for i, name in enumerate(order):  # (progress by round: nothing inside a timed run)
            progress.step(r * len(order) + i, rounds * len(order),
                          f"round {r + 1}/{rounds}, {name}")
            train(name, batches[:1])  # warm-up
            horovod.allreduce(torch.zeros(1), name=f"go.{r}.{name}")  # start together
            t0 = time.perf_counter()
            train(name, batches[1:])
            local = (time.perf_counter() - t0) / steps
            slowest = horovod.allreduce(torch.tensor([local], dtype=torch.float64),
                                        op=horovod.Max, name=f"t.{r}.{name}").item()
            per_round[name].append(slowest)
    return per_round


def median_ci95(values: list[float]) -> list[float]:
    """A distribution-free 95 % interval of the median: the order statistics ``k`` and
    ``n + 1 - k`` with ``P(Binomial(n, 1/2) < k) <= 2.5 %`` (as wide as the data where ``n``
    is too small for one)."""
    xs, n = sorted(values), len(values)
    k, below = 0, 0.0
    while k < n:  # the largest k with P(X < k) <= 0.025
        nxt = below + math.comb(n, k) / 2 ** n
        if nxt > 0.025:
            break
        below, k = nxt, k + 1
    if k == 0:
        return [xs[0], xs[-1]]
    return [xs[k - 1], xs[n - k]]


def summarize(per_round: dict[str, list[float]], base: str = "horovod") -> dict[str, dict]:
    """Per method: the median time per step; the mean over rounds of its ratio to the
    ``base`` method's time in the same round with a 95 % interval (Student t); and the
    median of those ratios with a distribution-free 95 % interval -- a round in which a rank
    was descheduled moves a mean, not a median."""
    base = per_round[base]
    out = {}
    for name, times in per_round.items():
        ratios = [t / b for t, b in zip(times, base)]
        mean = statistics.fmean(ratios)
        sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
        half = t95(len(ratios) - 1) * sd / math.sqrt(len(ratios)) if len(ratios) > 1 else 0.0
        out[name] = dict(step_ms=1e3 * statistics.median(times), ratio=mean,
                         ci95=[mean - half, mean + half], ratios=ratios,
                         median_ratio=statistics.median(ratios),
                         median_ci95=median_ci95(ratios))
    return out


#: the columns :func:`ratio_cells` fills
RATIO_COLUMNS = ["time/step vs horovod", "95 % CI", "median ratio", "95 % CI (median)"]


def ratio_cells(s: dict) -> list[str]:
    """A method's :func:`summarize` figures as table cells: the mean ratio and its interval,
    the median ratio and its."""
    return [f"{s['ratio']:.3f}", f"[{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]",
            f"{s['median_ratio']:.3f}",
            f"[{s['median_ci95'][0]:.3f}, {s['median_ci95'][1]:.3f}]"]


def _vs_base(per_round: dict[str, list[float]], name: str) -> list[str]:
    """A method's time per step against the baseline checkout's in the same round: the mean
    ratio over rounds and its 95 % interval (Student t)."""
    s = summarize({name: per_round[name], "base": per_round[name + BASE]}, base="base")[name]
    return [f"{s['ratio']:.3f}", f"[{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]"]


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["teacher_cnn", "digits_mlp"],
                    choices=list(WORKLOADS))
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per method per round")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS),
                    default=[m for m, spec in METHODS.items() if not isinstance(spec, str)])
    ap.add_argument("--net", default="loopback",
                    help="'loopback' or a link rate in Mbit/s for the emulated network")
    ap.add_argument("--backend", default="horovod", choices=["horovod", "torch"],
                    help="the engine hvdsync runs on (torch: torch.distributed, with DDP)")
    ap.add_argument("--name", default=None, help="results file name (default: "
                    "overhead_np<N>[_<rate>mbit][_torch])")
    ap.add_argument("--baseline-tree", default=None,
                    help="another checkout: its hvdsync in the same rounds (<method> @base)")
    args = ap.parse_args(argv)
    if args.backend == "horovod" and any(isinstance(METHODS[m], str) for m in args.methods):
        ap.error("the ddp methods need --backend torch (a torch.distributed process group)")
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (the interval needs a spread)")
    methods = ["horovod"] + [m for m in args.methods if m != "horovod"]
    if args.baseline_tree:
        from benchmarks.baseline_tree import install
        install(args.baseline_tree)
        methods += [m + BASE for m in methods if isinstance(METHODS[m], dict)]
    rows, data = [], {}
    for wl in args.workloads:
        progress.cell(f"{wl}, {args.np} ranks, {args.net}" + (
            "" if args.net == "loopback" else " Mbit/s"))
        call = (wl, methods, args.rounds, args.steps, args.backend)
        if args.net == "loopback":
            per_rank = run_ranks(overhead_body, np=args.np, args=call, timeout=3600)
        else:
            reason = namespaces_unavailable()
            if reason:
                ap.error(f"--net {args.net}: {reason}")
            with EmulatedNetwork(args.np, rate_mbit=float(args.net)) as net:
                call += (net.addresses[0], "hvs0")
                per_rank = run_ranks_on(net, overhead_body, args.np, args=call, timeout=3600)
        summary = data[wl] = summarize(per_rank[0])  # every rank holds the same maxima
        for name in methods:
            if args.baseline_tree and name.endswith(BASE):
                continue
            vs_base = ([] if not args.baseline_tree else ["-"] * 2 if name + BASE not in methods
                       else _vs_base(per_rank[0], name))
            rows.append([wl, name, f"{summary[name]['step_ms']:.1f}",
                         *ratio_cells(summary[name]), *vs_base])
    table = markdown_table(["workload", "method", "ms/step (median)", *RATIO_COLUMNS] + (
        ["vs @base", "95 % CI"] if args.baseline_tree else []), rows)
    link = "loopback" if args.net == "loopback" else f"{args.net} Mbit/s emulated links"
    suffix = ("" if args.net == "loopback" else f"_{args.net}mbit") + (
        "_torch" if args.backend == "torch" else "")
    engine = "Horovod" if args.backend == "horovod" else "torch.distributed"
    report(args.name or f"overhead_np{args.np}{suffix}", f"Step overhead with nothing skipped, {args.np} "
           f"ranks x 1 core, {link}, hvdsync on {engine}, {args.rounds} interleaved rounds x "
           f"{args.steps} steps", table,
           dict(rounds=args.rounds, steps=args.steps, np=args.np, backend=args.backend,
                results=data),
           "benchmarks.bench_overhead", argv)


if __name__ == "__main__":
    main()
