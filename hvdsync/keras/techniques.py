"""What the techniques of the eager exchange share: the layout of one step's gradients and
the optimizer's per-variable state (slots) that must move with a variable.

The techniques that keep memory between steps or decide per step (threshold, select, sparse,
delay) run eagerly inside ``tf.py_function`` in the compiled train function: their state is
plain Python (like the torch adapter's) and their collectives are eager Horovod ops with
explicit names. Each one implements :class:`EagerTechnique`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf


@dataclass
class StepLayout:
    """One traced step: ``variables`` in the order of the gradients, and per layer (index into
    the optimizer's layers, fixed order) the positions of its gradients in that list."""

    variables: list
    layers: list[tuple[int, list[int]]]
    names: list[str]  # layer names, all layers

    def key(self, pos: int) -> str:
        return self.variables[pos].path


class EagerTechnique:
    """Interface of an eager-path technique (subclasses override what they need)."""

    #: whether ``before_apply`` needs the variables' values (read before the update)
    needs_values = False
    #: whether it takes ``IndexedSlices`` gradients (the others need ``sparse_as_dense``)
    accepts_sparse = False

    def before_apply(self, layout: StepLayout, grads: list, values: list) -> list:
        """This step's gradients (``None`` entries never occur) -> what the optimizer applies."""
        raise NotImplementedError

    def after_apply(self, layout: StepLayout) -> None:
        """After the wrapped optimizer's update of this step."""

    def state_dict(self, ids: dict[str, str]) -> dict:
        """Saveable state; memory of a variable is keyed by ``ids[variable path]`` (its position
        in the model: paths carry auto-numbered model names that change between processes)."""
        return {}

    def load_state_dict(self, state: dict, paths: dict[str, str]) -> None:
        """Inverse of :meth:`state_dict`; ``paths`` maps a saved id back to a variable path."""

    def forget(self) -> None:
        """Drop memory that refers to the model as it was (before a checkpoint restore)."""


class Slots:
    """The wrapped optimizer's variables that belong to each model variable (momentum, Adam
    moments, ...), found by the name Keras gives them (``<variable path>_<slot>``)."""

    def __init__(self, optimizer_variables: list, model_variables: list):
        prefixes = sorted(((v.path.replace("/", "_") + "_", v.path) for v in model_variables),
                          key=lambda x: -len(x[0]))
        self.of: dict[str, list] = {v.path: [] for v in model_variables}
        shapes = {v.path: tuple(v.shape) for v in model_variables}
        for s in optimizer_variables:
            if s.name.endswith("gradient_accumulator"):
                continue
            for prefix, path in prefixes:  # longest prefix first
                if s.name.startswith(prefix) and tuple(s.shape) == shapes[path]:
                    self.of[path].append(s)
                    break

    def snapshot(self, path: str) -> list[tf.Tensor]:
        return [tf.identity(s.value) for s in self.of[path]]

    def restore(self, path: str, values: list[tf.Tensor]) -> None:
        for s, v in zip(self.of[path], values):
            s.assign(v)


def to_numpy(x) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def saved_path(saved_id: str, paths: dict[str, str], what: str) -> str:
    if saved_id not in paths:
        raise ValueError(f"saved hvdsync {what} refers to variable #{saved_id}, which this model "
                         "does not have")
    return paths[saved_id]
