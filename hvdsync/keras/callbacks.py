"""Keras callbacks for distributed training with hvdsync (Horovod's meanings, on Keras 3).

Horovod's own ``horovod.tensorflow.keras.callbacks`` crash on Keras 3; these do the same jobs
with ``horovod.tensorflow`` ops, plus :class:`SyncStatsCallback`, which puts hvdsync's
per-step communication statistics into Keras' ``logs`` (progress bar, History, TensorBoard).
"""

from __future__ import annotations

from typing import Optional

import keras
import numpy as np
import tensorflow as tf
from horovod.tensorflow import mpi_ops
from horovod.tensorflow.mpi_ops import Average, global_process_set


def _broadcast(variables: list, root_rank: int, prefix: str, process_set) -> None:
    if process_set.size() == 1:
        return
    for i, v in enumerate(variables):
        v.assign(mpi_ops.broadcast(tf.convert_to_tensor(v.value), root_rank,
                                   name=f"{prefix}.{i}", process_set=process_set))


def broadcast_variables(variables: list, root_rank: int = 0,
                        process_set=global_process_set) -> None:
    """Set ``variables`` (Keras or TensorFlow variables) on every rank to their values on
    ``root_rank`` (eager; call on every rank)."""
    _broadcast(list(variables), root_rank, "hvdsync.broadcast", process_set)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from ``root_rank``'s model (and optimizer state, if it has any yet).

    The model's variables are broadcast when training begins; an optimizer that is already
    built (resumed training) has its variables broadcast too. One that builds at the first step
    starts from identical zeros on every rank anyway.
    """

    def __init__(self, root_rank: int = 0, process_set=global_process_set):
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
        if opt is not None and opt.built:
            _broadcast(list(opt.variables), self.root_rank, "hvdsync.bcast.opt", self.process_set)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics over ranks at the end of every epoch (Horovod's meaning), so
    History, checkpoints and early stopping see the same numbers on every rank."""

    def __init__(self, process_set=global_process_set):
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch, logs=None):
        if not logs or self.process_set.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if np.isscalar(v) or np.ndim(v) == 0)
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        avg = mpi_ops._allreduce(values, name=f"hvdsync.metrics.{epoch}", op=Average,
                                 process_set=self.process_set).numpy()
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
                 verbose: int = 0, process_set=global_process_set):
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
        self.size = process_set.size()
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
        opt = getattr(self.model, "optimizer", None)
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
    """With ``delay=``: make the replicas identical (``optimizer.flush()``) before every
    evaluation (``fit``'s validation included) and at the end of training."""

    def _flush(self):
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and hasattr(opt, "flush") and opt.built:
            opt.flush()

    def on_test_begin(self, logs=None):
        self._flush()

    def on_train_end(self, logs=None):
        self._flush()
