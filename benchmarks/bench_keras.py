"""hvdsync.keras vs Horovod's own Keras 3 path (``DistributedGradientTape`` in a custom
``train_step``), through ``model.fit``: time per step, bytes and accuracy, side by side in one
run per network.

    .venv/bin/python -m benchmarks.bench_keras [--np 2] [--nets loopback 100]
        [--steps 200] [--width 256 --depth 6 --batch 128]

Every method of a (network, ranks) cell trains in the same job, one after the other, from the
same initial weights and data (planted-teacher classification, Adam). Each first runs a few
warm-up steps (tracing the train function), then ``--steps`` timed steps; time/step is that
wall time over the steps on the slowest rank, the fastest of ``--repeats`` rounds (the whole
method list is run again in each round). ``threshold=0`` sends every layer every step through
the decider; time to target is the training time (evaluations excluded; slowest rank) until
the held-out accuracy, evaluated every ``--eval-every`` steps, first reaches Horovod's final
accuracy less one point (``-``: not within the steps). The "eager pipeline" rows run the same decider through the step pipeline in
``tf.py_function`` (``HVDSYNC_KERAS_PIPELINE=1``) instead of compiled into the train function.
For small overheads trust ``benchmarks.bench_keras_overhead`` (interleaved rounds, intervals).
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import markdown_table, report, shows_progress
from benchmarks.network import EmulatedNetwork, namespaces_unavailable, run_ranks_on
from hvdsync.testing import progress

METHODS = {
    "horovod (DistributedGradientTape)": None,
    "hvdsync (nothing on)": {},
    "clip max_norm=1": dict(clip=dict(max_norm=1.0)),
    "threshold=0 (nothing skipped)": dict(threshold=0.0),
    "threshold=0, eager pipeline": dict(threshold=0.0, pipeline=True),
    "threshold 0.5, max_skip 8": dict(threshold=dict(threshold=0.5, max_skip=8)),
    "select k=25%": dict(select=dict(k=0.25)),
    "select k=25%, eager pipeline": dict(select=dict(k=0.25), pipeline=True),
    "delay s=2 K=16": dict(delay=dict(staleness=2, average_every=16)),
    "fp16": "fp16",
    "lowrank r=4": dict(lowrank=dict(rank=4)),
    "lowrank r=4 + fp16": dict(lowrank=dict(rank=4), fp16=True),
    "lowrank r=4 + threshold 0.5": dict(lowrank=dict(rank=4),
                                        threshold=dict(threshold=0.5, max_skip=8)),
    "lowrank r=4 + threshold 0.5, eager pipeline": dict(
        lowrank=dict(rank=4), threshold=dict(threshold=0.5, max_skip=8), pipeline=True),
    "lowrank r=4 + delay s=1 K=32": dict(lowrank=dict(rank=4),
                                         delay=dict(staleness=1, average_every=32)),
    # local steps (compiled): DiLoCo (K 32, Nesterov outer SGD) and its streamed preset (K 8
    # in 4 fragments, overlap 1, int8)
    "delay diloco (local steps)": dict(delay="diloco"),
    "delay streaming (local steps)": dict(delay="streaming"),
}
TOLERANCE = 0.01  # time to target: Horovod's final accuracy less this
FEATURES, CLASSES = 32, 10  # the teacher task's inputs and classes


def mlp(width: int, depth: int):
    """The Keras benches' model: ``depth`` Dense layers (``depth - 1`` ReLU ones ``width``
    wide, then the logits) on ``FEATURES`` inputs."""
    import keras
    return keras.Sequential([keras.Input((FEATURES,))]
                            + [keras.layers.Dense(width, activation="relu")
                               for _ in range(depth - 1)]
                            + [keras.layers.Dense(CLASSES)])


def methods_body(methods: list[str], steps: int, width: int, depth: int, batch: int,
                 seed: int, repeats: int = 2, eval_every: int = 10) -> dict:
    """On each rank: every method in turn, the whole list ``repeats`` times (the fastest
    round counts: two ranks share two cores here, so single rounds are noisy); per method
    time/step, bytes/step and accuracy."""
    out: dict = {}
    for _ in range(repeats):
        for name, r in _one_round(methods, steps, width, depth, batch, seed,
                                  eval_every=eval_every).items():
            if name not in out or r["step_s"] < out[name]["step_s"]:
                out[name] = r
    return out


def _one_round(methods: list[str], steps: int, width: int, depth: int, batch: int,
               seed: int, warmup: int = 5, eval_every: int = 10) -> dict:
    import os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf
    import hvdsync.keras as hvd
    from benchmarks.keras_peers import horovod_tape_model
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    features, classes = FEATURES, CLASSES
    teacher = np.random.default_rng(seed).standard_normal((features, classes))
    rng = np.random.default_rng(100 + hvd.rank())
    n = (steps + warmup) * batch
    x = rng.standard_normal((n, features)).astype("float32")
    y = np.argmax(x @ teacher, axis=1)
    xt = np.random.default_rng(99).standard_normal((2048, features)).astype("float32")
    yt = np.argmax(xt @ teacher, axis=1)
    out = {}
    for i, name in enumerate(methods):
        progress.step(i, len(methods), f"{name}, seed {seed} ({steps} steps each)")
        options = METHODS[name]
        keras.utils.set_random_seed(seed)
        model = mlp(width, depth)
        base = keras.optimizers.Adam(1e-3)
        if options is None:
            model = horovod_tape_model(model)
            opt = base
        elif options == "fp16":
            opt = hvd.DistributedOptimizer(base, compression=hvd.Compression.fp16)
        else:
            options = dict(options)
            wire = hvd.Compression.fp16 if options.pop("fp16", False) else hvd.Compression.none
            # the deciders compiled (default) or through the eager step pipeline, to compare
            os.environ["HVDSYNC_KERAS_PIPELINE"] = "1" if options.pop("pipeline", False) else "0"
            opt = hvd.DistributedOptimizer(base, compression=wire, **options)
        model.compile(optimizer=opt, metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x[:warmup * batch], y[:warmup * batch], batch_size=batch, verbose=0)
        before = opt.stats.total.bytes_sent if options is not None else 0
        curve = _Curve(model, xt, yt, eval_every)
        model.fit(x[warmup * batch:], y[warmup * batch:], batch_size=batch, verbose=0,
                  shuffle=False, callbacks=[curve])
        if hasattr(opt, "flush"):
            opt.flush()
        elapsed = curve.elapsed()
        acc = float(model.evaluate(xt, yt, verbose=0, return_dict=True)["accuracy"])
        if options is None:  # Horovod sends every gradient, uncompressed
            nbytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        else:
            nbytes = (opt.stats.total.bytes_sent - before) / steps
        out[name] = dict(step_s=elapsed / steps, accuracy=acc, bytes_per_step=nbytes,
                         curve=curve.points)
    return out


def _Curve(model, xt, yt, every: int):
    """A callback recording (training seconds, held-out accuracy) every ``every`` steps; the
    evaluations' own time is left out of the training seconds."""
    import time

    import keras
    import numpy as np

    class Curve(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.points: list[tuple[float, float]] = []
            self.start = time.perf_counter()
            self.paused = 0.0

        def elapsed(self) -> float:
            return time.perf_counter() - self.start - self.paused

        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % every:
                return
            t = time.perf_counter()
            acc = float(np.mean(np.argmax(model(xt, training=False), axis=1) == yt))
            self.points.append((t - self.start - self.paused, acc))
            self.paused += time.perf_counter() - t
    return Curve()


def time_to_target(curves: list[list[tuple[float, float]]], target: float) -> float | None:
    """First point where the ranks' mean accuracy reaches ``target``: the slowest rank's
    training seconds there (``None``: never)."""
    for points in zip(*curves):
        if sum(a for _, a in points) / len(points) >= target:
            return max(t for t, _ in points)
    return None


HEADERS = ["network", "ranks", "method", "time/step ms (slowest rank)", "time/step vs horovod",
           "bytes/step vs horovod", "held-out accuracy %",
           "time to Horovod's accuracy - 1 pt, vs horovod"]


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, nargs="+", default=[2])
    ap.add_argument("--nets", nargs="+", default=["loopback", "100"],
                    help="'loopback' and/or link rates in Mbit/s")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=128, help="per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=10,
                    help="steps between held-out evaluations (time to target)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--name", default="keras", help="results file name (benchmarks/results/)")
    args = ap.parse_args(argv)
    reason = namespaces_unavailable()
    rows, data = [], {}
    for net_name in args.nets:
        if net_name != "loopback" and reason:
            print(f"skipping the {net_name} Mbit/s network: {reason}")
            continue
        for np_ in args.np:
            progress.cell(f"{np_} ranks, {net_name}" + ("" if net_name == "loopback" else " Mbit/s"))
            call = (args.methods, args.steps, args.width, args.depth, args.batch, args.seed,
                    args.repeats, args.eval_every)
            if net_name == "loopback":
                label = "loopback"
                res = run_ranks_on(None, methods_body, np_, args=call, timeout=1800)
            else:
                with EmulatedNetwork(np_, rate_mbit=float(net_name)) as net:
                    label = net.describe()
                    res = run_ranks_on(net, methods_body, np_, args=call, timeout=1800)
            per = {m: dict(step_s=max(r[m]["step_s"] for r in res),
                           accuracy=statistics.mean(r[m]["accuracy"] for r in res),
                           bytes_per_step=res[0][m]["bytes_per_step"],
                           curves=[r[m]["curve"] for r in res]) for m in args.methods}
            base = per.get("horovod (DistributedGradientTape)")
            for v in per.values():
                v["time_to_target_s"] = time_to_target(
                    v["curves"], base["accuracy"] - TOLERANCE) if base else None
            data[f"{net_name}/np{np_}"] = dict(network=label, ranks=np_, methods=per)
            for m, v in per.items():
                ttt = v["time_to_target_s"]
                rows.append([label, np_, m, round(v["step_s"] * 1e3, 1),
                             f"{v['step_s'] / base['step_s']:.2f}" if base else "-",
                             f"{v['bytes_per_step'] / base['bytes_per_step']:.2f}" if base else "-",
                             f"{v['accuracy'] * 100:.1f}",
                             f"{ttt / base['time_to_target_s']:.2f}"
                             if ttt is not None and base and base["time_to_target_s"] else "-"])
            print(markdown_table(HEADERS, rows[-len(per):]), flush=True)
    headers = HEADERS
    model = f"{args.depth}-layer MLP width {args.width}, batch {args.batch}/rank, Adam"
    report(args.name, f"hvdsync.keras vs Horovod (Keras 3 fit), {model}, {args.steps} steps",
           markdown_table(headers, rows), dict(model=model, steps=args.steps, cells=data),
           "benchmarks.bench_keras", argv)


if __name__ == "__main__":
    main()
