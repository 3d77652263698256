"""What the framework-neutral techniques need from torch: the gradients of a step (``p.grad``),
the parameters and the wrapped optimizer's per-parameter state (read at the moment of use,
so a ``load_state_dict`` of the optimizer is always seen). The arithmetic: ops.py."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch

from hvdsync.torch.comm import payload_bytes

_AS_IT_IS = nullcontext()  # reusable: it does nothing


def _payload(g: Optional[torch.Tensor]) -> int:
    """:func:`hvdsync.torch.comm.payload_bytes` of a gradient (none: 0), a dense one's without
    a call (it runs per parameter every step)."""
    if g is None:
        return 0
    return payload_bytes(g) if g.is_sparse else g.numel() * g.element_size()


class TorchGradients:
    """:class:`hvdsync.core.technique.Gradients` over ``p.grad`` of the wrapped optimizer's
    parameters, layer by layer. Keys (checkpoints, technique memory) are a parameter's
    position in layer order."""

    def __init__(self, layer_params: list[list[tuple[str, torch.Tensor]]],
                 optimizer: torch.optim.Optimizer, scaler: Any = None, *,
                 base_step: Callable[[], Any]):
        self.layer_params = layer_params
        #: each parameter's detached value, made once (a detach is an op of its own):
        #: ``(li, k) -> (tensor, the parameter's data pointer when it was made)``
        self._values: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        self._optimizer = optimizer
        #: the wrapped optimizer's own ``step()`` (no exchange, no technique, no counter)
        self._base_step = base_step
        self.scaler = scaler  # a torch.amp.GradScaler: techniques see unscaled gradients
        self._inv_scale: Optional[torch.Tensor] = None
        self._key: dict[tuple[int, int], str] = {}
        self._param: dict[str, torch.Tensor] = {}
        for li, params in enumerate(layer_params):
            for k, (_, p) in enumerate(params):
                key = str(len(self._param))
                self._key[(li, k)] = key
                self._param[key] = p
        self._withheld: list[torch.Tensor] = []
        #: between="nodes": each ready layer's gradients reduced inside the node first
        #: (hvdsync.torch.nodes.NodeReduce), else None
        self.node_reduce: Optional[Callable[[list, str], None]] = None
        #: the side stream: ``True`` until made at first use, ``None``: off
        self._side: Any = True if os.environ.get("HVDSYNC_SIDE_STREAM") == "1" else None
        self._main: Any = None  # the stream the step's caller runs on, while it is in use

    def param(self, li: int, k: int) -> torch.Tensor:
        return self.layer_params[li][k][1]

    # -- where a step's work runs (CUDA: a side stream, HVDSYNC_SIDE_STREAM=1) ------------
    def working(self) -> Any:
        """A ready group's work -- clip, the statistics, the sends -- and ``synchronize()``'s:
        on CUDA with ``HVDSYNC_SIDE_STREAM=1``, on a side stream that first waits for what
        backward has queued so far, so backward's next kernels do not queue behind them (the
        collectives are started there too: Horovod and NCCL wait for the stream they are
        started on). Elsewhere as it is."""
        if self._side is None or not torch.cuda.is_available():
            return _AS_IT_IS  # (the common case: no generator on the hot path)
        return self._on_side_stream()

    @contextmanager
    def _on_side_stream(self):
        if self._side is True:  # made at first use, on the gradients' device
            self._side = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        if main == self._side:  # (inside already: synchronize() takes the last group)
            yield
            return
        self._main = main
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            yield

    def joined(self) -> None:
        """The step's work is queued: what runs next on the main stream (the optimizer's
        update) waits for it."""
        if self._main is not None:
            self._main.wait_stream(self._side)
            self._main = None

    def size(self, li: int) -> int:
        return len(self.layer_params[li])

    def get(self, li: int, k: int) -> torch.Tensor:
        return self.param(li, k).grad

    def set(self, li: int, k: int, value: torch.Tensor) -> None:
        p = self.param(li, k)
        if value is not p.grad:
            if self._main is not None and value.is_cuda:  # made on the side stream, used on
                value.record_stream(self._main)           # the main one: freed after it
            p.grad = value

    def layers(self, lis: list[int]) -> list[list[Optional[torch.Tensor]]]:
        lp = self.layer_params
        return [[p.grad for _, p in lp[li]] for li in lis]

    def write(self, items: list[tuple[int, list[int], list[torch.Tensor]]]) -> None:
        for li, ks, values in items:
            for k, value in zip(ks, values):
                self.set(li, k, value)

    def missing(self, li: int) -> list[int]:
        return [k for k, (_, p) in enumerate(self.layer_params[li]) if p.grad is None]

    def zeros(self, li: int, k: int) -> torch.Tensor:
        return torch.zeros_like(self.param(li, k))

    def value(self, li: int, k: int) -> torch.Tensor:
        p = self.param(li, k)
        held = self._values.get((li, k))
        if held is None or held[1] != p.data_ptr() or held[0].shape != p.shape \
                or held[0].dtype != p.dtype:  # (new data: ``p.data = ...``, ``.to()``)
            held = self._values[(li, k)] = (p.detach(), p.data_ptr())
        return held[0]

    def is_row_sparse(self, li: int, k: int) -> bool:
        g = self.param(li, k).grad
        return g is not None and g.is_sparse

    def payload_bytes(self, li: int) -> int:
        return sum(_payload(p.grad) for _, p in self.layer_params[li])

    def layer_bytes(self, li: int) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.layer_params[li])

    def snapshot(self, key: str) -> dict:
        p = self._param[key]
        state = self._optimizer.state.get(p)
        return {"value": p.detach().clone(),
                "state": copy.deepcopy(state) if state is not None else None}

    def restore(self, key: str, snap: dict) -> None:
        p = self._param[key]
        with torch.no_grad():
            p.copy_(snap["value"])
        if snap["state"] is None:
            self._optimizer.state.pop(p, None)
        else:  # a copy: the optimizer updates its state in place, the snapshot stays
            self._optimizer.state[p] = copy.deepcopy(snap["state"])

    def update_only(self, grads: dict[str, torch.Tensor]) -> None:
        # torch optimizers leave a parameter without a gradient (and its state) alone
        params = [p for group in self._optimizer.param_groups for p in group["params"]]
        saved = [p.grad for p in params]
        try:
            for p in params:
                p.grad = None
            for key, grad in grads.items():
                self._param[key].grad = grad
            self._base_step()
        finally:
            for p, grad in zip(params, saved):
                p.grad = grad

    def withhold(self, li: int, k: int) -> None:
        self._withheld.append(self.param(li, k))

    def _scale(self) -> Optional[torch.Tensor]:
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        scale = getattr(self.scaler, "_scale", None)  # on the device: no host sync
        return scale if scale is not None else torch.tensor(self.scaler.get_scale())

    def ready(self, lis: list[int]) -> list[int]:
        """Undo the loss scale of the layers' gradients (GradScaler's scales are powers of
        two: exact), so clip limits, norms, scores and every memory see true gradients; with
        ``between="nodes"``, reduce them inside the node; each layer's payload bytes."""
        scale = self._scale()
        if scale is not None:
            if self._inv_scale is None:  # once per step, as GradScaler.unscale_ computes it
                self._inv_scale = scale.double().reciprocal().float()
            for li in lis:
                for _, p in self.layer_params[li]:
                    if p.grad is not None:
                        (p.grad._values() if p.grad.is_sparse else p.grad).mul_(
                            self._inv_scale.to(p.grad.device))
        if self.node_reduce is not None:
            self.node_reduce(self.layers(lis), f"{lis[0]}+{len(lis)}")
        lp = self.layer_params
        return [sum(_payload(p.grad) for _, p in lp[li]) for li in lis]

    def before_optimizer_step(self, ok: bool) -> None:
        # No gradient: the wrapped optimizer leaves the parameter and its state alone.
        for p in self._withheld:
            p.grad = None
        self._withheld.clear()
        self._inv_scale = None

    def kept_nonfinite(self) -> None:
        """``delay=`` sent zeros for this rank's non-finite local gradients (the step is not
        skipped, so the loss scaler's own check never sees it): back off now."""
        scaler = self.scaler
        if scaler is not None and scaler.is_enabled():
            scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())

    def hand_over(self, ok: bool) -> None:
        """Leave ``p.grad`` as the user's next move expects: NaN everywhere after a step
        skipped on every rank (so every rank, and its loss scaler, sees it); else scaled
        again by the loss scaler's current scale, for ``scaler.unscale_(optimizer)`` -- unless
        the scaler applies them unscaled itself (``keeps_gradients_unscaled``: Keras')."""
        keeps = getattr(self.scaler, "keeps_gradients_unscaled", False)
        scale = None if not ok or keeps else self._scale()
        if ok and scale is None:
            return  # the common case: nothing to do
        grads = [p.grad for layer in self.layer_params for _, p in layer if p.grad is not None]
        values = [g._values() if g.is_sparse else g for g in grads]
        if not ok:
            for v in values:
                v.fill_(float("nan"))
        elif values:
            torch._foreach_mul_(values, scale.to(values[0].device))

    def after_optimizer_step(self) -> None:
        pass

    def replica_tensors(self, li: int, with_state: bool) -> list[torch.Tensor]:
        out = []
        for k, (_, p) in enumerate(self.layer_params[li]):
            out.append(self.value(li, k))  # (p.data: a detach each call)
            if with_state:
                out += [v for _, v in sorted(self._optimizer.state.get(p, {}).items())
                        if torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape]
        return out

    def key(self, li: int, k: int) -> str:
        return self._key[(li, k)]

    def param_keys(self, li: int) -> list[str]:
        return [self._key[(li, k)] for k in range(len(self.layer_params[li]))]

    def name(self, li: int, k: int) -> str:
        return self.layer_params[li][k][0]

    def to_saved(self, key: str, x: Any) -> Any:
        return _map_tensors(x, lambda t: t.detach().clone())

    def from_saved(self, key: str, x: Any) -> Any:
        if key not in self._param:
            raise ValueError(f"saved hvdsync state refers to parameter #{key}, which this "
                             "optimizer does not have")
        device = self._param[key].device
        # tensors shaped like data go where the parameter is; scalars (Adam's step) stay
        return _map_tensors(x, lambda t: t.to(device).clone() if t.dim() else t.clone())


def _map_tensors(x: Any, fn) -> Any:
    if torch.is_tensor(x):
        return fn(x)
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(v, fn) for v in x)
    return copy.deepcopy(x)
