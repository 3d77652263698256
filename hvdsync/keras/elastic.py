"""Horovod Elastic for Keras 3 with hvdsync's optimizer: ``model.fit`` goes on when ranks are
lost or added. The names and recipe are Horovod's (``horovod.tensorflow.keras.elastic``:
``run``, ``KerasState``, ``CommitStateCallback``, ``UpdateBatchStateCallback``,
``UpdateEpochStateCallback``), whose ``KerasState`` does not run on Keras 3. What hvdsync's
version adds: :class:`KerasState` carries the model, its optimizer and the optimizer's
technique state (``commit()`` keeps this rank's own memory too; ``sync()``, after every reset
on every rank, checks every rank is set up alike, then gives every rank rank 0's weights,
optimizer variables and shared technique state, and drops traced functions, which hold the
rank count they were traced for); :func:`run` finishes or drops what the optimizers have in
flight before Horovod restarts, syncs after every reset (horovod#3494) and reads a failed
Horovod op as a lost rank; a commit is taken when the next batch or epoch begins, so the
callbacks' order does not matter. On either backend under horovodrun (on the torch one, over
Horovod's torch ops). docs/elastic.md has the recipe.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import keras
from horovod.common.elastic import ObjectState

from hvdsync.safety import elastic as _core
from hvdsync.keras.callbacks import broadcast_variables
from hvdsync.keras.collectives import _on_torch

if _on_torch():  # Horovod's torch ops, which hvdsync.torch's engine runs on under horovodrun
    from horovod.torch.functions import broadcast_object
    from horovod.torch.mpi_ops import init as _init
    from horovod.torch.mpi_ops import rank as _rank
    from horovod.torch.mpi_ops import shutdown as _shutdown

    from hvdsync.keras.on_torch import _DistributedOptimizer

    def _copy(value: Any) -> Any:
        return value.detach().clone()

    def _lost_rank(e: BaseException) -> bool:
        """(Horovod's torch ops raise its own ``HorovodInternalError``: the core reads it.)"""
        return False
else:
    import tensorflow as tf
    from horovod.tensorflow.functions import broadcast_object
    from horovod.tensorflow.mpi_ops import init as _init
    from horovod.tensorflow.mpi_ops import rank as _rank
    from horovod.tensorflow.mpi_ops import shutdown as _shutdown

    from hvdsync.keras.optimizer import _DistributedOptimizer

    _copy = tf.identity

    def _lost_rank(e: BaseException) -> bool:
        """A Horovod op failed inside TensorFlow (a peer gone, or Horovod shut down after it):
        TensorFlow raises its own error type, naming the op or Horovod."""
        return isinstance(e, tf.errors.OpError) and "Horovod" in str(e.message)


def _hvdsync_of(optimizer: Any) -> Any:
    """hvdsync's optimizer in ``optimizer`` (itself, or what a LossScaleOptimizer wraps), or
    ``None``."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return inner if isinstance(inner, _DistributedOptimizer) else None


class _Carried:
    """One model and its optimizer as :class:`KerasState` carries them."""

    def __init__(self, model: keras.Model, optimizer: Any, name: str):
        if not model.built:
            raise ValueError(f"KerasState: the model {name!r} must be built first (call it on "
                             "a batch, or model.build(input_shape))")
        if optimizer is None:
            raise ValueError(f"KerasState: the model {name!r} has no optimizer: compile it, "
                             "or pass optimizer=")
        if not optimizer.built:  # its variables exist from now on: commit can copy them
            optimizer.build(model.trainable_variables)
        self.model, self.optimizer, self.name = model, optimizer, name
        self.hvdsync = _hvdsync_of(optimizer)
        self.saved: tuple = ()

    def save(self) -> None:
        technique = (copy.deepcopy(self.hvdsync.technique_state())
                     if self.hvdsync is not None and self.hvdsync._configured else None)
        self.saved = ([_copy(v.value) for v in self.model.variables],
                      [_copy(v.value) for v in self.optimizer.variables], technique)

    def restore(self) -> None:
        weights, optimizer_variables, technique = self.saved
        for v, value in zip(self.model.variables, weights):
            v.assign(value)
        for v, value in zip(self.optimizer.variables, optimizer_variables):
            v.assign(value)
        if technique is not None:
            self.hvdsync._load_state(technique)

    def sync(self) -> None:
        opt = self.hvdsync
        if opt is not None:
            opt._join_world()
            if opt._sync_included():
                opt._agree()
        broadcast_variables(self.model.variables)
        broadcast_variables(self.optimizer.variables)
        if opt is not None:
            opt.take_shared_state(0)
        # traced again at the next call: a traced step holds the rank count it was traced for
        self.model.train_function = None
        self.model.test_function = None
        self.model.predict_function = None


class KerasState(ObjectState):
    """Horovod's ``KerasState`` for Keras 3: ``model`` and its optimizer (``optimizer``, or
    the one it was compiled with), and any other keyword argument -- a Keras model is
    carried with its own optimizer as ``model`` is (several models trained side by side);
    anything else is a value Horovod broadcasts from rank 0 (``epoch=0, batch=0``), set as an
    attribute. ``commit()`` saves all of it, ``restore()`` goes back to the last commit,
    ``sync()`` makes every rank hold rank 0's (module docstring)."""

    def __init__(self, model: keras.Model, optimizer: Any = None, **kwargs: Any):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        models = {k: v for k, v in kwargs.items() if isinstance(v, keras.Model)}
        self._carried = [_Carried(model, self.optimizer, "model")] + [
            _Carried(m, getattr(m, "optimizer", None), k) for k, m in models.items()]
        for k, m in models.items():
            setattr(self, k, m)
        for c in self._carried:
            c.save()
        super().__init__(bcast_object=broadcast_object, get_rank=_rank,
                         **{k: v for k, v in kwargs.items() if k not in models})

    @property
    def hvdsync_optimizers(self) -> list:
        """The hvdsync optimizers this state carries."""
        return [c.hvdsync for c in self._carried if c.hvdsync is not None]

    def save(self) -> None:
        for c in self._carried:
            c.save()
        super().save()

    def restore(self) -> None:
        for c in self._carried:
            c.restore()
        super().restore()

    def sync(self) -> None:
        for c in self._carried:
            c.sync()
            c.save()
        super().sync()


def _restart() -> None:
    _shutdown()
    _init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``elastic.run``: ``func(state, ...)`` runs again whenever the ranks change
    (:func:`hvdsync.safety.elastic.run`: it syncs after every reset, a removal included, and first
    makes the state's hvdsync optimizers finish or drop what they have in flight)."""
    if _on_torch():
        from hvdsync.torch.elastic import require_horovod
        require_horovod()
    return _core.run(func, lambda state: state.hvdsync_optimizers, _restart, _lost_rank)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of every epoch
    (Horovod's). The commit is taken when the next batch or epoch begins, or training ends:
    after every callback has updated the state for the batch just done, whatever their
    order. A commit is where added or removed hosts take effect."""

    def __init__(self, state: KerasState, batches_per_commit: int = 1):
        super().__init__()
        if not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be a positive int, got "
                             f"{batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._remaining = batches_per_commit
        self._due = False

    def on_train_begin(self, logs=None):
        self._remaining, self._due = self.batches_per_commit, False  # alike on every rank

    def on_train_batch_end(self, batch, logs=None):
        self._remaining -= 1
        if self._remaining == 0:
            self._remaining, self._due = self.batches_per_commit, True

    def on_epoch_end(self, epoch, logs=None):
        self._due = True

    def _commit_if_due(self, *_: Any, **__: Any) -> None:
        if self._due:
            self._due = False
            self.state.commit()

    on_train_batch_begin = on_epoch_begin = on_train_end = _commit_if_due


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` = the batches done in the present epoch (0 at its end). After a
    reset, the first epoch runs only the batches it still had to run (with
    ``steps_per_epoch`` known to Keras): Keras 3 reads no shortened step count, so this
    callback ends that epoch itself (``model.stop_training`` for that epoch only)."""

    def __init__(self, state: KerasState):
        super().__init__()
        self.state = state
        self._offset = 0
        self._ended_epoch = False

    def on_train_begin(self, logs=None):
        self._offset, self._ended_epoch = self.state.batch, False

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._offset + batch + 1
        steps = self.params.get("steps")
        if self._offset and steps and self.state.batch >= steps:
            self.model.stop_training = self._ended_epoch = True

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch, self._offset = 0, 0
        if self._ended_epoch:  # it ended the epoch, not the training
            self.model.stop_training = self._ended_epoch = False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` = the epochs done, across resets (Horovod's): pass
    ``epochs=total - state.epoch`` to ``fit``; Keras counts each call's epochs from 0."""

    def __init__(self, state: KerasState):
        super().__init__()
        self.state = state
        self._initial = state.epoch

    def on_train_begin(self, logs=None):
        self._initial = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._initial + epoch + 1


__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]
