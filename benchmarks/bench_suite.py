"""The standard benchmark: wall time to a target accuracy, final accuracy, bytes and
collectives per step for hvdsync's techniques and their peers, side by side in one run, on an
emulated slow network.

    bash scripts/bench.sh             # the standard set (see --help for the grid)
    bash scripts/bench.sh --quick     # < 10 minutes: digits + CNN, 2 ranks, 100 Mbit/s, 1 seed

Peers, all trained in the same job one after the other from the same initial weights and data
streams (benchmarks/suite_methods.py): plain ``horovod.torch.DistributedOptimizer``; Horovod
with ``Compression.fp16``; PyTorch DDP (Gloo) with torch's own hooks and model averagers
(benchmarks/ddp_peers.py: PowerSGD, fp16, post-local SGD) -- the ranks join a
``torch.distributed`` process group the way torchrun's env:// rendezvous does; torchft's
DiLoCo; hvdsync with nothing enabled, with each technique, and a recommended combination.

Every method trains the workload's number of steps; one that took less time than plain
Horovod goes on until it has used Horovod's training time (at most 3x the steps), so that time
to target compares methods at equal wall time, not at a step count the baseline chose.
Per method: training time (evaluation excluded; the slowest rank) until the held-out metric
(accuracy; validation loss for the language model) first reaches the target -- per seed,
plain Horovod's final metric of that seed, less about one standard error (0.5 point of
accuracy, 0.01 nats), computed in the same run -- and its ratio to Horovod's time to that
target (mean +- sd over seeds); the final metric after the workload's steps (mean over seeds,
each the mean over ranks: replicas may differ with local updates), the metric and steps at the
end of training, payload bytes per rank per step, collectives per step, and the time per step
relative to plain Horovod. Results: ``benchmarks/results/suite[_quick].{json,md}`` and
plots ``suite[_quick]_accuracy.png`` (accuracy vs training time), ``..._bytes.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from benchmarks import ddp_peers
from benchmarks.common import markdown_table, report, shows_progress
from benchmarks.network import EmulatedNetwork, namespaces_unavailable, run_ranks_on
from benchmarks.suite_methods import METHODS, RECOMMENDED, SELECTORS  # noqa: F401 (bench_select)
from benchmarks.suite_plots import plot
from benchmarks.workloads import WORKLOADS
from hvdsync.core.stats import human_bytes
from hvdsync.testing import RanksFailed
from hvdsync.testing import progress

RUNS = [0]  # torchft runs so far on this rank (each gets its own ports)
EXTEND = 3  # a method faster per step trains up to this many times the workload's steps


def run_method(name: str, workload_name: str, seed: int, steps: int | None = None,
               budget_s: float | None = None, peer: str = "127.0.0.1") -> dict:
    """Train one method on this rank; returns the (train seconds, accuracy) curve and stats.

    Every method trains ``steps`` steps (the workload's count by default; its accuracy then is
    the "final accuracy" compared across methods). With ``budget_s`` -- plain Horovod's
    training time in the same run -- a method that got there in less time goes on training
    until its slowest rank has used that budget (at most ``EXTEND`` x ``steps``), so that a
    method faster per step is not cut off by a step count the baseline set: time to target is
    then measured on an equal wall-time footing. ``steps`` beyond the workload's count make a
    longer cell: the score at the workload's own step count is kept too (``early``), the
    second target of local-step methods, which gain with training length."""
    import torch

    import hvdsync.torch as hvd
    from hvdsync.torch.comm import payload_bytes
    spec = METHODS[name]
    w = WORKLOADS[workload_name]
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    dense = spec.get("dense_model", False) or not w.has_sparse
    model = w.make_model(not dense)
    # Horovod's payload per step: the dense gradients' size, except that sparse ones can only
    # be measured (a hook, on Horovod's runs with sparse gradients only: it costs time).
    handed = [sum(p.numel() * p.element_size() for p in model.parameters())]
    if spec["kind"] == "horovod" and not dense:
        handed[0] = 0
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(
                lambda p: handed.__setitem__(0, handed[0] + payload_bytes(p.grad)))
    opt, net, stop_peer = _wrapped(spec, w, model, w.make_optimizer(model, hvd.size()), peer)
    run = _train(name, seed, spec, w, opt, net, model, steps or w.steps, budget_s)
    if stop_peer is not None:
        stop_peer()
    nbytes, collectives = _traffic(spec, opt, model, handed[0], dense, run["steps"])
    return dict(run, bytes_per_step=nbytes, collectives_per_step=collectives,
                step_s=run["train_s"] / run["steps"])


def _wrapped(spec: dict, w: Any, model: Any, base: Any, peer: str) -> tuple[Any, Any, Any]:
    """The method's optimizer, the module to run, and what tears a peer down (or None)."""
    import horovod.torch as horovod

    import hvdsync.torch as hvd
    compression = hvd.Compression.fp16 if spec.get("fp16") else hvd.Compression.none
    if spec["kind"] in ("local", "torchft"):  # every rank starts from the same weights (seed)
        if spec["kind"] == "local":
            return base, model, None
        from benchmarks.torchft_peer import start_diloco
        RUNS[0] += 1
        node, net = None, model
        if spec.get("per_node"):  # synchronous inside the node: DDP over the node's ranks
            node = (horovod.cross_rank(), horovod.local_rank(), horovod.local_size())
            net = ddp_peers.inside_node(model)
        return base, net, start_diloco(model, base, hvd.rank(), hvd.size(), peer, RUNS[0],
                                       spec["diloco"], node)
    if spec["kind"] == "ddp":
        return (*ddp_peers.wrap(model, base, spec), None)
    if spec["kind"] == "horovod":
        opt = horovod.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           compression=compression)
        horovod.broadcast_parameters(model.state_dict(), root_rank=0)
        return opt, model, None
    kwargs = dict(spec["sparse_kwargs"] if w.has_sparse and "sparse_kwargs" in spec
                  else spec["kwargs"])
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=compression, **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return opt, model, None


def _train(name: str, seed: int, spec: dict, w: Any, opt: Any, net: Any, model: Any,
           steps: int, budget_s: float | None) -> dict:
    """The training loop of :func:`run_method`: its curve, scores, steps and seconds."""
    import horovod.torch as horovod
    import torch
    from torch import nn

    import hvdsync.torch as hvd
    next_batch = w.batches(hvd.rank(), hvd.size(), seed)
    x_test, y_test = w.test_set(seed)
    limit = steps * EXTEND if budget_s is not None else steps
    batches = [next_batch() for _ in range(steps)]  # made before the clock runs

    def stop_after(step: int) -> bool:
        """Whether training ends after this step: decided from the slowest rank's time at
        evaluation points only, so that all ranks decide alike."""
        if step >= limit:
            return True
        if step < steps or step % w.eval_every:
            return False
        slowest = horovod.allreduce(torch.tensor([train_s], dtype=torch.float64),
                                    op=horovod.Max, name=f"budget.{name}.{seed}.{step}")
        return slowest.item() >= budget_s

    horovod.allreduce(torch.zeros(1), name=f"start.{name}.{seed}")  # start together
    curve, train_s, final, early, step = [], 0.0, None, None, 0
    while True:
        step += 1
        x, y = batches[step - 1] if step <= steps else next_batch()
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        train_s += time.perf_counter() - t0
        progress.step(step, steps, f"{name}, seed {seed}" + (
            ", on to Horovod's time" if step > steps else ""))
        done = stop_after(step)
        if spec["kind"] == "hvdsync" and (step == steps or done):
            t0 = time.perf_counter()
            opt.flush()  # replicas identical (delay=) before the accuracy that is compared
            train_s += time.perf_counter() - t0
        if step % w.eval_every == 0 or step == steps or done:
            curve.append((train_s, w.score(model, x_test, y_test)))  # higher is better
        if step == steps:
            final = curve[-1][1]
        if step == w.steps < steps:
            early = curve[-1][1]
        if done:
            return dict(curve=curve, final=final, early=early, steps=step, train_s=train_s)


def _traffic(spec: dict, opt: Any, model: Any, handed: float, dense: bool,
             steps: int) -> tuple[float, float]:
    """Payload bytes a rank hands to the collectives per step, and collectives per step."""
    if spec["kind"] == "hvdsync":
        total = opt.stats.total
        return total.bytes_sent / steps, total.collectives / steps
    if spec["kind"] == "horovod":
        per_step = handed / steps if not dense else handed
        # tensors handed to Horovod (it fuses them); a sparse one is two allgathers
        return per_step * (0.5 if spec.get("fp16") else 1.0), sum(
            2 if p.grad is not None and p.grad.is_sparse else 1 for p in model.parameters())
    if spec["kind"] == "local":
        return 0, 0
    if spec["kind"] == "torchft":  # each fragment's float32 pseudo-gradient, once per K steps
        c = spec["diloco"]
        dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return dense_bytes / c["average_every"], c["fragments"] / c["average_every"]
    return ddp_peers.traffic(model, spec, steps)


def suite_body(workload: str, methods: list[str], seeds: list[int], ddp_addr: str,
               ddp_port: int, ddp_iface: str, steps: int | None = None,
               engine: str = "horovod") -> dict:
    """On each rank: every (seed, method) in turn; the DDP process group is joined once.
    ``engine``: what hvdsync's methods run on -- Horovod, or torch.distributed (the DDP
    process group; Horovod's peers still run on Horovod)."""
    import torch.distributed as dist

    import horovod.torch as horovod
    import hvdsync.torch as hvd
    horovod.init(process_sets=hvd.node_process_sets() if engine == "horovod" else None)
    rank, size = horovod.rank(), horovod.size()
    if engine == "torch" or any(METHODS[m]["kind"] == "ddp" or METHODS[m].get("per_node")
                                for m in methods):
        os.environ["GLOO_SOCKET_IFNAME"] = ddp_iface
        # torchrun's names for the layout horovodrun gave (hvdsync's torch engine reads them)
        os.environ.update(LOCAL_WORLD_SIZE=str(horovod.local_size()),
                          LOCAL_RANK=str(horovod.local_rank()),
                          GROUP_RANK=str(horovod.cross_rank()))
        dist.init_process_group("gloo", init_method=f"tcp://{ddp_addr}:{ddp_port}",
                                rank=rank, world_size=size)
    hvd.init(backend=engine)
    import torch
    out: dict[str, list] = {m: [] for m in methods}
    run_method("horovod", workload, 99, steps=20)  # warm-up: first-use costs land here
    if any(METHODS[m]["kind"] == "torchft" for m in methods):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ddp_iface)
    others = [m for m in methods if m != "horovod"]
    for seed in seeds:
        out["horovod"].append(run_method("horovod", workload, seed, steps=steps))
        budget = horovod.allreduce(torch.tensor([out["horovod"][-1]["train_s"]]),
                                   op=horovod.Max, name=f"budget.{seed}").item()
        for m in others:
            out[m].append(run_method(m, workload, seed, steps=steps, budget_s=budget,
                                     peer=ddp_addr))
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


def summarize(per_rank: list[dict], methods: list[str], workload: str) -> dict:
    """Combine ranks (slowest rank's time, mean score) and seeds; time to target, with a
    target per seed: plain Horovod's final score of that seed, less the workload's tolerance.
    A longer cell (runs with an ``early`` score) has a second target: Horovod's score at the
    workload's own step count."""
    w = WORKLOADS[workload]
    combined = {}
    for m in methods:
        runs = []
        for s in range(len(per_rank[0][m])):
            ranks = [r[m][s] for r in per_rank]
            points = len(ranks[0]["curve"])  # the same on all ranks: they stop together
            curve = [(max(r["curve"][i][0] for r in ranks),
                      statistics.mean(r["curve"][i][1] for r in ranks)) for i in range(points)]
            early = [r.get("early") for r in ranks]
            runs.append(dict(curve=curve, final=statistics.mean(r["final"] for r in ranks),
                             early=statistics.mean(early) if None not in early else None,
                             steps=ranks[0]["steps"], step_s=max(r["step_s"] for r in ranks),
                             bytes_per_step=statistics.mean(r["bytes_per_step"] for r in ranks),
                             collectives_per_step=ranks[0]["collectives_per_step"]))
        combined[m] = runs
    targets = [run["final"] - w.tolerance for run in combined["horovod"]]
    early = [run["early"] for run in combined["horovod"]]
    early_targets = [e - w.tolerance for e in early] if None not in early else None

    def reached(runs: list[dict], goals: list[float]) -> list:
        return [next((t for t, a in run["curve"] if a >= goal), None)
                for run, goal in zip(runs, goals)]

    def versus_horovod(runs: list[dict], goals: list[float]) -> dict:
        """time to the per-seed ``goals``, as ratios to Horovod's own (per seed and mean +- sd;
        ``None`` where a seed never got there)."""
        base, times = reached(combined["horovod"], goals), reached(runs, goals)
        ok = [t for t in times if t is not None]
        # per seed, for paired comparisons (None: that seed never got there)
        per_seed = [t / b if t is not None and b else None for t, b in zip(times, base)]
        ratios = [r for r in per_seed if r is not None]
        every = len(ok) == len(runs)
        return dict(time_to_target_ratio=statistics.mean(ratios) if every else None,
                    time_to_target_ratio_sd=(statistics.stdev(ratios)
                                             if every and len(ratios) > 1 else 0.0),
                    time_to_target_ratios=per_seed,
                    time_to_target=statistics.mean(ok) if every else None,
                    reached=f"{len(ok)}/{len(runs)}")
    table = {}
    for m, runs in combined.items():
        finals = [run["final"] for run in runs]
        table[m] = dict(
            **versus_horovod(runs, targets),
            early=versus_horovod(runs, early_targets) if early_targets else None,
            final_accuracy=statistics.mean(finals), finals=finals,
            final_sd=statistics.stdev(finals) if len(runs) > 1 else 0.0,
            end_accuracy=statistics.mean(run["curve"][-1][1] for run in runs),
            steps=statistics.mean(run["steps"] for run in runs),
            step_s=statistics.mean(run["step_s"] for run in runs),
            bytes_per_step=statistics.mean(run["bytes_per_step"] for run in runs),
            collectives_per_step=runs[0]["collectives_per_step"],
            curve=[(statistics.mean(run["curve"][i][0] for run in runs),
                    statistics.mean(run["curve"][i][1] for run in runs))
                   for i in range(min(len(run["curve"]) for run in runs))])
    return dict(target=statistics.mean(targets), targets=targets, early_targets=early_targets,
                metric=w.metric, methods=table)


def rows_for(cell: str, summary: dict, workload: str) -> list[list]:
    w = WORKLOADS[workload]
    base = summary["methods"]["horovod"]
    rows = []
    for m, v in summary["methods"].items():
        rows.append([cell, m, *_time_to_target(v),
                     f"{w.show(v['final_accuracy'])} +- {w.show(v['final_sd'], spread=True)}",
                     f"{w.show(v['end_accuracy'])} ({v['steps']:.0f})",
                     f"{v['step_s'] / base['step_s']:.2f}",
                     human_bytes(v["bytes_per_step"]),
                     f"{v['bytes_per_step'] / base['bytes_per_step']:.2f}",
                     f"{v['collectives_per_step']:.1f}"])
    return rows


def _time_to_target(v: dict) -> list[str]:
    """the time and ratio cells; a longer cell adds the early target's after a slash."""
    def cells(v: dict) -> tuple[str, str]:
        ttt, ratio = v["time_to_target"], v["time_to_target_ratio"]
        return (f"{ttt:.1f}" if ttt is not None else f"not reached ({v['reached']})",
                f"{ratio:.2f} +- {v['time_to_target_ratio_sd']:.2f}" if ratio is not None
                else "-")
    end = cells(v)
    if not v.get("early"):
        return list(end)
    early = cells(v["early"])
    return [f"{early[0]} / {end[0]}", f"{early[1]} / {end[1]}"]


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="digits + CNN, 2 ranks, 100 Mbit/s, 1 seed (< 10 minutes)")
    ap.add_argument("--workloads", nargs="+", default=["digits_mlp", "zipf_embedding",
                                                       "teacher_cnn"], choices=list(WORKLOADS))
    ap.add_argument("--np", type=int, nargs="+", default=[4])
    ap.add_argument("--nets", nargs="+", default=["100"],
                    help="link rates in Mbit/s and/or 'loopback'")
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="one-way delay added to each rank's link (netem; where the kernel "
                         "has no netem the run says so and only the rate applies)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--engine", choices=["horovod", "torch"], default="horovod",
                    help="what hvdsync's methods run on (Horovod's peers run on Horovod either "
                         "way): torch.distributed gives between='nodes' a node reduction of "
                         "its own, where Horovod runs every collective on one thread")
    ap.add_argument("--ranks-per-node", type=int, default=1,
                    help="ranks per node: each node one network namespace, its ranks on its "
                         "loopback, the link rate per node (methods ', nodes': between='nodes')")
    ap.add_argument("--job-per-seed", action="store_true",
                    help="each seed in processes of its own (the default with "
                         "--ranks-per-node > 1: four ranks kept the state of every method of "
                         "a seed, and the next seed's Horovod run took 6x the first's)")
    ap.add_argument("--steps", type=int, default=None,
                    help="train this many steps instead of the workload's count (a longer "
                         "cell: a second target at Horovod's score at the workload's count)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS),
                    default=[m for m, spec in METHODS.items() if not spec.get("extra")])
    ap.add_argument("--name", default=None,
                    help="results file name (default: suite, or suite_quick with --quick)")
    args = ap.parse_args(argv)
    if args.delay_ms < 0:
        ap.error(f"--delay-ms must be >= 0, got {args.delay_ms}")
    if args.ranks_per_node > 1 and "loopback" in args.nets:
        ap.error("--ranks-per-node needs an emulated network (--nets <Mbit/s>)")
    if args.ranks_per_node > 1:
        # Four ranks on two cores drift apart where nothing synchronizes them ("no exchange"):
        # at its next evaluation one waits for the others in Horovod's budget check, and
        # Gloo's 30 s limit (twice, in runs of 20 and 30 minutes) ended the job there. The
        # wait is outside every method's training time.
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "600")
        args.job_per_seed = True
    if args.quick:
        args.workloads, args.np, args.nets, args.seeds = ["digits_mlp", "teacher_cnn"], [2], \
            ["100"], 1
    reason = namespaces_unavailable()
    results, rows = {}, []
    for net_name in args.nets:
        if net_name != "loopback" and reason:
            print(f"skipping the {net_name} Mbit/s network: {reason}; use --nets loopback")
            continue
        for np_ in args.np:
            for wl in args.workloads:
                methods = [m for m in args.methods
                           if not METHODS[m].get("sparse_only") or WORKLOADS[wl].has_sparse]
                if "horovod" not in methods:
                    methods.insert(0, "horovod")
                started = time.monotonic()
                ranks = (f"{np_} ranks" if args.ranks_per_node == 1 else
                         f"{np_ // args.ranks_per_node} nodes x {args.ranks_per_node} ranks")
                progress.cell(f"{wl}, {ranks}, " + (
                    "loopback" if net_name == "loopback" else f"{float(net_name):g} Mbit/s"))
                jobs = ([[s] for s in range(args.seeds)] if args.job_per_seed
                        else [list(range(args.seeds))])
                if net_name == "loopback":
                    label = "loopback"
                    per_rank = _seeds_run(None, np_, jobs, lambda seeds: (
                        wl, methods, seeds, "127.0.0.1", 29511, "lo", args.steps, args.engine))
                else:
                    with EmulatedNetwork(np_, rate_mbit=float(net_name), delay_ms=args.delay_ms,
                                         ranks_per_node=args.ranks_per_node) as net:
                        print(f"{wl}, {np_} ranks: {net.describe()}", flush=True)
                        label = f"{float(net_name):g} Mbit/s" + (
                            f" {args.delay_ms:g} ms" if net.delay_emulated else "")
                        try:
                            per_rank = _seeds_run(net, np_, jobs, lambda seeds: (
                                wl, methods, seeds, net.addresses[0], 29511, "hvs0",
                                args.steps, args.engine))
                        except RanksFailed as e:  # report it, go on with the other cells
                            print(f"{wl}, {np_} ranks, {label} FAILED:\n{e}", flush=True)
                            continue
                cell = f"{wl}, {ranks}, {label}" + (
                    f", {args.steps} steps" if args.steps else "")
                results[cell] = summarize(per_rank, methods, wl)
                rows += rows_for(cell, results[cell], wl)
                print(f"{cell}: {time.monotonic() - started:.0f} s", flush=True)
                # written after every cell, so a long run interrupted keeps what it measured
                write(results, rows, args, argv)
    if not results:
        print("nothing was run")


def _seeds_run(net: Any, np_: int, jobs: list[list[int]], call: Any) -> list[dict]:
    """:func:`suite_body` for each job's seeds (``call(seeds)``: its arguments), every rank's
    runs of each method joined over the jobs in seed order."""
    per_rank: list[dict] = []
    for seeds in jobs:
        got = run_ranks_on(net, suite_body, np_, args=call(seeds), timeout=7200)
        per_rank = got if not per_rank else [{m: a[m] + b[m] for m in a}
                                              for a, b in zip(per_rank, got)]
    return per_rank


def write(results: dict, rows: list, args, argv) -> None:
    name = args.name or ("suite_quick" if args.quick else "suite")
    try:
        plots = plot(results, name)
    except ImportError as e:  # the numbers matter more than the pictures: keep them
        print(f"no plots ({e}; scripts/bench.sh installs requirements-bench.txt)", flush=True)
        plots = []
    data = dict(recommended=RECOMMENDED, seeds=args.seeds, cells=results, plots=plots)
    report(name, f"hvdsync vs peers (recommended = {RECOMMENDED})",
           markdown_table(HEADERS, rows), json.loads(json.dumps(data)),
           "benchmarks.bench_suite", argv)


HEADERS = ["workload, ranks, link", "method",
           "time to target (s) (a longer cell: to Horovod's score at the workload's steps / "
           "at its end)",
           "vs horovod (mean +- sd of the per-seed ratio)",
           "final metric (mean +- sd over seeds)",
           "metric at the end (steps)", "time/step vs horovod",
           "bytes/rank/step", "bytes vs horovod", "collectives/step"]

if __name__ == "__main__":
    main()
