"""The performance model (hvdsync.tools.perfmodel) against every committed bench cell: predicted vs
measured time and bytes per step, method by method, with the cells the constants were fitted
on named and the others held out (docs/at-scale.md).

    .venv/bin/python -m benchmarks.bench_perfmodel [--no-fit]
    .venv/bin/python -m benchmarks.bench_perfmodel --at-scale   # docs/at-scale.md's tables

Each workload's compute per step is measured here first (one rank, one thread, forward,
backward and optimizer; medians), as ``python -m hvdsync.tools.advise --measure`` does; a cell's
ranks share this machine's 2 cores (4 ranks: oversubscribed, a fitted slowdown). Inputs that
depend on the data, not on the network, come from the cell's own measurement and are named as
such: the share of bytes ``threshold=`` and ``select=`` sent. Everything else is predicted.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import statistics
import time
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from benchmarks.common import RESULTS, markdown_table, report
from benchmarks.workloads import WORKLOADS
from hvdsync.tools import perfmodel, twolevel
from hvdsync.tools.perfmodel import Cluster, Constants, ModelSizes

#: bench method -> (model technique, settings); None: not modelled (why)
METHODS = {
    "horovod": ("horovod", {}),
    "horovod fp16": ("horovod fp16", {}),
    "hvdsync": ("hvdsync", {}),
    "hvdsync clip": ("hvdsync clip", {}),
    "hvdsync threshold": ("hvdsync threshold", {}),
    "hvdsync select": ("hvdsync select", {}),
    "hvdsync threshold + fp16": ("hvdsync threshold", {"fp16": True}),
    "hvdsync select + fp16": ("hvdsync select", {"fp16": True}),
    "hvdsync delay": ("hvdsync delay", {}),
    "hvdsync sparse": ("hvdsync sparse", {}),
    "hvdsync lowrank": ("hvdsync lowrank", {}),
    "hvdsync lowrank + fp16": ("hvdsync lowrank", {"fp16": True}),
    # compositions: the decider's share of the compressed layers; the exchange behind delay=
    "hvdsync lowrank + threshold + fp16": ("hvdsync threshold", {"lowrank": 2, "fp16": True}),
    "hvdsync lowrank + delay": ("hvdsync delay", {"lowrank": 2, "staleness": 1}),
    "hvdsync lowrank + delay + fp16": ("hvdsync delay", {"lowrank": 2, "staleness": 1,
                                                         "fp16": True}),
    "hvdsync recommended": ("hvdsync streaming", {}),
    "ddp+powersgd": ("ddp+powersgd", {}),
    "ddp post-local sgd": ("ddp post-local sgd", {}),
    "torchft streaming diloco": ("hvdsync streaming",
                                 {"outer": dict(average_every=8, fragments=4, overlap=1,
                                                value_bytes=4)}),
    "no exchange": ("no exchange", {}),
    # the two-level mode (between="nodes"): hvdsync.tools.twolevel.predict
    "hvdsync recommended, nodes": ("hvdsync streaming", {}),
    "hvdsync lowrank + fp16, nodes": ("hvdsync lowrank", {"fp16": True}),
    "ddp post-local sgd, nodes": ("ddp post-local sgd", {}),
}
#: the Keras bench's cells (``python -m benchmarks.bench_keras --name keras_np2_perfmodel``:
#: its MLP, Adam, batch 128 per rank), all held out: the constants are fitted on torch cells.
#: Run on the machine that measures the compute (Keras results of other days ran on other VMs)
KERAS_RESULTS = "keras_np2_perfmodel"
KERAS_WORKLOAD = "keras_mlp"
KERAS_METHODS = {
    "horovod (DistributedGradientTape)": ("horovod", {}),
    "hvdsync (nothing on)": ("hvdsync", {}),
    "clip max_norm=1": ("hvdsync clip", {}),
    "threshold=0 (nothing skipped)": ("hvdsync threshold", {}),
    "threshold 0.5, max_skip 8": ("hvdsync threshold", {}),
    "select k=25%": ("hvdsync select", {}),
    "delay s=2 K=16": ("hvdsync delay", {"staleness": 2, "average_every": 16}),
    "fp16": ("hvdsync", {"fp16": True}),
    "lowrank r=4": ("hvdsync lowrank", {"lowrank": 4}),
    "lowrank r=4 + fp16": ("hvdsync lowrank", {"lowrank": 4, "fp16": True}),
    "lowrank r=4 + delay s=1 K=32": ("hvdsync delay", {"lowrank": 4, "staleness": 1,
                                                       "average_every": 32}),
}
#: the cells the constants are fitted on (file names); every other cell is held out
FIT = ("suite_quick", "suite_lm_np2", "suite_zipf_np2", "suite_lm_lowrank_np2", "suite",
       "suite_lm_outer_np2_1gbit")
#: cells measured again later with 3 seeds (the code they ran has changed since): shown, held
#: out, marked
SUPERSEDED = {"suite_zipf": "suite_zipf_np2"}
#: the bench bed's cores (ranks beyond share them)
CORES = 2
#: steps a run starts plain, counted in its per-step averages: lowrank='s warm-up
#: (suite_methods.LOWRANK; LowRankConfig's default in the Keras bench), PowerSGD's
#: ``start_powerSGD_iter`` and post-local SGD's synchronous start (bench_suite)
PLAIN_START = 10
#: the Keras bench's first, untimed ``fit`` (bench_keras.run's ``warmup``): not in its figures
KERAS_UNTIMED = 5


#: the Keras overhead bench's runs the compiled deciders' costs come from (not the Keras cells,
#: which stay held out): ``python -m benchmarks.bench_keras_overhead --net 100 --rounds 8
#: --steps 20 --width W --methods "hvdsync (plain path)" "threshold=0" "select (every layer)"
#: --name keras_overhead_np2_100mbit_wW`` for W = 256 and 512
KERAS_DECIDER_RUNS = ("keras_overhead_np2_100mbit_w256", "keras_overhead_np2_100mbit_w512")


def keras_decider_costs() -> tuple[float, float]:
    """``(keras_decider_s, keras_keep_s)``: a straight line through the compiled deciders'
    extra seconds per step (each run's mean ratio to the plain path, both deciders averaged)
    against the model's parameter count, over the two widths."""
    from benchmarks.bench_keras import FEATURES, CLASSES
    points = []
    for name in KERAS_DECIDER_RUNS:
        data = json.load(open(os.path.join(RESULTS, f"{name}.json")))
        width = int(re.search(r"width (\d+)", data["model"]).group(1))
        depth = int(re.search(r"(\d+)-layer", data["model"]).group(1))
        params = (FEATURES * width + width + (depth - 2) * (width * width + width)
                  + width * CLASSES + CLASSES)
        plain = data["vs_plain"]["hvdsync (plain path)"]["step_ms"] / 1e3
        extra = statistics.mean((data["vs_plain"][m]["ratio"] - 1) * plain
                                for m in ("threshold=0", "select (every layer)"))
        points.append((params, extra))
    (p0, e0), (p1, e1) = points
    per_param = (e1 - e0) / (p1 - p0)
    return e0 - per_param * p0, per_param


def _keras_sizes() -> ModelSizes:
    """The Keras bench's MLP (benchmarks.bench_keras' defaults) and its compiled local step,
    measured here with one TensorFlow thread, as its ranks run."""
    import keras
    import tensorflow as tf

    from benchmarks.bench_keras import CLASSES, FEATURES, mlp
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    model, batch = mlp(width=256, depth=6), 128
    x = np.random.default_rng(0).standard_normal((batch, FEATURES)).astype("float32")
    y = np.random.default_rng(1).integers(0, CLASSES, batch)
    f, b, o = perfmodel.measure_keras(model, x, y, repeats=30,
                                      optimizer=keras.optimizers.Adam(1e-3))
    return ModelSizes(perfmodel.layers_of(model), f, b, o, adapter="keras")


def _sizes(workload: str) -> ModelSizes:
    """The workload's model sizes and its compute per step, measured here."""
    if workload == KERAS_WORKLOAD:
        return _keras_sizes()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w = WORKLOADS[workload]
    model = w.make_model(False)
    x, y = w.batches(0, 1, 0)()
    rows = {}
    if w.has_sparse:  # the rows one rank's batch touches: its distinct token ids
        rows = {"embedding": int(torch.unique(x).numel())}
    layers = perfmodel.layers_of(model, rows)
    f, b, o = perfmodel.measure_torch(model, (x, y), nn.functional.cross_entropy,
                                      w.make_optimizer(model, 1), repeats=15)
    return ModelSizes(layers, f, b, o)


#: a loopback cell's "link": no rate of its own; what caps it is the reduction's own speed
#: (Constants.max_gbit, fitted on the emulated links) and a few microseconds a hop
LOOPBACK = dict(bandwidth_gbit=1000.0, latency_us=5.0)
#: the bed's bridge inside a node (its ranks on one namespace's loopback) as the two-level
#: mode's node reduction sees it: measured here by :func:`node_bridge_gbit`
NODE_BRIDGE: dict = {}


def _bridge_rank(rank: int, nbytes: int, port: int, out: object) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.ones(nbytes // 4)
    times = []
    for i in range(35):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times[5:]))
    dist.destroy_process_group()


def node_bridge_gbit(nbytes: int = 1 << 22, port: int = 29641) -> float:
    """The rate of torch.distributed's Gloo allreduce between two ranks on this machine's
    loopback (a ring of two: each sends ``nbytes``), the median of 30; Gbit/s. The two-level
    mode's node reduction runs there on the bed; Constants.max_gbit is Horovod's own speed,
    which it does not cross."""
    import torch.multiprocessing as mp
    out = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_bridge_rank, args=(nbytes, port, out), nprocs=2)
    return nbytes * 8 / out.get() / 1e9


def _cell_cluster(cell: str, two_level: bool = False) -> Cluster:
    """A cell's ranks and links; on a bed of nodes ("2 nodes x 2 ranks") the link is the
    node's: a flat ring (ranks in node order) crosses each node's link once each way, as a
    ring of one rank per node at the node's rate does; the two-level mode's cluster has the
    node's ranks on their bridge (unlimited: the loopback's rate) and a rank's share of the
    node's link."""
    nodes = re.search(r"(\d+) nodes x (\d+) ranks", cell)
    ranks = (int(nodes.group(1)) * int(nodes.group(2)) if nodes
             else int(re.search(r"(\d+) ranks", cell).group(1)))
    if cell.endswith("loopback"):
        return Cluster(ranks=ranks, algorithm="ring", **LOOPBACK)
    mbit = float(re.search(r"(\d+) Mbit/s", cell).group(1))
    # the emulated link: a token bucket per rank (per node), no delay emulated (no netem on
    # this kernel); the bridge and veth pairs: ~50 us a hop
    if nodes and two_level:
        g = int(nodes.group(2))
        if not NODE_BRIDGE:
            NODE_BRIDGE["bandwidth_gbit"] = node_bridge_gbit()
            print(f"the bridge inside a node (Gloo on loopback, 2 ranks): "
                  f"{NODE_BRIDGE['bandwidth_gbit']:.1f} Gbit/s")
        return Cluster(ranks=ranks, bandwidth_gbit=mbit / 1000 / g, latency_us=50.0,
                       ranks_per_node=g, intra_bandwidth_gbit=NODE_BRIDGE["bandwidth_gbit"],
                       intra_latency_us=50.0, algorithm="ring")
    return Cluster(ranks=ranks, bandwidth_gbit=mbit / 1000, latency_us=50.0,
                   algorithm="ring")


def _keras_cells() -> list[dict]:
    """The Keras bench's cells: at a link rate, and on loopback (:data:`LOOPBACK`)."""
    path = os.path.join(RESULTS, f"{KERAS_RESULTS}.json")
    if not os.path.exists(path):
        return []
    out = []
    data = json.load(open(path))
    for c in data["cells"].values():
        match = re.match(r"(\d+) Mbit/s", c["network"])
        link = f"{match.group(1)} Mbit/s" if match else "loopback"
        cell = f"{KERAS_WORKLOAD}, {c['ranks']} ranks, {link}"
        for method, v in c["methods"].items():
            out.append(dict(file=KERAS_RESULTS, cell=cell, method=method, step_s=v["step_s"],
                            recommended="", bytes=v["bytes_per_step"], local_step_s=None,
                            dense_bytes=None, steps=data["steps"]))
    return out


def _technique(row: dict) -> tuple[str, dict]:
    """The model's technique and settings for a bench row."""
    methods = KERAS_METHODS if row["file"] == KERAS_RESULTS else METHODS
    return methods[row["method"]]


def _cells() -> list[dict]:
    out = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "suite*.json"))):
        name = os.path.basename(path)[:-5]
        data = json.load(open(path))
        for cell, c in data["cells"].items():
            base = c["methods"].get("horovod")
            local = c["methods"].get("no exchange", {}).get("step_s")
            for method, v in c["methods"].items():
                out.append(dict(file=name, cell=cell, method=method, step_s=v["step_s"],
                                recommended=data.get("recommended", ""),
                                bytes=v["bytes_per_step"], local_step_s=local,
                                dense_bytes=base["bytes_per_step"] if base else None,
                                steps=v.get("steps")))
    return out + _keras_cells()


def _predict(row: dict, sizes: ModelSizes, c: Constants) -> tuple[float, float, str]:
    """Predicted step seconds and bytes of one bench row, and what it assumed."""
    technique, settings = _technique(row)
    two_level = row["method"].endswith(twolevel.SUFFIX)
    cluster = _cell_cluster(row["cell"], two_level)
    settings = dict(settings)
    said = ""
    if row["cell"].endswith("loopback"):
        said = "loopback: capped by the reduction's own speed (max_gbit)"
    if row.get("steps"):  # the run's plain first steps are in its averages
        plain = PLAIN_START - (KERAS_UNTIMED if row["file"] == KERAS_RESULTS else 0)
        settings["warmup_share"] = plain / row["steps"]
    if row.get("local_step_s") and technique != "no exchange":
        # the job ran each rank alone too: its compute, as this job's machine had it (the
        # VM's speed drifts by tens of percent between jobs: docs/at-scale.md) -- with its
        # ranks sharing the cores as in every other run of the cell, so that the slowdown of
        # more ranks than cores is in it already
        local = max(row["local_step_s"] - c.step_s, 1e-6)
        sizes = perfmodel.with_compute(sizes, local / 3, 2 * local / 3)
        c = replace(c, cores=None)
        said = "compute from this job's no-exchange run"
    if technique == "no exchange":
        p = perfmodel.predict("horovod", sizes, replace(cluster, ranks=1), c)
        return p.step_s, 0.0, ""
    if technique in ("hvdsync threshold", "hvdsync select"):  # data-dependent: measured
        every_layer = perfmodel.predict(technique, sizes, cluster, c,
                                        **{**settings, "send_fraction": 1.0})
        settings["send_fraction"] = min(1.0, row["bytes"] / every_layer.bytes_per_step)
        said = "; ".join(x for x in (said, f"sent share {settings['send_fraction']:.2f} "
                                           "(measured)") if x)
    if row["method"] == "hvdsync recommended":
        if any(layer.rows_touched for layer in sizes.layers):
            technique, settings = "hvdsync sparse", {"fp16": True}
        elif row["recommended"].startswith("delay= (staleness"):  # the preset before issue 29
            technique, settings = "hvdsync delay", {"fp16": True}
    p = (twolevel.predict if two_level else perfmodel.predict)(technique, sizes, cluster, c,
                                                               **settings)
    nbytes = p.bytes_per_step
    if technique == "ddp+powersgd":  # bench_suite counts its factors' bytes, warm-up aside
        nbytes = perfmodel.predict(technique, sizes, cluster, c,
                                   **{**settings, "warmup_share": 0.0}).bytes_per_step
    return p.step_s, nbytes, said


def _modelled(row: dict, sizes: ModelSizes) -> str | None:
    """Why a row is not modelled, or None."""
    if row["file"] == KERAS_RESULTS:
        if row["method"] not in KERAS_METHODS:
            return "Keras' eager comparison path (HVDSYNC_KERAS_PIPELINE=1): not modelled"
        return None
    if row["method"] not in METHODS:
        return "a combination the model does not compose"
    sparse = any(layer.rows_touched for layer in sizes.layers)
    if sparse and row["method"] in ("horovod", "hvdsync", "hvdsync clip", "hvdsync threshold",
                                    "hvdsync select", "hvdsync delay"):
        return "Horovod's sparse allgather path (cost not in the model)"
    return None


def _fit(rows: list[dict], sizes: dict) -> Constants:
    from scipy.optimize import minimize
    names = ("link_efficiency", "max_gbit", "collective_s", "overlap", "layer_s", "decider_s",
             "delay_s", "ddp_s", "cast_s", "accumulate_s", "flops", "matrix_s", "step_s",
             "oversubscribed")
    # the starting point: plausible round values; Keras' compiled deciders' costs are not
    # fitted here (they come from the Keras overhead bench: keras_decider_costs)
    keras_fixed, keras_per_param = keras_decider_costs()
    start = Constants(keras_decider_s=keras_fixed, keras_keep_s=keras_per_param)

    def constants(z: np.ndarray) -> Constants:
        vals = {n: float(x) for n, x in zip(names, np.exp(z))}
        vals["link_efficiency"] = min(vals["link_efficiency"], 1.0)
        vals["overlap"] = min(vals["overlap"], 1.0)
        return replace(start, cores=CORES, **vals)

    def loss(z: np.ndarray) -> float:
        c = constants(z)
        errs = [math.log(_predict(r, sizes[r["workload"]], c)[0] / r["step_s"]) ** 2
                for r in rows]
        return float(np.mean(errs))
    z0 = np.log([getattr(start, n) if getattr(start, n) is not None else 1.0 for n in names])
    best = minimize(loss, z0, method="Nelder-Mead", options=dict(maxiter=3000, xatol=1e-3,
                                                                fatol=1e-6))
    return constants(best.x)


def at_scale(argv) -> None:
    """Predictions for 8, 64 and 512 ranks (8 per node) at 1, 10 and 100 Gbit/s per rank for
    GPT 125M, GPT 1.3B and ResNet-50 (assumed GPU cluster constants), and plots of the step
    time against ranks and bandwidth for the bench workloads (constants fitted here, one
    machine per rank)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hvdsync.tools import advise
    rows, data = [], {}
    for name, p in advise.presets(tokens=16384, images=256).items():
        compute = p.flops_per_step / 400e12
        sizes = ModelSizes(p.layers, compute / 3, 2 * compute / 3)
        for ranks in (8, 64, 512):
            for gbit in (1.0, 10.0, 100.0):
                cluster = Cluster(ranks=ranks, bandwidth_gbit=gbit, ranks_per_node=8)
                r = advise.advise(sizes, cluster, p.family, advise.GPU_CLUSTER)
                by = {x["prediction"].technique: x for x in r["rows"]}
                best = by[r["recommended"]]
                data[f"{name}/{ranks}/{gbit:g}"] = {
                    t: dict(step_s=x["prediction"].step_s, time_to_target=x["time_to_target"])
                    for t, x in by.items()}
                rows.append([name, ranks, f"{gbit:g}", f"{compute * 1e3:.0f}",
                             f"{r['horovod_step_s'] * 1e3:.0f}",
                             f"{by['horovod fp16']['prediction'].step_s * 1e3:.0f}",
                             r["recommended"],
                             f"{best['prediction'].step_s * 1e3:.0f}",
                             f"{best['time_to_target']:.2f}x"])
    table = markdown_table(["model", "ranks", "Gbit/s", "compute ms", "horovod ms",
                            "fp16 ms", "recommended", "its step ms", "time to target"], rows)
    names = []
    c = perfmodel.CALIBRATED
    for axis, values in (("ranks", [2, 4, 8, 16, 32, 64, 128, 256, 512]),
                         ("bandwidth", [0.1, 0.3, 1, 3, 10, 30, 100])):
        fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(4.5 * len(WORKLOADS), 4))
        for ax, workload in zip(axes, sorted(WORKLOADS)):
            sizes = _sizes(workload)
            for t in ("horovod", "horovod fp16", "hvdsync lowrank", "hvdsync streaming",
                      "ddp+powersgd") + (("hvdsync sparse",) if WORKLOADS[workload].has_sparse
                                         else ()):
                ys = []
                for v in values:
                    cl = (Cluster(ranks=v, bandwidth_gbit=0.1, algorithm="ring")
                          if axis == "ranks" else
                          Cluster(ranks=8, bandwidth_gbit=v, algorithm="ring"))
                    ys.append(perfmodel.predict(t, sizes, cl, c).step_s * 1e3)
                ax.plot(values, ys, label=t)
            ax.set_xscale("log")
            ax.set_title(workload)
            ax.set_xlabel("ranks (100 Mbit/s)" if axis == "ranks" else "Gbit/s (8 ranks)")
            ax.set_ylabel("predicted ms per step")
        for ax in axes:
            ax.legend(fontsize=6)
        fig.suptitle("Predicted step time (constants fitted on the bench bed, one machine "
                     "per rank) -- predictions, not measurements")
        fig.tight_layout()
        out = RESULTS / f"at_scale_{axis}.png"
        fig.savefig(out, dpi=80)
        plt.close(fig)
        names.append(out.name)
    report("at_scale", "Predicted, not measured: 8 ranks per node, NCCL-like constants "
           "(hvdsync.tools.advise.GPU_CLUSTER), 16k tokens / 256 images per rank per step at 400 "
           "TFLOP/s", table, {"cells": data, "plots": names}, "benchmarks.bench_perfmodel",
           argv)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-fit", action="store_true",
                    help="use hvdsync.tools.perfmodel.CALIBRATED as it is")
    ap.add_argument("--compute-from", metavar="JSON",
                    help="each workload's compute per step from this earlier run's results "
                         "(e.g. benchmarks/results/perfmodel.json) instead of measuring it "
                         "here: the cells' machine, not this one (the VMs' speeds differ)")
    ap.add_argument("--at-scale", action="store_true",
                    help="the predictions of docs/at-scale.md instead")
    args = ap.parse_args(argv)
    if args.at_scale:
        at_scale(argv)
        return
    rows = _cells()
    workloads = sorted({r["cell"].split(",")[0] for r in rows})
    sizes = {w: _sizes(w) for w in workloads}
    if args.compute_from:
        earlier = json.load(open(args.compute_from))["compute"]
        # a workload the earlier run did not have (the Keras cells: run on this machine) keeps
        # the compute measured here
        sizes = {w: perfmodel.with_compute(s, earlier[w]["forward_s"], earlier[w]["backward_s"],
                                           earlier[w]["optimizer_s"]) if w in earlier else s
                 for w, s in sizes.items()}
    for r in rows:
        r["workload"] = r["cell"].split(",")[0]
        r["why_not"] = _modelled(r, sizes[r["workload"]])
        r["fit"] = r["file"] in FIT
    modelled = [r for r in rows if r["why_not"] is None]
    c = (replace(perfmodel.CALIBRATED, cores=CORES) if args.no_fit
         else _fit([r for r in modelled if r["fit"]], sizes))
    table, errors = [], {"fit": [], "held out": []}
    for r in rows:
        if r["why_not"]:
            table.append([r["file"], r["cell"], r["method"], f"{r['step_s'] * 1e3:.1f}", "",
                          "", "", "", r["why_not"]])
            continue
        step, nbytes, said = _predict(r, sizes[r["workload"]], c)
        r["predicted_s"], r["predicted_bytes"] = step, nbytes
        err = step / r["step_s"] - 1
        errors["fit" if r["fit"] else "held out"].append(abs(err))
        table.append([r["file"], r["cell"], r["method"], f"{r['step_s'] * 1e3:.1f}",
                      f"{step * 1e3:.1f}", f"{err:+.0%}",
                      f"{r['bytes'] / 1024:.1f}", f"{nbytes / 1024:.1f}",
                      ("fitted" if r["fit"] else "held out")
                      + (f"; superseded by {SUPERSEDED[r['file']]}" if r["file"] in SUPERSEDED
                         else "") + (f"; {said}" if said else "")])
    md = markdown_table(["results", "cell", "method", "measured ms", "predicted ms", "error",
                         "KiB measured", "KiB predicted", "note"], table)
    summary = {k: dict(cells=len(v), median=statistics.median(v) if v else None,
                       within_15=int(sum(e <= 0.15 for e in v))) for k, v in errors.items()}
    compute = {w: dict(forward_s=s.forward_s, backward_s=s.backward_s,
                       optimizer_s=s.optimizer_s, params=s.params) for w, s in sizes.items()}
    lines = [f"{k}: {v['cells']} rows, median |error| {v['median']:.0%}, "
             f"{v['within_15']} within 15 %" for k, v in summary.items() if v["cells"]]
    report("perfmodel", "The performance model against the committed bench cells "
           f"(constants: {c})\n" + "\n".join(lines) + "\ncompute per step: "
           + ", ".join(f"{w} {s.compute_s * 1e3:.1f} ms" for w, s in sizes.items())
           + (f" (from {args.compute_from})" if args.compute_from else " (measured here)"),
           md, {"constants": c.__dict__, "summary": summary, "compute": compute, "rows": rows},
           "benchmarks.bench_perfmodel", argv)


if __name__ == "__main__":
    main()
