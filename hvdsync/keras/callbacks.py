"""Keras callbacks for distributed training with hvdsync (Horovod's meanings, on Keras 3).

Horovod's own ``horovod.tensorflow.keras.callbacks`` crash on Keras 3; these do the same jobs
with ``horovod.tensorflow`` ops, plus :class:`SyncStatsCallback`, which puts hvdsync's
per-step communication statistics into Keras' ``logs`` (progress bar, History, TensorBoard).
"""

from __future__ import annotations

import warnings
from typing import Optional

import keras
import numpy as np

from hvdsync.keras import collectives
from hvdsync.safety.watchdog import guard


def _hvdsync_optimizer(model):
    """The model's optimizer, or the one a LossScaleOptimizer wraps (mixed precision)."""
    opt = getattr(model, "optimizer", None)
    return getattr(opt, "inner_optimizer", opt)


def _broadcast(variables: list, root_rank: int, prefix: str, process_set) -> None:
    """``variables`` set to ``root_rank``'s values: one broadcast per dtype of all of them
    flattened -- an eager collective waits for a negotiation cycle of its own, so one per
    variable took a 30-layer MLP's model and optimizer 0.33-0.46 s
    (benchmarks/results/keras_lab_notes.md). Shapes
    the ranks disagree on fail in Horovod (a different total) or in the optimizer's agreement
    check at its build (hvdsync.keras.optimizer), as before."""
    process_set = collectives.global_set() if process_set is None else process_set
    if process_set.size() == 1 or not variables:
        return
    ops = keras.ops
    values = [ops.convert_to_tensor(v.value) for v in variables]
    by_dtype: dict[str, list[int]] = {}
    for i, x in enumerate(values):
        by_dtype.setdefault(keras.backend.standardize_dtype(x.dtype), []).append(i)
    for dtype in sorted(by_dtype):  # (the same order on every rank)
        at = by_dtype[dtype]
        flat = collectives.broadcast(ops.concatenate([ops.reshape(values[i], [-1]) for i in at]),
                                     root_rank, f"{prefix}.{dtype}", process_set)
        ends = np.cumsum([int(np.prod(values[i].shape)) for i in at])
        for i, start, end in zip(at, [0, *ends[:-1]], ends):
            variables[i].assign(ops.reshape(flat[int(start):int(end)], values[i].shape))


def broadcast_variables(variables: list, root_rank: int = 0,
                        process_set=None) -> None:
    """Set ``variables`` (Keras or TensorFlow variables) on every rank to their values on
    ``root_rank`` (eager; call on every rank)."""
    _broadcast(list(variables), root_rank, "hvdsync.broadcast", process_set)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from ``root_rank``'s model and optimizer state.

    When training begins, the optimizer is built first if the model is (Keras otherwise
    builds it while tracing the train function, and TensorFlow traces a function that created
    variables a second time: with hvdsync's wrapper around it, this halves the first step's
    tracing time); then the model's variables and the optimizer's are broadcast (a resumed
    optimizer's state, or the zeros of a new one). A model that is not built yet builds at
    the first step with its optimizer, which starts from identical zeros on every rank.
    """

    def __init__(self, root_rank: int = 0, process_set=None):
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        _broadcast(list(self.model.variables), self.root_rank, "hvdsync.bcast.model",
                   self.process_set)
        opt = getattr(self.model, "optimizer", None)
        # the model and every layer in it built (the list includes the model itself)
        if opt is not None and not opt.built and all(
                layer.built for layer in self.model._flatten_layers()):
            opt.build(self.model.trainable_variables)  # as Keras' own _symbolic_build does
        if opt is not None and opt.built:
            _broadcast(list(opt.variables), self.root_rank, "hvdsync.bcast.opt", self.process_set)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics over ranks at the end of every epoch (Horovod's meaning), so
    History, checkpoints and early stopping see the same numbers on every rank.

    The ranks first share which metrics they have (a rank validating alone, or a metric only
    one rank logs, would otherwise make the averaging collective differ between ranks): the
    metrics every rank has are averaged, the others are left as they are, with a warning."""

    def __init__(self, process_set=None):
        super().__init__()
        self.process_set = process_set
        self._warned = False

    def on_epoch_end(self, epoch, logs=None):
        if self.process_set is None:
            self.process_set = collectives.global_set()
        if self.process_set.size() == 1:
            return
        logs = logs if logs is not None else {}
        mine = sorted(k for k, v in logs.items() if np.isscalar(v) or np.ndim(v) == 0)
        everyone = collectives.gather_json(mine, f"hvdsync.metrics.keys.{epoch}",
                                           self.process_set)
        keys = [k for k in mine if all(k in other for other in everyone)]
        partial = sorted({k for other in everyone for k in other} - set(keys))
        if partial and not self._warned:
            self._warned = True
            warnings.warn(f"hvdsync MetricAverageCallback: {partial} are not logged on every "
                          "rank, so they are not averaged", RuntimeWarning, stacklevel=2)
        if not keys:
            return
        with guard("the metric averaging of MetricAverageCallback"):
            avg = collectives.average([float(logs[k]) for k in keys],
                                      f"hvdsync.metrics.{epoch}", self.process_set)
        for k, v in zip(keys, avg):
            logs[k] = float(v)


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over
    ``warmup_epochs`` (Goyal et al.; Horovod's callback of the same name), adjusting every
    batch. ``initial_lr`` is the target rate (usually scaled by the number of ranks).

    Args:
        initial_lr: the learning rate reached at the end of the warmup.
        warmup_epochs: epochs of warmup.
        momentum_correction: scale an SGD momentum by ``new_lr / old_lr`` on changes (as
            Horovod does) for the batch where the rate changes.
        steps_per_epoch: batches per epoch (taken from ``fit``'s ``steps`` when omitted).
        verbose: print the rate at the end of the warmup.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0, process_set=None):
        super().__init__()
        if not initial_lr > 0:
            raise ValueError(f"initial_lr must be > 0, got {initial_lr}")
        if not warmup_epochs > 0:
            raise ValueError(f"warmup_epochs must be > 0, got {warmup_epochs}")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.size = (collectives.global_set() if process_set is None else process_set).size()
        self.current_epoch = 0
        self._restore_momentum: Optional[float] = None

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps")
        if not self.steps_per_epoch:
            raise ValueError("LearningRateWarmupCallback needs steps_per_epoch (fit could not "
                             "tell the number of batches per epoch)")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def lr_at(self, epoch: float) -> float:
        """The warmup rate at fractional ``epoch``."""
        if epoch >= self.warmup_epochs:
            return self.initial_lr
        return self.initial_lr / self.size * (epoch * (self.size - 1) / self.warmup_epochs + 1)

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch + batch / self.steps_per_epoch
        if self.current_epoch > self.warmup_epochs:
            return
        opt = self.model.optimizer
        old = float(keras.ops.convert_to_numpy(opt.learning_rate))
        new = self.lr_at(epoch)
        if new == old:
            return
        opt.learning_rate = new
        momentum = getattr(opt, "momentum", None)
        if self.momentum_correction and isinstance(momentum, float) and momentum and old > 0:
            self._restore_momentum = momentum
            opt.momentum = momentum * new / old
        if self.verbose and epoch + 1 / self.steps_per_epoch >= self.warmup_epochs \
                and epoch < self.warmup_epochs:
            print(f"\nEpoch {self.current_epoch + 1}: finished the learning rate warmup "
                  f"to {new:g}.")

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            self.model.optimizer.momentum = self._restore_momentum
            self._restore_momentum = None


class SyncStatsCallback(keras.callbacks.Callback):
    """Put hvdsync's communication statistics into Keras' ``logs``.

    Per batch (progress bar, TensorBoard with ``update_freq="batch"``): ``hvd_kib`` (KiB this
    rank sent in the last step), ``hvd_sent`` / ``hvd_skipped`` (layers), ``hvd_clipped``.
    Per epoch (History, TensorBoard): the same as per-step means over the epoch, plus
    ``hvd_dense_ratio`` (bytes sent / what plain Horovod would have sent) and
    ``hvd_collectives``. ``verbose=1`` prints ``optimizer.stats.summary()`` after training
    (on rank 0 only, with ``rank=hvd.rank()``).
    """

    def __init__(self, verbose: int = 0, rank: int = 0):
        super().__init__()
        self.verbose = verbose
        self.rank = rank
        self._epoch_start = None

    def _stats(self):
        opt = _hvdsync_optimizer(self.model)
        try:
            return opt.stats
        except AttributeError:
            return None

    def on_epoch_begin(self, epoch, logs=None):
        s = self._stats()
        self._epoch_start = _totals(s) if s is not None else None

    def on_train_batch_end(self, batch, logs=None):
        s = self._stats()
        if s is None or logs is None:
            return
        last = s.last
        logs["hvd_kib"] = last.bytes_sent / 1024
        logs["hvd_sent"] = last.layers_sent
        logs["hvd_skipped"] = last.layers_skipped
        if "clipped" in s.total.counters:
            logs["hvd_clipped"] = last.counters.get("clipped", 0)

    def on_epoch_end(self, epoch, logs=None):
        s = self._stats()
        if s is None or logs is None:
            return
        now = _totals(s)
        start = self._epoch_start or {k: 0 for k in now}
        d = {k: now[k] - start[k] for k in now}
        steps = max(d["steps"], 1)
        logs["hvd_kib"] = d["bytes_sent"] / 1024 / steps
        logs["hvd_dense_ratio"] = d["bytes_sent"] / d["bytes_dense"] if d["bytes_dense"] else 0.0
        logs["hvd_collectives"] = d["collectives"] / steps
        logs["hvd_sent"] = d["layers_sent"] / steps
        logs["hvd_skipped"] = d["layers_skipped"] / steps
        if "clipped" in s.total.counters:
            logs["hvd_clipped"] = d["clipped"] / steps

    def on_train_end(self, logs=None):
        s = self._stats()
        if self.verbose and s is not None and self.rank == 0:
            print(s.summary())


def _totals(s) -> dict:
    t = s.total
    return {"steps": t.step, "bytes_sent": t.bytes_sent, "bytes_dense": t.bytes_dense,
            "collectives": t.collectives, "layers_sent": t.layers_sent,
            "layers_skipped": t.layers_skipped, "clipped": t.counters.get("clipped", 0)}


class FlushCallback(keras.callbacks.Callback):
    """With ``delay=`` or ``threshold=``: make the replicas identical (``optimizer.flush()``)
    at the end of every epoch's training batches -- before ``fit``'s validation, whichever
    ranks validate -- and at the end of training.

    ``flush()`` is a collective, so it runs only where every rank is: after the epoch's last
    batch (every rank trains the same number of batches) and at the end of ``fit``. When the
    number of batches per epoch is unknown, it runs when ``fit``'s validation begins (then
    validate on every rank). An ``evaluate()`` outside ``fit`` does not flush: call
    ``optimizer.flush()`` on every rank before it."""

    def __init__(self):
        super().__init__()
        self._steps = None
        self._in_fit = False

    def _flush(self):
        opt = _hvdsync_optimizer(self.model)
        if opt is not None and hasattr(opt, "flush") and opt.built:
            opt.flush()

    def on_train_begin(self, logs=None):
        self._in_fit = True
        self._steps = self.params.get("steps") if self.params else None

    def on_train_batch_end(self, batch, logs=None):
        if self._steps and batch + 1 == self._steps:
            self._flush()

    def on_test_begin(self, logs=None):
        if self._in_fit and not self._steps:
            self._flush()

    def on_train_end(self, logs=None):
        self._in_fit = False
        self._flush()
