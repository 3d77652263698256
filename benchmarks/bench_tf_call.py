"""What a compiled Keras step pays per call for what its train function holds, apart from the
work it does: the fixed cost behind the deciders' loopback overhead at a small step
(docs/keras.md, "A decider's fixed cost per step").

    python -m benchmarks.bench_tf_call

One process, one core, one TensorFlow thread per pool. Three parts:

* a ``tf.function`` that writes ``n`` variables in a branch it never takes: each variable is
  captured, so every call passes its handle in (the call's time against ``n``);
* ``n`` branches never taken, ~22 nodes each (what skipping a lowered branch costs);
* bench_keras' MLP (``--width``, 256 by default; Adam) compiled three ways -- hvdsync's plain path,
  ``threshold=0`` and ``select`` with every layer -- and each train function's captured
  inputs and nodes (its graph and the functions it calls).

Results: ``benchmarks/results/tf_call.{json,md}`` (or ``--name``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.common import markdown_table, report, shows_progress
from hvdsync.testing import progress

CAPTURES = (0, 16, 64, 128)
BRANCHES = (0, 6, 12, 24)


def _us_per_call(fns: dict, calls: int, repeats: int) -> dict:
    """Per key, the median over ``repeats`` interleaved rounds of the mean microseconds a
    call of its function takes (after 200 untimed calls: tracing, the first executions)."""
    runs: dict = {key: [] for key in fns}
    for fn in fns.values():
        for _ in range(200):
            fn()
    for r in range(repeats):
        progress.step(r, repeats, f"round {r + 1}/{repeats} of {len(fns)} cases")
        for key, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            runs[key].append((time.perf_counter() - start) / calls * 1e6)
    return {key: statistics.median(r) for key, r in runs.items()}


def _captured(n: int):
    import tensorflow as tf
    flag, out = tf.Variable(False), tf.Variable(tf.zeros([4]))
    held = [tf.Variable(tf.zeros([4])) for _ in range(n)]

    def write():
        for v in held:
            v.assign_add(tf.ones([4]))
        return tf.constant(0.0)

    @tf.function
    def step():
        tf.cond(flag, write, lambda: tf.constant(0.0))
        out.assign_add(tf.ones([4]))
    return step


def _branches(n: int):
    import tensorflow as tf
    flag, out = tf.Variable(False), tf.Variable(tf.zeros([4]))
    held = [tf.Variable(tf.zeros([4])) for _ in range(n)]

    @tf.function
    def step():
        for v in held:
            def work(v=v):
                x = v.read_value()
                for _ in range(10):
                    x = x * 2.0 + 1.0
                v.assign(x)
                return tf.constant(0.0)
            tf.cond(flag, work, lambda: tf.constant(0.0))
        out.assign_add(tf.ones([4]))
    return step


def _compiled(train_function):
    """The ``tf.function`` behind Keras' ``train_function`` (a Python function that calls it,
    or the function itself)."""
    cells = [c.cell_contents for c in getattr(train_function, "__closure__", None) or ()]
    for f in [train_function, *cells]:
        # (a private listing: the only one TensorFlow offers of a function's traces)
        if hasattr(f, "_list_all_concrete_functions"):
            return f
    raise RuntimeError("hvdsync bench: no tf.function found behind Keras' train_function")


def _train_functions(width: int) -> list[list]:
    """Per way of compiling: the train function's captured inputs and nodes."""
    import keras
    import numpy as np

    import hvdsync.keras as hvd
    from benchmarks.bench_keras import CLASSES, FEATURES, mlp
    hvd.init()
    x = np.random.default_rng(0).standard_normal((256, FEATURES)).astype("float32")
    y = np.random.default_rng(1).integers(0, CLASSES, 256)
    rows = []
    for name, options in [("hvdsync (plain path)", {}), ("threshold=0", dict(threshold=0.0)),
                          ("select (every layer)", dict(select=dict(k=1.0)))]:
        model = mlp(width, 6)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3), **options),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=128, verbose=0)
        for fn in _compiled(model.train_function)._list_all_concrete_functions():
            graph = fn.graph.as_graph_def()
            nodes = len(graph.node) + sum(len(f.node_def) for f in graph.library.function)
            rows.append([name, len(fn.captured_inputs), nodes])
    return rows


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500, help="timed calls per repeat")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--name", default="tf_call")
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {0})
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    captured = _us_per_call({n: _captured(n) for n in CAPTURES}, args.calls, args.repeats)
    branches = _us_per_call({n: _branches(n) for n in BRANCHES}, args.calls, args.repeats)
    functions = _train_functions(args.width)
    table = "\n\n".join([
        markdown_table(["variables captured (written in a branch never taken)", "us a call",
                        "us more than none"],
                       [[n, f"{t:.1f}", f"{t - captured[0]:.1f}"] for n, t in captured.items()]),
        markdown_table(["branches never taken (~22 nodes each)", "us a call",
                        "us more than none"],
                       [[n, f"{t:.1f}", f"{t - branches[0]:.1f}"] for n, t in branches.items()]),
        markdown_table([f"train function (MLP width {args.width}, Adam)", "captured inputs",
                        "nodes"], functions)])
    report(args.name, "What a compiled step pays per call (one process, one core)", table,
           dict(captured_us=captured, branches_us=branches, train_functions=functions),
           "benchmarks.bench_tf_call", argv)


if __name__ == "__main__":
    main()
