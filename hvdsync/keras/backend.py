"""What the framework-neutral techniques need from Keras: one step's gradients (the list the
optimizer is about to apply, inside the eager step), the variables and the wrapped
optimizer's per-variable slots (momentum, Adam moments); the arithmetic is ops.py.

Keras applies every gradient of a step in one call, so a parameter withheld from the update
(``select=``) is updated with a zero gradient and then put back -- variable and slots --
right after the update. The optimizer's ``iterations`` counter (Adam's bias correction) is
global and advances every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from hvdsync.keras.comm import payload_bytes
from hvdsync.keras.params import slots_of


class Slots:
    """The wrapped optimizer's variables that belong to each model variable (momentum, Adam
    moments, ...), found by the name Keras gives them (``<variable path>_<slot>``)."""

    def __init__(self, optimizer_variables: list, model_variables: list):
        self.of = slots_of(optimizer_variables, model_variables)

    def snapshot(self, path: str) -> list[tf.Tensor]:
        return [tf.identity(s.value) for s in self.of[path]]

    def restore(self, path: str, values: list) -> None:
        for s, v in zip(self.of[path], values):
            s.assign(v)


class KerasGradients:
    """:class:`hvdsync.core.technique.Gradients` over one step's gradient list. Layer ``li``'s
    parameters are its variables present in the step (Keras drops variables without a
    gradient); keys are a variable's position among the optimizer's variables."""

    def __init__(self, layer_vars: list[list], slots: Slots,
                 update: Optional[Callable[[list, list], None]] = None):
        self.layer_vars = layer_vars
        self.slots = slots
        #: the wrapped optimizer's own update of ``(grads, variables)``, not counted as a step
        self._update = update
        self._key = {v.path: str(i) for i, v in enumerate(v for vs in layer_vars for v in vs)}
        self._by_key = {str(i): v for i, v in enumerate(v for vs in layer_vars for v in vs)}
        self._pos_of: dict[str, int] = {}
        self._layer_of = {v.path: li for li, vs in enumerate(layer_vars) for v in vs}
        self.variables: list = []
        self.grads: list = []
        self.values: Optional[list] = None
        self._positions: list[list[int]] = [[] for _ in layer_vars]
        self._restore: list[tuple[Any, str, tf.Tensor, list]] = []

    def begin_step(self, variables: list, grads: list, values: Optional[list] = None) -> None:
        """A new step: ``grads`` of ``variables`` and, if the compiled function read them
        (techniques that ``reads_values``), the variables' values before the update."""
        self.variables, self.grads = list(variables), list(grads)
        self.values = values
        self._positions = [[] for _ in self.layer_vars]
        for li, positions in self.layer_positions(self.variables):
            self._positions[li] = positions
        self._pos_of = {v.path: pos for pos, v in enumerate(self.variables)}

    def key_of(self, variable) -> str:
        """The key of a model variable (:meth:`key` by variable)."""
        return self._key[variable.path]

    def layer_positions(self, variables: list) -> list[tuple[int, list[int]]]:
        """Per layer present in ``variables`` (layer order), the positions of its variables."""
        out: dict[int, list[int]] = {}
        for pos, v in enumerate(variables):
            out.setdefault(self._layer_of[v.path], []).append(pos)
        return sorted(out.items())

    def _var(self, li: int, k: int):
        return self.variables[self._positions[li][k]]

    def size(self, li: int) -> int:
        return len(self._positions[li])

    def get(self, li: int, k: int):
        return self.grads[self._positions[li][k]]

    def set(self, li: int, k: int, value) -> None:
        self.grads[self._positions[li][k]] = value

    def layers(self, lis: list[int]) -> list[list]:
        grads, positions = self.grads, self._positions
        return [[grads[p] for p in positions[li]] for li in lis]

    def write(self, items: list[tuple[int, list[int], list]]) -> None:
        for li, ks, values in items:
            for k, value in zip(ks, values):
                self.grads[self._positions[li][k]] = value

    def missing(self, li: int) -> list[int]:
        return []

    def zeros(self, li: int, k: int):
        return tf.zeros_like(self._var(li, k).value)

    def value(self, li: int, k: int):
        if self.values:  # read by the compiled function before the update
            return self.values[self._positions[li][k]]
        # read inside the eager step, which the update waits for: the value before it
        return tf.identity(self._var(li, k).value)

    def is_row_sparse(self, li: int, k: int) -> bool:
        return isinstance(self.get(li, k), tf.IndexedSlices)

    def payload_bytes(self, li: int) -> int:
        return sum(payload_bytes(self.grads[p]) for p in self._positions[li])

    @staticmethod
    def working():
        return contextlib.nullcontext()

    def joined(self) -> None:
        pass

    def layer_bytes(self, li: int) -> int:
        return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in self.layer_vars[li])

    def snapshot(self, key: str) -> dict:
        v = self._by_key[key]
        pos = self._pos_of.get(v.path)
        value = (self.values[pos] if self.values and pos is not None
                 else tf.identity(v.value))  # as it is before this step's update
        return {"value": value, "state": self.slots.snapshot(v.path)}

    def restore(self, key: str, snap: dict) -> None:
        v = self._by_key[key]
        v.assign(snap["value"])
        self.slots.restore(v.path, snap["state"])

    def update_only(self, grads: dict[str, Any]) -> None:
        self._update(list(grads.values()), [self._by_key[key] for key in grads])

    def withhold(self, li: int, k: int) -> None:
        v = self._var(li, k)
        self._restore.append((v, v.path, self.value(li, k), self.slots.snapshot(v.path)))
        self.set(li, k, tf.zeros_like(self.get(li, k)))

    @staticmethod
    def kept_nonfinite() -> None:
        """Nothing: Keras' LossScaleOptimizer judges the step by its own finite check."""

    def ready(self, lis: list[int]) -> list[int]:
        """Each layer's payload bytes (Keras' LossScaleOptimizer unscales the gradients
        itself)."""
        return [self.payload_bytes(li) for li in lis]
    def before_optimizer_step(self, ok: bool) -> None:
        pass  # a skipped step: the compiled function does not apply (see graph.eager_step)

    def after_optimizer_step(self) -> None:
        """Put withheld variables (and their slots) back as they were before the update."""
        for v, path, value, slots in self._restore:
            v.assign(value)
            self.slots.restore(path, slots)
        self._restore = []
        self.values, self._pos_of = None, {}  # outside a step, read the variables themselves

    def replica_tensors(self, li: int, with_state: bool) -> list:
        out = []
        for v in self.layer_vars[li]:
            out += [v] + (self.slots.of[v.path] if with_state else [])
        return out

    def key(self, li: int, k: int) -> str:
        return self._key[self._var(li, k).path]

    def param_keys(self, li: int) -> list[str]:
        return [self._key[v.path] for v in self.layer_vars[li]]

    def name(self, li: int, k: int) -> str:
        return self._var(li, k).path

    def to_saved(self, key: str, x: Any) -> Any:
        return _walk(x, lambda t: t.numpy() if hasattr(t, "numpy") else np.asarray(t))

    def from_saved(self, key: str, x: Any) -> Any:
        if key not in self._by_key:
            raise ValueError(f"saved hvdsync state refers to variable #{key}, which this model "
                             "does not have")
        return _walk(x, tf.constant)


def _walk(x: Any, fn) -> Any:
    if isinstance(x, dict):
        return {k: _walk(v, fn) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_walk(v, fn) for v in x]
    if x is None or isinstance(x, (int, float, str, bool)):
        return x
    return fn(x)
