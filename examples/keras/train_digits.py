"""Data-parallel Keras 3 training (``model.fit``, compiled) on scikit-learn's bundled digits.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras/train_digits.py
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras/train_digits.py --clip 1.0
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras/train_digits.py --threshold 0.6 --max-skip 8
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras/train_digits.py --select 1
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras/train_digits.py --lowrank 4
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras/train_digits.py --delay 2 --average-every 8
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras/train_digits.py --delay streaming
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras/train_digits.py --save /tmp/digits.keras

Keras' torch backend, no Horovod or TensorFlow needed (``bash scripts/setup.sh --torch-only``):

    KERAS_BACKEND=torch torchrun --nproc-per-node 2 -m examples.keras.train_digits --delay streaming

What differs from a single-process Keras script: ``import hvdsync.keras as hvd``,
``hvd.init()``, the optimizer wrapped by ``hvd.DistributedOptimizer`` and the callbacks. Each
rank trains on its own shard; rank 0 shows the progress bar (with hvdsync's per-step stats:
``hvd_kib`` sent, layers ``hvd_sent``/``hvd_skipped``), and prints the stats table at the end.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hvdsync.keras as hvd  # noqa: E402


class StepTimer(keras.callbacks.Callback):
    """The seconds ``fit``'s training batches take (not its validation)."""

    def __init__(self):
        super().__init__()
        self.seconds = 0.0
        self._start = 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.seconds += time.perf_counter() - self._start


def train(epochs: int = 8, batch_size: int = 32, lr: float = 0.05, seed: int = 0,
          clip: Optional[dict] = None, threshold: Optional[dict] = None,
          select: Optional[dict] = None, delay: Optional[dict | str] = None,
          save: Optional[str] = None, verbose: bool = True,
          lowrank: Optional[dict] = None, between: Optional[str] = None) -> dict[str, Any]:
    """Train on this rank's shard with ``model.fit``; return test accuracy, the stats and the
    time its training steps took. ``between="nodes"``: the techniques between nodes only
    (docs/nodes.md)."""
    # (Horovod registers the node's process sets at init; an empty list on one node)
    hvd.init(process_sets=hvd.node_process_sets() if between == "nodes" else None)
    keras.utils.set_random_seed(seed)
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    # Each rank trains on its own shard, the same number of batches on every rank.
    steps = len(x_train) // hvd.size() // batch_size
    x_train = x_train[hvd.rank()::hvd.size()][:steps * batch_size]
    y_train = y_train[hvd.rank()::hvd.size()][:steps * batch_size]

    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu", name="fc1"),
        keras.layers.Dense(64, activation="relu", name="fc2"),
        keras.layers.Dense(10, name="out"),
    ])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr * hvd.size(), momentum=0.9),
                                   clip=clip, threshold=threshold, select=select, delay=delay,
                                   lowrank=lowrank, between=between)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # every rank starts from rank 0's
        hvd.callbacks.LearningRateWarmupCallback(lr * hvd.size(), warmup_epochs=2),
        hvd.callbacks.SyncStatsCallback(verbose=int(verbose), rank=hvd.rank()),
        hvd.callbacks.FlushCallback(),  # with delay=: identical replicas before evaluating
        hvd.callbacks.MetricAverageCallback(),  # epoch metrics averaged over ranks
    ]
    if verbose and hvd.rank() == 0:
        print(f"training on {hvd.size()} ranks, {len(x_train)} samples per rank", flush=True)
    timer = StepTimer()
    history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs,
                        validation_data=(x_test, y_test), callbacks=callbacks + [timer],
                        verbose=2 if verbose and hvd.rank() == 0 else 0)
    test = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
    if save and hvd.rank() == 0:
        model.save(save)  # reload with hvd.load_model(save, <same options>)
    if verbose and hvd.rank() == 0:
        print(f"test accuracy {test['accuracy']:.4f} (loss {test['loss']:.4f})")
    return dict(accuracy=test["accuracy"], loss=test["loss"], history=history.history,
                stats=opt.stats.as_dict(), seconds=timer.seconds, steps=steps * epochs)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05, help="per-rank rate (scaled by ranks)")
    p.add_argument("--clip", type=float, help="per-layer gradient norm limit (clip=)")
    p.add_argument("--threshold", type=float, help="accumulation threshold (threshold=)")
    p.add_argument("--max-skip", type=int, help="with --threshold: most steps a layer skips")
    p.add_argument("--select", type=int, help="layers pushed per step (select=)")
    p.add_argument("--lowrank", type=int, help="rank of the weight matrices' factors (lowrank=)")
    p.add_argument("--delay", metavar="STALENESS|diloco|streaming",
                   help="staleness of the global gradient, or a local-steps preset (delay=)")
    p.add_argument("--average-every", type=int, default=8, help="with --delay: K")
    p.add_argument("--save", help="save the trained model (.keras) here")
    p.add_argument("--between", choices=["nodes"], default=None,
                   help="nodes: the techniques between nodes only, synchronous inside each")
    a = p.parse_args(argv)
    train(epochs=a.epochs, batch_size=a.batch_size, lr=a.lr,
          clip=dict(max_norm=a.clip) if a.clip else None,
          threshold=(dict(threshold=a.threshold, max_skip=a.max_skip)
                     if a.threshold is not None else None),
          select=dict(k=a.select) if a.select else None,
          delay=(None if a.delay is None else a.delay if a.delay in ("diloco", "streaming")
                 else dict(staleness=int(a.delay), average_every=a.average_every)),
          save=a.save, lowrank=dict(rank=a.lowrank) if a.lowrank else None,
          between=a.between)


if __name__ == "__main__":
    main()
