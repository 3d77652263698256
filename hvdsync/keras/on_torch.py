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
from keras.optimizers import LossScaleOptimizer

import hvdsync.torch as hvd_torch
from hvdsync.core import rules
from hvdsync.core.api import SyncAPI
from hvdsync.core.config import non_negative_float
from hvdsync.keras.params import (groups_to_names, keras_layer_of, mixed_in,
                                  relative_names, slots_of)
from hvdsync.keras.state import SavedState
from hvdsync.core.layers import Layer, build_layers
from hvdsync.core.stats import SyncStats
from hvdsync.core.topology import check_between
from hvdsync.torch.optimizer import checked_arguments
from hvdsync.torch.saving import tensors_only

if TYPE_CHECKING:  # (typing.Unpack is Python 3.11's)
    from typing_extensions import Unpack

    from hvdsync.techniques import TechniqueKeywords

_NO_COMPILE = ("hvdsync.keras.DistributedOptimizer starts its collectives from backward hooks "
               "and between the train step's ops, which torch.compile cannot keep in order: "
               "pass jit_compile=False to model.compile()")
_NO_SCALED_PASSES = ("backward_passes_per_step > 1 with a LossScaleOptimizer (mixed_float16) is "
                     "not supported on Keras' torch backend: use a larger batch, or the "
                     "TensorFlow backend")
_HOROVOD_ARGS = ("name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
                 "gradient_predivide_factor", "op", "backward_passes_per_step",
                 "average_aggregated_gradients", "num_groups", "groups", "process_set",
                 "scale_local_gradients", "group_mb", "between")


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


class KerasLossScale:
    """Keras' ``LossScaleOptimizer`` (``mixed_float16``) as the ``torch.amp.GradScaler`` that
    hvdsync.torch's ``scaler=`` takes: each layer's gradient is unscaled as backward makes it,
    so every technique sees true gradients; the exchanged gradients stay unscaled (the
    ``LossScaleOptimizer`` hands them to the optimizer it wraps, which applies ``p.grad``).
    Its scales are powers of two, so unscaling is exact (docs/mixed_precision.md)."""

    keeps_gradients_unscaled = True

    def __init__(self, lso: LossScaleOptimizer):
        self._lso = lso

    def is_enabled(self) -> bool:
        return True

    @property
    def _scale(self) -> torch.Tensor:  # (read where it lives: no host sync)
        return self._lso.dynamic_scale.value

    def get_scale(self) -> float:
        return float(self._lso.dynamic_scale.numpy())

    def get_backoff_factor(self) -> float:
        return 0.5  # (the LossScaleOptimizer halves its scale on an overflow)

    def update(self, new_scale: float) -> None:
        """Back off after this rank's overflow that delay= replaced by zeros."""
        self._lso.dynamic_scale.assign(new_scale)
        self._lso.step_counter.assign(0)

    def unscale_(self, optimizer: Any) -> None:
        raise RuntimeError("Keras' LossScaleOptimizer unscales the gradients itself")


def _callers(depth: int = 4) -> list:
    """``self`` of the callers of the caller, nearest first (Keras' model in ``fit``, or the
    ``LossScaleOptimizer`` that builds the optimizer it wraps)."""
    frame, found = sys._getframe(2), []
    while frame is not None and len(found) < depth:
        found.append(frame.f_locals.get("self"))
        frame = frame.f_back
    return found


class _Hvdsync:
    """The wrapper's own state, in one plain object (Keras would track lists set on an
    optimizer and adopt the variables they hold)."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)
        self.torch: Any = None  # hvdsync.torch's optimizer, once built
        self.pending_state: Optional[dict] = None  # loaded before the optimizer was built
        self.process_set = self.options["process_set"]  # (hvd.save_model reads it, built or not)
        self.passes = self.options["backward_passes_per_step"]
        self.summed: Optional[list] = None  # backward_passes_per_step: the window's gradients


class _DistributedOptimizer(SavedState, SyncAPI):
    """Mixed in front of the wrapped Keras optimizer's class on the torch backend."""

    _hv: _Hvdsync

    def build(self, variables: list) -> None:
        callers = _callers()  # Keras' _symbolic_build in fit, a LossScaleOptimizer's build
        if any(isinstance(c, keras.Model) and c.jit_compile is True for c in callers):
            raise RuntimeError(_NO_COMPILE)
        lso = next((c for c in callers if isinstance(c, LossScaleOptimizer)
                    and c.inner_optimizer is self), None)
        super().build(variables)
        if self._hv.torch is None:
            self._hvdsync_build(list(variables), lso)
        elif lso is not None:  # built before the LossScaleOptimizer wrapped it
            self._hv.torch._grads.scaler = self._shared_by(lso)

    def _shared_by(self, lso: LossScaleOptimizer) -> KerasLossScale:
        """Make ``lso``'s finite check this step's exchange and its shared verdict: every rank
        then skips, or applies, together, and the scales stay equal."""
        if self._hv.passes > 1:
            raise NotImplementedError(_NO_SCALED_PASSES)
        lso.check_finite = lambda grads: self._exchange(grads, finish=False)
        return KerasLossScale(lso)

    def _hvdsync_build(self, variables: list, lso: Optional[LossScaleOptimizer] = None) -> None:
        hv = self._hv
        layers = build_layers([v.path for v in variables], hv.grouping)
        # stats and collective names without the model's auto-numbered name ("sequential_1/"),
        # which can differ between ranks that built other models first
        names = relative_names([layer.name for layer in layers])
        layer_of = {p: n for n, layer in zip(names, layers) for p in layer.param_names}
        update = KerasUpdate(variables, super().apply, slots_of(self.variables, variables))
        hv.torch = hvd_torch.DistributedOptimizer(
            update, named_parameters=[(v.path, v.value) for v in variables],
            layers=layer_of.__getitem__, scaler=None if lso is None else self._shared_by(lso),
            **hv.options)
        # what hvd.save_model reads of a built optimizer, as on the TensorFlow backend (every
        # rank's communicator: two-level techniques run on the cross-node ones)
        hv.comm, hv.stats = hv.torch._everyone, hv.torch.stats
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
        if hv.passes > 1 and self._accumulating(grads, variables):
            return
        if not hv.torch._synchronized:  # (a LossScaleOptimizer's check has exchanged them)
            self._exchange(grads, variables)
        with hv.torch.skip_synchronize():
            hv.torch.step()

    def scale_loss(self, loss: Any) -> Any:
        """Keras' loss scaling, and, with ``backward_passes_per_step`` > 1, the gradients summed
        so far in this window put back (``fit``'s train step calls this between clearing the
        gradients and backward, which then adds into them)."""
        hv = self._hv
        if hv.summed is not None:
            for v, g in zip(self._trainable_variables, hv.summed):
                v.value.grad = g
            hv.summed = None
        if hv.average_passes and hv.passes > 1:
            loss = loss / hv.passes
        return super().scale_loss(loss)

    def _accumulating(self, grads: list, variables: list) -> bool:
        """``backward_passes_per_step``: whether this batch is not its window's last; then
        its gradients are kept, summed, for the next backward, and the batch is counted."""
        hv = self._hv
        if hv.summed is not None:
            raise RuntimeError(
                "backward_passes_per_step > 1 on Keras' torch backend needs "
                "loss = optimizer.scale_loss(loss) before loss.backward() in a custom train "
                "step (fit's does it): that puts back the gradients summed so far")
        if not hv.torch._backward_seen():
            self._hand_over(grads, variables)
        if not any(hv.torch._passes_left):
            return False  # the window's last: exchange and update
        hv.summed = [v.value.grad for v in self._trainable_variables]
        self.iterations.assign_add(1)  # (as Keras counts an accumulated batch)
        return True

    def _hand_over(self, grads: list, variables: Optional[list]) -> None:
        """Backward ran before the hooks existed, or the gradients were made another way: hand
        them over as the hooks would have."""
        hv = self._hv
        for g, v in zip(grads, variables or self._trainable_variables):
            v.value.grad = g
        for i, p in enumerate(hv.torch._hooked):
            hv.torch._on_grad(i, p)

    def _exchange(self, grads: list, variables: Optional[list] = None,
                  finish: bool = True) -> bool:
        """This step's exchange; whether every rank's gradients were finite. Without
        ``finish`` a step not finite is ended here, as no update follows it."""
        hv = self._hv
        if not hv.torch._backward_seen():
            self._hand_over(grads, variables)
        hv.torch.synchronize()
        ok = hv.torch._pipeline.step_ok
        if not ok and not finish:
            with hv.torch.skip_synchronize():
                hv.torch.step()  # (skipped on every rank: this resets the verdict)
        return ok

    # -- Horovod Elastic (hvdsync.keras.elastic): hvdsync.torch's optimizer does each --------
    def _agree(self) -> None:
        """Check that every rank built this optimizer alike (raises ``RanksDisagree``)."""
        self._hv.torch._agree()

    def _leave_world(self) -> None:
        """Horovod is about to start again: finish or drop what is in flight; the next step,
        and its window of ``backward_passes_per_step``, start clean."""
        if self._hv.torch is not None:
            self._hv.torch._leave_world()
        self._hv.summed = None

    def _join_world(self) -> None:
        """Horovod runs again, perhaps with other ranks: read them anew."""
        if self._hv.torch is not None:
            self._hv.torch._join_world()

    def take_shared_state(self, root_rank: int = 0) -> None:
        """Every rank takes ``root_rank``'s shared technique state and drops its own memory
        (hvdsync.torch's ``broadcast_technique_state``). A collective."""
        if self._hv.torch is not None:
            hvd_torch.broadcast_technique_state(self._hv.torch, root_rank)

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
                         device_dense: str = "", device_sparse: str = "",
                         compression: Any = None, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = None,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: Any = None,
                         scale_local_gradients: bool = True,
                         group_mb: Optional[float] = None,
                         between: Optional[str] = None,
                         **keywords: Unpack[TechniqueKeywords],
                         ) -> keras.optimizers.Optimizer:
    """:func:`hvdsync.keras.DistributedOptimizer` on the torch backend: the same arguments,
    run by hvdsync.torch's engine and step pipeline; and hvdsync.torch's ``group_mb`` (the
    size of a ready group) and ``between`` (``"nodes"``: the techniques between nodes only,
    docs/nodes.md), as :func:`hvdsync.torch.DistributedOptimizer` takes them."""
    horovod = dict(name=name, device_dense=device_dense, device_sparse=device_sparse,
                   compression=compression, sparse_as_dense=sparse_as_dense,
                   gradient_predivide_factor=gradient_predivide_factor, op=op,
                   backward_passes_per_step=backward_passes_per_step,
                   average_aggregated_gradients=average_aggregated_gradients,
                   num_groups=num_groups, groups=groups, process_set=process_set,
                   scale_local_gradients=scale_local_gradients, group_mb=group_mb,
                   between=between)
    if isinstance(optimizer, LossScaleOptimizer):  # wrap what it wraps; it decides for all
        if backward_passes_per_step != 1:
            raise NotImplementedError(_NO_SCALED_PASSES)
        return LossScaleOptimizer(DistributedOptimizer(optimizer.inner_optimizer, **horovod,
                                                       **keywords),
                                  initial_scale=optimizer.initial_scale,
                                  dynamic_growth_steps=optimizer.dynamic_growth_steps,
                                  name=optimizer.name)
    _check_wrappable(optimizer, device_dense or device_sparse, scale_local_gradients)
    between = check_between(between)
    layers, techniques = rules.given(keywords, _HOROVOD_ARGS, "DistributedOptimizer")
    compression, op, process_set, configs, groups = checked_arguments(
        compression, op, process_set, backward_passes_per_step, gradient_predivide_factor,
        sparse_as_dense, num_groups, groups, layers, techniques)
    grouping = layers if layers is not None else (
        groups_to_names(groups) if groups is not None else keras_layer_of)
    wrapped = mixed_in(optimizer, _DistributedOptimizer, name)
    object.__setattr__(wrapped, "_hv", _Hvdsync(
        grouping=grouping, average_passes=bool(average_aggregated_gradients),
        options=dict(compression=compression, op=op, sparse_as_dense=sparse_as_dense,
                     gradient_predivide_factor=gradient_predivide_factor,
                     backward_passes_per_step=backward_passes_per_step,
                     group_mb=None if group_mb is None else non_negative_float("group_mb",
                                                                               group_mb),
                     process_set=process_set, between=between, **configs)))
    if optimizer.built:
        wrapped._hvdsync_build(list(optimizer._trainable_variables))
    return wrapped


def _check_wrappable(optimizer: Any, device: Any, scale_local_gradients: Any) -> None:
    """A clear error for what :func:`DistributedOptimizer` cannot wrap."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a keras.optimizers.Optimizer (Keras 3), got "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already wrapped by hvdsync.keras.DistributedOptimizer")
    if optimizer.gradient_accumulation_steps:
        raise ValueError("the optimizer has gradient_accumulation_steps set; use "
                         "backward_passes_per_step instead (the accumulation must happen "
                         "before the exchange)")
    if device:
        raise ValueError("device_dense/device_sparse are Horovod's TensorFlow placement; on "
                         "the torch backend the gradients stay where the parameters are")
    if scale_local_gradients is not True:
        raise ValueError("scale_local_gradients=False is not supported by hvdsync.keras")
