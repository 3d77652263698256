"""``hvdsync.keras`` on Keras' torch backend (``KERAS_BACKEND=torch``): no Horovod build, no
TensorFlow.

There Keras trains torch parameters (each variable's ``value``) with torch autograd, so the
torch adapter serves it whole: its per-parameter hooks see each layer's gradient as ``fit``'s
``loss.backward()`` makes it, and its step pipeline runs the techniques and starts the sends
while backward goes on, on torch.distributed (``torchrun``) or Horovod (``horovodrun``). This
module only maps Keras onto it: the variables as parameters named by their paths and grouped by
Keras layer, the optimizer's slot variables as its per-parameter state, and the optimizer's
``apply`` as the wrapped optimizer's ``step()`` (docs/keras.md, "Which backend").
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, Optional

import keras
import torch

import hvdsync.torch as hvd_torch
from hvdsync import rules
from hvdsync.api import SyncAPI
from hvdsync.keras.params import (groups_to_names, keras_layer_of, mixed_in, relative_names,
                                  slots_of)
from hvdsync.keras.state import SavedState
from hvdsync.layers import Layer, build_layers
from hvdsync.stats import SyncStats
from hvdsync.torch.optimizer import checked_arguments
from hvdsync.torch.saving import tensors_only

if TYPE_CHECKING:  # (typing.Unpack is Python 3.11's)
    from typing_extensions import Unpack

_NO_COMPILE = ("hvdsync.keras.DistributedOptimizer starts its collectives from backward hooks "
               "and between the train step's ops, which torch.compile cannot keep in order: "
               "pass jit_compile=False to model.compile()")
_HOROVOD_ARGS = ("name", "compression", "sparse_as_dense", "gradient_predivide_factor", "op",
                 "backward_passes_per_step", "num_groups", "groups", "process_set")


class SlotState(MutableMapping):
    """The Keras optimizer's slot variables (momentum, Adam's moments, ...) as a torch
    optimizer's ``state``: parameter -> ``{"slot00": tensor, ...}``. Writes go into the
    variables, so what hvdsync restores or averages is what Keras updates with next; a
    parameter's state removed is its slots zeroed, as a new Keras optimizer has them."""

    def __init__(self, slots: dict[torch.Tensor, list]):
        self._slots = {p: s for p, s in slots.items() if s}

    def __getitem__(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f"slot{i:02d}": s.value for i, s in enumerate(self._slots[p])}

    def __setitem__(self, p: torch.Tensor, state: dict) -> None:
        with torch.no_grad():
            for s, (_, v) in zip(self._slots[p], sorted(state.items())):
                s.value.copy_(v)

    def __delitem__(self, p: torch.Tensor) -> None:
        with torch.no_grad():
            for s in self._slots[p]:
                s.value.zero_()

    def __iter__(self):
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)


class KerasUpdate(torch.optim.Optimizer):
    """A Keras optimizer's update as a torch optimizer over the variables' tensors: ``step()``
    applies the ``grad`` of each variable that has one through the Keras optimizer's own
    ``apply`` (its learning-rate schedule, weight decay and clipping included)."""

    def __init__(self, variables: list, apply: Any, slots: dict[str, list]):
        super().__init__([v.value for v in variables], {})
        self._variables = variables
        self._apply = apply
        self.state = SlotState({v.value: slots[v.path] for v in variables})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        present = [v for v in self._variables if v.value.grad is not None]
        if present:
            self._apply([v.value.grad for v in present], present)


class _Hvdsync:
    """The wrapper's own state, in one plain object (Keras would track lists set on an
    optimizer and adopt the variables they hold)."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)
        self.torch: Any = None  # hvdsync.torch's optimizer, once built
        self.pending_state: Optional[dict] = None  # loaded before the optimizer was built
        self.process_set = self.options["process_set"]  # (hvd.save_model reads it, built or not)


class _DistributedOptimizer(SavedState, SyncAPI):
    """Mixed in front of the wrapped Keras optimizer's class on the torch backend."""

    _hv: _Hvdsync

    def build(self, variables: list) -> None:
        model = sys._getframe(1).f_locals.get("self")  # Keras' _symbolic_build, in fit?
        if getattr(model, "jit_compile", False) is True:
            raise RuntimeError(_NO_COMPILE)
        super().build(variables)
        self._hvdsync_build(list(variables))

    def _hvdsync_build(self, variables: list) -> None:
        hv = self._hv
        layers = build_layers([v.path for v in variables], hv.grouping)
        # stats and collective names without the model's auto-numbered name ("sequential_1/"),
        # which can differ between ranks that built other models first
        names = relative_names([layer.name for layer in layers])
        layer_of = {p: n for n, layer in zip(names, layers) for p in layer.param_names}
        update = KerasUpdate(variables, super().apply, slots_of(self.variables, variables))
        hv.torch = hvd_torch.DistributedOptimizer(
            update, named_parameters=[(v.path, v.value) for v in variables],
            layers=layer_of.__getitem__, **hv.options)
        # what hvd.save_model reads of a built optimizer, as on the TensorFlow backend
        hv.comm, hv.stats = hv.torch._comm, hv.torch.stats
        if hv.pending_state is not None:  # loaded before the optimizer was built
            state, hv.pending_state = hv.pending_state, None
            self._load_state(state)

    def apply(self, grads: list, trainable_variables: Optional[list] = None) -> None:
        """Exchange this step's gradients as the configured techniques say, then update (the
        step ``fit``'s train step makes after ``loss.backward()``)."""
        if torch.compiler.is_compiling():
            raise RuntimeError(_NO_COMPILE)
        hv = self._hv
        variables = list(trainable_variables if trainable_variables is not None
                         else self._trainable_variables)
        if not self.built:
            self.build(variables)
        if not hv.torch._backward_seen():
            # backward ran before the hooks existed, or the gradients were made another way:
            # hand them over as the hooks would have
            for g, v in zip(grads, variables):
                v.value.grad = g
            for i, p in enumerate(hv.torch._hooked):
                hv.torch._on_grad(i, p)
        hv.torch.step()

    # -- hvdsync's state in Keras' own saving (docs/checkpoints.md) ---------------------------
    def technique_state(self) -> dict:
        """hvdsync's checkpoint entry for this optimizer: what ``model.save()`` stores beside
        the optimizer's variables."""
        return self._hv.torch._technique_state()

    def _load_state(self, state: dict) -> None:
        self._hv.torch._restore_techniques(tensors_only(state))

    def flush(self) -> int:
        iterations = self.iterations.numpy()  # flush's update is not a training step
        dropped = super().flush()
        self.iterations.assign(iterations)
        return dropped

    def _sync_pipeline(self) -> Any:
        return None if self._hv.torch is None else self._hv.torch._pipeline

    def _sync_included(self) -> bool:
        return self._hv.torch is not None and self._hv.torch.process_set.included()

    @property
    def stats(self) -> SyncStats:
        """Communication statistics (:class:`hvdsync.SyncStats`); available once built."""
        if self._hv.torch is None:
            raise AttributeError("stats exist once the optimizer is built (after the first "
                                 "training step or optimizer.build(model.trainable_variables))")
        return self._hv.torch.stats

    @property
    def layers(self) -> list[Layer]:
        """The layers in send order, as :class:`hvdsync.Layer` objects (once built)."""
        return [] if self._hv.torch is None else self._hv.torch.layers


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: Optional[str] = None,
                         compression: Any = None, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = None,
                         backward_passes_per_step: int = 1, num_groups: int = 0,
                         groups: Any = None, process_set: Any = None,
                         **keywords: Unpack[rules.TechniqueKeywords],
                         ) -> keras.optimizers.Optimizer:
    """:func:`hvdsync.keras.DistributedOptimizer` on the torch backend: the same arguments,
    run by hvdsync.torch's engine and step pipeline."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a keras.optimizers.Optimizer (Keras 3), got "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already wrapped by hvdsync.keras.DistributedOptimizer")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise NotImplementedError(
            "hvdsync.keras on the torch backend does not take a LossScaleOptimizer yet: use "
            "the TensorFlow backend for mixed_float16, or hvdsync.torch with torch.autocast "
            "and scaler= (docs/mixed_precision.md)")
    if backward_passes_per_step != 1 or optimizer.gradient_accumulation_steps:
        raise NotImplementedError(
            "backward_passes_per_step > 1 is not supported on Keras' torch backend yet (Keras "
            "clears the gradients every train step): use a larger batch, or the TensorFlow "
            "backend")
    layers, techniques = rules.given(keywords, _HOROVOD_ARGS, "DistributedOptimizer")
    compression, op, process_set, configs, groups = checked_arguments(
        compression, op, process_set, backward_passes_per_step, gradient_predivide_factor,
        sparse_as_dense, num_groups, groups, layers, techniques)
    grouping = layers if layers is not None else (
        groups_to_names(groups) if groups is not None else keras_layer_of)
    wrapped = mixed_in(optimizer, _DistributedOptimizer, name)
    object.__setattr__(wrapped, "_hv", _Hvdsync(grouping=grouping, options=dict(
        compression=compression, op=op, gradient_predivide_factor=gradient_predivide_factor,
        sparse_as_dense=sparse_as_dense, process_set=process_set, **configs)))
    if optimizer.built:
        wrapped._hvdsync_build(list(optimizer._trainable_variables))
    return wrapped
