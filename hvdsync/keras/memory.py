"""Technique memory in ``tf.Variable``s, for the compiled train function: what a technique
keeps between steps per parameter (a decider's accumulations and sync points, ``lowrank=``'s
``Q`` and error feedback), readable and writable by the traced step, and a mapping with the
dict interface the technique's eager code uses (checkpoints, ``status()``, ``forget()``)."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import numpy as np
import tensorflow as tf

from hvdsync.keras.backend import KerasGradients


class VariableMemory(MutableMapping):
    """Per-parameter tensors in ``tf.Variable``s, by key (:meth:`KerasGradients.key`); a key
    is present while its layer's flag (``flags[li]``, a boolean variable) is set.

    ``empty``: per key, the tensors it holds while absent (the variables start so, and
    go back to them when emptied); ``with_slots=False``: one tensor per key, ``True``: the
    parameter and its optimizer slots, as :meth:`KerasGradients.snapshot` gives them
    (``{"value", "state"}``, not reset when emptied: a sync point is read only while present).
    The mapping methods read the flags on the host: they are for use outside the step
    (checkpoints, status); the traced step uses :meth:`read`, :meth:`present`, :meth:`write`
    and :meth:`put`."""

    def __init__(self, layer_keys: list[list[str]], empty: dict[str, list], name: str,
                 with_slots: bool = False):
        self.with_slots = with_slots
        self.layer_keys = layer_keys
        self._layer = {k: li for li, ks in enumerate(layer_keys) for k in ks}
        self._empty_values = empty
        self.flags = [tf.Variable(False, trainable=False, name=f"hvdsync_{name}_flag{li}")
                      for li in range(len(layer_keys))]
        self.store: dict[str, list[tf.Variable]] = {
            key: [tf.Variable(x, trainable=False, name=f"hvdsync_{name}") for x in empty[key]]
            for ks in layer_keys for key in ks}

    @classmethod
    def of_parameters(cls, grads: KerasGradients, with_slots: bool,
                      name: str) -> "VariableMemory":
        """Zeros like every parameter (and, ``with_slots``, its optimizer slots)."""
        empty = {grads.key_of(v): [tf.zeros(x.shape, x.dtype) for x in
                                   [v] + (grads.slots.of[v.path] if with_slots else [])]
                 for vs in grads.layer_vars for v in vs}
        return cls([[grads.key_of(v) for v in vs] for vs in grads.layer_vars], empty, name,
                   with_slots)

    @classmethod
    def of_host_values(cls, grads: KerasGradients, values: dict[str, np.ndarray],
                       name: str) -> "VariableMemory":
        """One tensor for each key of ``values`` (those of a layer share its flag), holding
        ``values[key]`` (in its parameter's dtype) while absent."""
        by_key = {grads.key_of(v): v for vs in grads.layer_vars for v in vs}
        layer_keys = [[grads.key_of(v) for v in vs if grads.key_of(v) in values]
                      for vs in grads.layer_vars]
        empty = {key: [tf.constant(values[key], by_key[key].dtype)] for key in values}
        return cls(layer_keys, empty, name)

    # -- in the traced step ---------------------------------------------------------------
    def read(self, key: str) -> Any:
        """The key's value (its empty value while absent; with slots, a snapshot)."""
        return self._as_held([x.read_value() for x in self.store[key]])

    def present(self, key: str) -> tf.Tensor:
        """Whether the key holds something, a device boolean."""
        return self.flags[self._layer[key]].read_value()

    def write(self, key: str, value: tf.Tensor, when: tf.Tensor) -> None:
        """Where the device boolean ``when`` holds (or always: ``True``): ``value`` for a
        one-tensor key, which is present afterwards (keys of one layer are written
        together)."""
        x, flag = self.store[key][0], self.flags[self._layer[key]]
        if when is True:  # no select
            x.assign(tf.cast(value, x.dtype))
            flag.assign(True)
            return
        x.assign(tf.where(when, tf.cast(value, x.dtype), x))
        flag.assign(tf.logical_or(flag, when))

    def put(self, key: str, value: Any, present: tf.Tensor) -> None:
        """The key holds ``value`` where the device boolean ``present`` holds and nothing
        elsewhere: a one-tensor key then holds its empty value; with slots the tensors take
        ``value`` either way (unread while absent: no select, no second read). Keys of one
        layer are put together: its flag is assigned with its first key."""
        if self.with_slots:
            for x, v in zip(self.store[key], self._as_list(value)):
                x.assign(tf.cast(v, x.dtype))
        else:
            for x, v, e in zip(self.store[key], self._as_list(value), self._empty_values[key]):
                x.assign(tf.where(present, tf.cast(v, x.dtype), e))
        li = self._layer[key]
        if key == self.layer_keys[li][0]:
            self.flags[li].assign(present)

    def _as_held(self, values: list) -> Any:
        return {"value": values[0], "state": values[1:]} if self.with_slots else values[0]

    def _as_list(self, value: Any) -> list:
        return [value["value"], *value["state"]] if self.with_slots else [value]

    # -- the mapping, on the host -----------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        if key not in self._layer or not bool(self.flags[self._layer[key]].numpy()):
            raise KeyError(key)
        return self._as_held([tf.identity(x) for x in self.store[key]])

    def __setitem__(self, key: str, value: Any) -> None:
        for x, v in zip(self.store[key], self._as_list(value)):
            x.assign(v)
        self.flags[self._layer[key]].assign(True)

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        self._empty(self._layer[key])

    def _empty(self, li: int) -> None:
        self.flags[li].assign(False)
        if not self.with_slots:  # the compiled step reads a key without looking at its flag
            for key in self.layer_keys[li]:
                for x, e in zip(self.store[key], self._empty_values[key]):
                    x.assign(e)

    def __iter__(self) -> Iterator[str]:
        return iter([k for li, ks in enumerate(self.layer_keys)
                     if bool(self.flags[li].numpy()) for k in ks])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def clear(self) -> None:
        for li in range(len(self.layer_keys)):
            self._empty(li)
