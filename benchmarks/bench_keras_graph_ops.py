"""Ops in Keras' compiled train step, by op type, per technique setting (one rank): a
restructuring of the traced step that builds the same graph gives the same counts.

    python -m benchmarks.bench_keras_graph_ops before.json      (on one checkout)
    python -m benchmarks.bench_keras_graph_ops after.json --compare before.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hvdsync.keras as hvd  # noqa: E402
from benchmarks.common import shows_progress  # noqa: E402
from hvdsync.testing import progress  # noqa: E402

CASES = {"plain": {}, "clip_local": dict(clip=1.0),
         "clip_global": dict(clip=dict(max_norm=1.0, mode="global")),
         "threshold": dict(threshold=0.3), "select": dict(select=dict(k=1)),
         "lowrank": dict(lowrank=2), "sparse": dict(sparse=dict(dense_ratio=0.55)),
         "sparse_threshold": dict(sparse=True, threshold=0.3), "delay": dict(delay=2),
         "delay_lowrank": dict(delay=2, lowrank=2),
         "threshold_lowrank": dict(threshold=0.3, lowrank=2)}


def model_and_data(embedding: bool):
    keras.utils.set_random_seed(0)
    if embedding:
        inp = keras.Input((4,), dtype="int32")
        h = keras.layers.Flatten()(keras.layers.Embedding(50, 8)(inp))
        h = keras.layers.Dense(16, activation="relu")(h)
        return (keras.Model(inp, keras.layers.Dense(10)(h)),
                np.random.randint(0, 50, (64, 4)).astype("int32"))
    return (keras.Sequential([keras.Input((16,))]
                             + [keras.layers.Dense(32, activation="relu") for _ in range(4)]
                             + [keras.layers.Dense(10)]),
            np.random.rand(64, 16).astype("float32"))


def tf_functions(fn, depth: int = 0) -> list:
    """The tf.functions behind Keras' train function (it wraps them in closures)."""
    if hasattr(fn, "_list_all_concrete_functions_for_serialization"):
        return [fn]
    found = []
    for cell in (getattr(fn, "__closure__", None) or []) if depth < 4 else []:
        try:
            found += tf_functions(cell.cell_contents, depth + 1)
        except ValueError:  # an empty cell
            pass
    return found


def count(name: str, keywords: dict) -> dict[str, int]:
    """Ops by type in every graph (and nested function) of one fitted setting."""
    model, x = model_and_data(name.startswith("sparse"))
    y = np.random.randint(0, 10, 64)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), **keywords),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    counts: collections.Counter = collections.Counter()

    def walk(graph) -> None:
        for op in graph.get_operations():
            counts[op.type] += 1
        for f in graph._functions.values():
            if hasattr(f, "graph"):
                walk(f.graph)
    for f in tf_functions(model.train_function):
        for concrete in f._list_all_concrete_functions_for_serialization():
            walk(concrete.graph)
    return dict(sorted(counts.items()))


@shows_progress
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--compare", help="an earlier run's file: print each setting's counts")
    args = parser.parse_args()
    hvd.init()
    out = {}
    for i, (name, keywords) in enumerate(CASES.items()):
        progress.step(i, len(CASES), name)
        out[name] = count(name, keywords)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        print("| setting | ops before | ops after | by type |\n|---|---:|---:|---|")
        for name, ops in out.items():
            was = before.get(name, {})
            print(f"| {name} | {sum(was.values())} | {sum(ops.values())} | "
                  f"{'equal' if was == ops else 'differ'} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
