"""Step overhead of hvdsync.keras when nothing is skipped: the deciders in the compiled train
function against the plain graph path, and both against Horovod's ``DistributedGradientTape``.

    python -m benchmarks.bench_keras_overhead                  # loopback, 2 ranks
    python -m benchmarks.bench_keras_overhead --net 100 --rounds 12

Each rank pins itself to one core (2 ranks on 2 cores, one TensorFlow thread each) and builds
every method on its own copy of the same model (bench_keras' MLP, Adam) through ``model.fit``:
Horovod's tape; hvdsync with nothing enabled (the plain graph path); ``clip`` with a limit
never reached (by name, in global mode too); ``threshold=0`` and ``select`` with every layer
(the deciders, compiled: every layer sent every step; by name, ``select`` with the norm
selector: no hypernet, so no dot product of each layer's gradient and weights); ``delay`` with
staleness 0 (sends everything through the eager step pipeline, for scale); and, by name only
(``--methods``), ``delay="diloco"`` and ``delay="streaming"``: local steps, what an inner step
costs in Keras -- compiled, through the eager step pipeline (``HVDSYNC_KERAS_PIPELINE=1``), and
the wrapped optimizer alone (no exchange at all); ``lowrank=4`` alone, inside ``delay=`` and
beside ``threshold=0`` (each compiled, and through the eager step pipeline), compressing. With
``--vocab V``: an embedding of ``V`` rows (row-sparse gradients: Zipf-distributed token bags)
before the MLP, and, by name, ``sparse=True`` compiled and through the eager step pipeline
(Horovod's tape and the plain path send the embedding's rows by Horovod's own allgathers). And,
by name, the floor of a decider's own work: Horovod's tape plus each layer's gradient norm
every step (per layer, packed, or allreduced as a decider's control round;
``benchmarks.keras_peers.STATISTICS``). Rounds interleave the methods (the order rotates every
round); each method trains ``--steps`` steps per round after a warm-up ``fit`` (tracing), timed
from the end of its first step to the end of its last; the warm-up ``fit`` (2 steps, with
``BroadcastGlobalVariablesCallback``) is timed too, the slowest rank's: what tracing the train
function costs each method. A round's time per step is the slowest rank's; the figure is the
ratio to the plain path's (and to Horovod's) time per step *in the same round*, averaged over
rounds, with a 95 % interval (Student t). Results:
``benchmarks/results/keras_overhead_np<N>[_<rate>mbit].{json,md}`` (or ``--name``). """

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.bench_keras import CLASSES, FEATURES, mlp
from benchmarks.bench_overhead import summarize
from benchmarks.common import markdown_table, report, shows_progress
from benchmarks.network import EmulatedNetwork, namespaces_unavailable, run_ranks_on
from hvdsync.testing import progress

METHODS: dict[str, Any] = {
    "horovod (tape)": None,
    # the floor of a decider's own work on the tape (benchmarks.keras_peers.STATISTICS):
    # every layer's gradient norm each step, per layer or packed, and shared in a control
    # round -- what threshold= and select= compute at the least (docs/keras.md)
    "horovod (tape) + layer statistics": ("tape", "layers"),
    "horovod (tape) + packed layer statistics": ("tape", "packed"),
    "horovod (tape) + shared layer statistics": ("tape", "layers, shared"),
    "hvdsync (plain path)": {},
    # the compiled step's entry tag left out (hvdsync.keras.comm.KerasCommunicator.step_tag)
    "hvdsync (plain path), no entry tag": dict(_entry_tag=False),
    "clip (never clips)": dict(clip=dict(max_norm=1e9)),
    "clip global (never clips)": dict(clip=dict(max_norm=1e9, mode="global")),
    "threshold=0": dict(threshold=0.0),
    "select (every layer)": dict(select=dict(k=1.0)),
    # the same without the hypernet: no dot product of each layer's gradient and weights
    "select, norm selector (every layer)": dict(select=dict(k=1.0, selector="norm")),
    "delay staleness=0 (compiled)": dict(delay=dict(staleness=0)),
    # the stale global gradient: compiled (folded when due, Keras' default), and folded as
    # it arrives (the eager step pipeline: a background exchange the host polls)
    "delay staleness=1 K=32 (compiled)": dict(delay=dict(staleness=1, average_every=32)),
    "delay staleness=2 K=32 (compiled)": dict(delay=dict(staleness=2, average_every=32)),
    # the averaging round as the outer synchronization's exchange: int8 differences from
    # the last synchronized point (1/4 of its bytes), merged a step later (overlap)
    "delay staleness=1 K=32 int8 averaging (compiled)": dict(
        delay=dict(staleness=1, average_every=32, compress="int8", overlap=1)),
    "delay staleness=1 K=32 (arrived, eager pipeline)": dict(
        delay=dict(staleness=1, average_every=32, fold="arrived")),
    # local steps (nothing exchanged between synchronizations): what an inner step costs,
    # compiled, through the eager step pipeline (as before they were compiled), and the
    # wrapped optimizer alone (no hvdsync, no exchange: the floor)
    "delay diloco (local steps)": dict(delay="diloco"),
    "delay streaming (local steps)": dict(delay="streaming"),
    "delay diloco (local steps, eager pipeline)": dict(delay="diloco"),
    "delay streaming (local steps, eager pipeline)": dict(delay="streaming"),
    "keras alone (no exchange)": "alone",
    # compressing (fewer bytes, so not "nothing skipped"): compiled, and through the eager
    # step pipeline (as before it was compiled)
    "lowrank=4 (compiled)": dict(lowrank=dict(rank=4, warmup_steps=0)),
    "lowrank=4 (eager pipeline)": dict(lowrank=dict(rank=4, warmup_steps=0)),
    "lowrank=4 inside delay staleness=1 (compiled)": dict(
        lowrank=dict(rank=4, warmup_steps=0), delay=dict(staleness=1, average_every=32)),
    "lowrank=4 inside delay staleness=1 (eager pipeline)": dict(
        lowrank=dict(rank=4, warmup_steps=0), delay=dict(staleness=1, average_every=32)),
    # beside a decider that sends every layer (threshold=0): each layer's rounds in the
    # branch its plan takes (compiled), and through the eager step pipeline
    "lowrank=4 + threshold=0 (compiled)": dict(lowrank=dict(rank=4, warmup_steps=0),
                                               threshold=0.0),
    "lowrank=4 + threshold=0 (eager pipeline)": dict(lowrank=dict(rank=4, warmup_steps=0),
                                                     threshold=0.0),
    # row-sparse embedding gradients (--vocab): sparse= compiled, and through the eager
    # step pipeline (as before it was compiled)
    "sparse (compiled)": dict(sparse=True),
    "sparse (eager pipeline)": dict(sparse=True),
}
#: tokens per example with ``--vocab`` (a bag, averaged)
BAG = 16
BASE = "hvdsync (plain path)"
#: what runs unless ``--methods`` says otherwise: everything sent every step
DEFAULT = ["horovod (tape)", BASE, "clip (never clips)", "threshold=0", "select (every layer)",
           "delay staleness=0 (compiled)"]


def overhead_body(methods: list[str], rounds: int, steps: int, width: int, depth: int,
                  batch: int, warmup: int = 0, vocab: int = 0) -> dict:
    """One rank: every method on its own model copy, rounds interleaved; per round and
    method the slowest rank's seconds per step (``warmup``: untimed steps after the first
    fit, so that what a method traces on first use -- an outer exchange per fragment --
    is traced before the rounds)."""
    import os
    import time

    import keras
    import numpy as np
    import tensorflow as tf

    import hvdsync.keras as hvd
    from benchmarks.keras_peers import horovod_tape_model
    from hvdsync.keras.comm import KerasCommunicator
    import horovod.tensorflow as htf
    hvd.init()
    os.sched_setaffinity(0, {hvd.rank() % os.cpu_count()})
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    features, classes = FEATURES, CLASSES
    teacher = np.random.default_rng(0).standard_normal((features, classes))
    rng = np.random.default_rng(100 + hvd.rank())
    if vocab:  # token bags, Zipf-skewed; the label from a teacher on the bag's tokens
        p = 1.0 / np.arange(1, vocab + 1)
        x = rng.choice(vocab, size=(steps * batch, BAG), p=p / p.sum()).astype("int32")
        y = np.argmax(np.random.default_rng(0).standard_normal((vocab, classes))[x].sum(1), 1)
    else:
        x = rng.standard_normal((steps * batch, features)).astype("float32")
        y = np.argmax(x @ teacher, axis=1)
    models, compile_s = {}, {}
    step_tag, tagged = KerasCommunicator.step_tag, True
    for name in methods:
        keras.utils.set_random_seed(0)
        model = mlp(width, depth) if not vocab else keras.Sequential(
            [keras.Input((BAG,), dtype="int32"), keras.layers.Embedding(vocab, features),
             keras.layers.GlobalAveragePooling1D(), mlp(width, depth)])
        opt = keras.optimizers.Adam(1e-3)
        if METHODS[name] is None or isinstance(METHODS[name], tuple):
            model = horovod_tape_model(model, statistics=(METHODS[name] or (None, None))[1])
        elif METHODS[name] != "alone":
            # read when the optimizer is built (by the callback in the first fit)
            os.environ["HVDSYNC_KERAS_PIPELINE"] = "1" if "eager pipeline" in name else "0"
            options = dict(METHODS[name])
            tagged = options.pop("_entry_tag", True)
            opt = hvd.DistributedOptimizer(opt, **options)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        htf.allreduce(tf.zeros([1]), name=f"go.compile.{name}")
        start = time.perf_counter()
        if not tagged:  # traced without the step's tag (the first fit traces)
            KerasCommunicator.step_tag = lambda self, step: tf.constant(True)
        # the first fit traces the train function (once: the callback builds the optimizer)
        model.fit(x[:2 * batch], y[:2 * batch], batch_size=batch, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        KerasCommunicator.step_tag, tagged = step_tag, True
        os.environ.pop("HVDSYNC_KERAS_PIPELINE", None)
        compile_s[name] = float(htf.allreduce(
            tf.constant([time.perf_counter() - start], tf.float64), op=htf.Max,
            name=f"c.{name}").numpy()[0])
        if warmup:
            model.fit(np.resize(x, (warmup * batch, x.shape[1])), np.resize(y, warmup * batch),
                      batch_size=batch, verbose=0)
        models[name] = model
    per_round: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for i, name in enumerate(order):
            progress.step(r * len(order) + i, rounds * len(order),
                          f"round {r + 1}/{rounds}, {name}")
            htf.allreduce(tf.zeros([1]), name=f"go.{r}.{name}")  # start together
            marks: list[float] = []
            clock = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda *_, **__: marks.append(time.perf_counter()))
            models[name].fit(x, y, batch_size=batch, verbose=0, shuffle=False,
                             callbacks=[clock])
            local = (marks[-1] - marks[0]) / (len(marks) - 1)  # fit's start-up excluded
            slowest = htf.allreduce(tf.constant([local], tf.float64), op=htf.Max,
                                        name=f"t.{r}.{name}")
            per_round[name].append(float(slowest.numpy()[0]))
    return dict(per_round=per_round, compile_s=compile_s)


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per method per round")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=128, help="per rank")
    ap.add_argument("--warmup", type=int, default=0,
                    help="untimed steps per method before the rounds (after the first fit)")
    ap.add_argument("--vocab", type=int, default=0,
                    help="an embedding of this many rows before the MLP (row-sparse gradients)")
    ap.add_argument("--methods", nargs="+", default=DEFAULT, choices=list(METHODS))
    ap.add_argument("--net", default="loopback",
                    help="'loopback' or a link rate in Mbit/s for the emulated network")
    ap.add_argument("--name", help="results file name (default: keras_overhead_np<N>"
                                   "[_<rate>mbit])")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (the interval needs a spread)")
    methods = [BASE] + [m for m in args.methods if m != BASE]
    call = (methods, args.rounds, args.steps, args.width, args.depth, args.batch, args.warmup,
            args.vocab)
    if args.net == "loopback":
        per_rank = run_ranks_on(None, overhead_body, args.np, args=call, timeout=3600)
    else:
        reason = namespaces_unavailable()
        if reason:
            ap.error(f"--net {args.net}: {reason}")
        with EmulatedNetwork(args.np, rate_mbit=float(args.net)) as net:
            per_rank = run_ranks_on(net, overhead_body, args.np, args=call, timeout=3600)
    per_round = per_rank[0]["per_round"]  # every rank holds the same maxima
    compile_s = per_rank[0]["compile_s"]
    vs_plain = summarize(per_round, base=BASE)
    horovod = "horovod (tape)"
    vs_horovod = summarize(per_round, base=horovod) if horovod in per_round else None
    rows = []
    for name in methods:
        s = vs_plain[name]
        h = vs_horovod[name] if vs_horovod else None
        rows.append([name, f"{s['step_ms']:.1f}", f"{s['ratio']:.3f}",
                     f"[{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]",
                     f"{h['ratio']:.3f}" if h else "-", f"{compile_s[name]:.2f}"])
    table = markdown_table(["method", "ms/step (median)", "time/step vs plain path", "95 % CI",
                            "vs horovod (tape)", "first fit s (trace)"], rows)
    link = "loopback" if args.net == "loopback" else f"{args.net} Mbit/s emulated links"
    suffix = "" if args.net == "loopback" else f"_{args.net}mbit"
    model = (f"{args.depth}-layer MLP width {args.width}, batch {args.batch}/rank, Adam"
             + (f", after an embedding of {args.vocab} rows (bags of {BAG} Zipf tokens)"
                if args.vocab else ""))
    report(args.name or f"keras_overhead_np{args.np}{suffix}",
           f"hvdsync.keras step overhead with nothing skipped, {model}, {args.np} ranks x 1 "
           f"core, {link}, {args.rounds} interleaved rounds x {args.steps} steps"
           + (f" after {args.warmup} untimed" if args.warmup else ""), table,
           dict(rounds=args.rounds, steps=args.steps, warmup=args.warmup, np=args.np, model=model,
                vs_plain=vs_plain, vs_horovod=vs_horovod, compile_s=compile_s),
           "benchmarks.bench_keras_overhead", argv)


if __name__ == "__main__":
    main()
