"""What the framework-neutral techniques need from torch: the gradients of a step (``p.grad``),
the parameters and the wrapped optimizer's per-parameter state (read at the moment of use,
so a ``load_state_dict`` of the optimizer is always seen), and tensor arithmetic."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch

from hvdsync.torch.comm import payload_bytes
from hvdsync.torch.foreach import (decode_average, decoded, encode, in_layer_order, layer_dots,
                                   layer_norms, nonfinite_flag, norm_of, unflatten)


_AS_IT_IS = nullcontext()  # reusable: it does nothing


class TorchOps:
    """:class:`hvdsync.technique.TensorOps` on torch tensors (in place where allowed)."""

    @staticmethod
    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    @staticmethod
    def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b

    @staticmethod
    def bad(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        flag = nonfinite_flag(tensors)
        return torch.zeros(()) if flag is None else flag

    @staticmethod
    def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
        flag = nonfinite_flag(tensors)
        return flag is None or not flag.item()  # one device read

    @staticmethod
    def zero_if(flag: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        mask = flag.to(torch.bool)
        return [t.masked_fill_(mask, 0.0) for t in tensors]  # on the device: no host sync

    @staticmethod
    def accumulate(acc: torch.Tensor, x: torch.Tensor, sign: int = 1) -> torch.Tensor:
        return acc.add_(x) if sign > 0 else acc.sub_(x)

    @staticmethod
    def clone(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    @staticmethod
    def clone_all(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        tensors = [t.detach() if t.requires_grad else t for t in tensors]
        return list(torch._foreach_mul(tensors, 1.0)) if tensors else []  # (one op: copies)

    @staticmethod
    def accumulate_all(accs: Sequence[torch.Tensor], xs: Sequence[torch.Tensor],
                       sign: int = 1) -> list[torch.Tensor]:
        accs = list(accs)
        if accs:
            (torch._foreach_add_ if sign > 0 else torch._foreach_sub_)(accs, list(xs))
        return accs

    @staticmethod
    def norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return norm_of(tensors)

    @staticmethod
    def dot(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return layer_dots([list(pairs)]).reshape(())  # (one layer of a group's form)

    @staticmethod
    def norms(layers: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        return layer_norms(layers)

    @staticmethod
    def dots(layers: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor:
        return layer_dots(layers)

    @staticmethod
    def in_layer_order(n: int, parts: Sequence[tuple[Sequence[int], torch.Tensor]]
                       ) -> torch.Tensor:
        return in_layer_order(n, parts)

    @staticmethod
    def concat(parts: Sequence[torch.Tensor], dtype: str = "float32") -> torch.Tensor:
        device = parts[0].device
        flat = torch.cat([p.reshape(-1).to(device) if p.dim() != 1 else p.to(device)
                          for p in parts]) if len(parts) > 1 else parts[0].reshape(-1)
        return flat.to(getattr(torch, dtype))

    @staticmethod
    def read(vectors: Sequence[torch.Tensor]) -> list[list[float]]:
        if not vectors:
            return []
        if len(vectors) == 1:  # (no op but the read)
            return [_flatten(vectors[0].tolist())]
        device = vectors[0].device
        values = torch.cat([v.reshape(-1).float().to(device) for v in vectors]).tolist()
        out, i = [], 0
        for v in vectors:
            out.append(values[i:i + v.numel()])
            i += v.numel()
        return out

    @staticmethod
    def zero() -> torch.Tensor:
        return torch.zeros(())

    @staticmethod
    def to_host(scalars: Sequence[Any]) -> list[float]:
        if not scalars:
            return []
        ts = [s if torch.is_tensor(s) else torch.tensor(float(s)) for s in scalars]
        device = ts[0].device
        # one device read: everything on the first scalar's device, stacked
        return torch.stack([t.detach().float().reshape(()).to(device) for t in ts]).tolist()

    @staticmethod
    def nbytes(t: torch.Tensor) -> int:
        return payload_bytes(t)

    # -- low-rank factors (lowrank=): a tensor as a matrix of its first dimension by the rest
    @staticmethod
    def matrix_shape(t: torch.Tensor) -> Optional[tuple[int, int]]:
        return (t.shape[0], t.numel() // t.shape[0]) if t.dim() >= 2 and t.numel() else None

    @staticmethod
    def matrix(t: torch.Tensor) -> torch.Tensor:
        return t if t.dim() == 2 else t.reshape(t.shape[0], -1)  # (a view is an op too)

    @staticmethod
    def from_matrix(m: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return m if m.shape == like.shape else m.reshape(like.shape)

    @staticmethod
    def matmul(a: torch.Tensor, b: torch.Tensor, transpose_a: bool = False,
               transpose_b: bool = False) -> torch.Tensor:
        return (a.T if transpose_a else a) @ (b.T if transpose_b else b)

    @staticmethod
    def matmul_all(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
                   transpose_a: bool = False, transpose_b: bool = False) -> list[torch.Tensor]:
        a, b = list(a), list(b)
        if len({(x.dtype, x.device) for x in a + b}) > 1:
            return [TorchOps.matmul(x, y, transpose_a, transpose_b) for x, y in zip(a, b)]
        if not (transpose_a or transpose_b):
            return list(torch._foreach_mm(a, b))  # (one op; the same bits as one mm each)
        # a transpose is a view (an op) per matrix: matrices of a shape go as one batched
        # product instead (the same bits as one mm each)
        out: list = [None] * len(a)
        alike: dict[tuple, list[int]] = {}
        for i, (x, y) in enumerate(zip(a, b)):
            alike.setdefault((tuple(x.shape), tuple(y.shape)), []).append(i)
        for idx in alike.values():
            if len(idx) == 1:
                i = idx[0]
                out[i] = TorchOps.matmul(a[i], b[i], transpose_a, transpose_b)
                continue
            x, y = torch.stack([a[i] for i in idx]), torch.stack([b[i] for i in idx])
            for i, z in zip(idx, torch.bmm(x.mT if transpose_a else x,
                                           y.mT if transpose_b else y).unbind()):
                out[i] = z
        return out

    @staticmethod
    def orthonormal_all(ps: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`orthonormal` of each, matrices of a shape together (one batched QR: the
        same bits as one at a time)."""
        out: list = [None] * len(ps)
        alike: dict[tuple, list[int]] = {}
        for i, p in enumerate(ps):
            alike.setdefault((tuple(p.shape), p.dtype, p.device), []).append(i)
        for (_, dtype, _), idx in alike.items():
            if len(idx) == 1:
                out[idx[0]] = TorchOps.orthonormal(ps[idx[0]])
                continue
            stacked = torch.stack([ps[i] for i in idx])
            if dtype in (torch.float16, torch.bfloat16):  # no half-precision QR
                q = torch.linalg.qr(stacked.float()).Q.to(dtype)
            else:
                q = torch.linalg.qr(stacked).Q
            for i, x in zip(idx, q.unbind()):
                out[i] = x
        return out

    @staticmethod
    def orthonormal(p: torch.Tensor) -> torch.Tensor:
        if p.dtype in (torch.float16, torch.bfloat16):  # no half-precision QR
            return torch.linalg.qr(p.float()).Q.to(p.dtype)
        return torch.linalg.qr(p).Q

    @staticmethod
    def from_host(values: Any, like: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(values).to(like.device, like.dtype)

    @staticmethod
    def dtype_key(t: torch.Tensor) -> str:
        return str(t.dtype).removeprefix("torch.")

    # -- the outer synchronization (delay=)
    @staticmethod
    def add_scaled(acc: torch.Tensor, x: torch.Tensor, alpha: float) -> torch.Tensor:
        return acc.add_(x, alpha=alpha)

    @staticmethod
    def zeros_like(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t)

    @staticmethod
    def assign(target: torch.Tensor, value: torch.Tensor) -> None:
        with torch.no_grad():
            target.copy_(value)

    @staticmethod
    def cast(t: torch.Tensor, dtype: Optional[str] = None,
             like: Optional[torch.Tensor] = None) -> torch.Tensor:
        return t.to(getattr(torch, dtype) if dtype is not None else like.dtype)

    @staticmethod
    def encode(tensors: Sequence[torch.Tensor], codec: str, chunk: int) -> list[torch.Tensor]:
        return encode(tensors, codec, chunk)

    @staticmethod
    def decode(parts: Sequence[torch.Tensor], like: Sequence[torch.Tensor], codec: str,
               chunk: int) -> list[torch.Tensor]:
        return unflatten(decoded(parts, codec, chunk), like)

    @staticmethod
    def decode_sum(gathered: Sequence[torch.Tensor], size: int, codec: str, chunk: int,
                   like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return decode_average(gathered, size, codec, chunk, like)

    @staticmethod
    def add_all(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch._foreach_add(list(a), list(b))) if a else []

    @staticmethod
    def sub_all(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch._foreach_sub(list(a), list(b))) if a else []

    @staticmethod
    def add_scaled_all(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], alpha: float
                       ) -> list[torch.Tensor]:
        return list(torch._foreach_add(list(a), list(b), alpha=alpha)) if a else []

    @staticmethod
    def assign_all(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        if targets:
            with torch.no_grad():
                torch._foreach_copy_(list(targets), list(values))

    @staticmethod
    def part(gathered: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        return gathered.view(size, -1)[rank]

    @staticmethod
    def cond(flag: Any, yes: Callable[[], Any], no: Callable[[], Any]) -> Any:
        return yes() if bool(flag) else no()

    @staticmethod
    def where(flag: Any, yes: Any, no: Any) -> Any:
        return yes if bool(flag) else no

    @staticmethod
    def vector(scalars: Sequence[Any], dtype: str = "float64") -> torch.Tensor:
        return torch.stack([torch.as_tensor(s).to(getattr(torch, dtype)).reshape(())
                            for s in scalars])

    @staticmethod
    def fused(fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn  # an eager op costs a few microseconds: nothing to gain


class TorchGradients:
    """:class:`hvdsync.technique.Gradients` over ``p.grad`` of the wrapped optimizer's
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
        return sum(payload_bytes(p.grad) for _, p in self.layer_params[li])

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

    def prepare(self, li: int) -> None:
        """Undo the loss scale of layer ``li``'s gradients (GradScaler's scales are powers of
        two: exact), so clip limits, norms, scores and every memory see true gradients."""
        scale = self._scale()
        if scale is None:
            return
        if self._inv_scale is None:  # once per step, as GradScaler.unscale_ computes it
            self._inv_scale = scale.double().reciprocal().float()
        for _, p in self.layer_params[li]:
            if p.grad is not None:
                (p.grad._values() if p.grad.is_sparse else p.grad).mul_(
                    self._inv_scale.to(p.grad.device))

    def before_optimizer_step(self, ok: bool) -> None:
        # No gradient: the wrapped optimizer leaves the parameter and its state alone.
        for p in self._withheld:
            p.grad = None
        self._withheld.clear()
        self._inv_scale = None

    def hand_over(self, ok: bool) -> None:
        """Leave ``p.grad`` as the user's next move expects: NaN everywhere after a step
        skipped on every rank (so every rank, and its loss scaler, sees it); else scaled
        again by the loss scaler's current scale, for ``scaler.unscale_(optimizer)``."""
        scale = None if not ok else self._scale()
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


def _flatten(x: Any) -> list:
    """``Tensor.tolist()`` of any shape as one flat list."""
    if not isinstance(x, list):
        return [x]
    return [y for item in x for y in _flatten(item)] if x and isinstance(x[0], list) else x


def _map_tensors(x: Any, fn) -> Any:
    if torch.is_tensor(x):
        return fn(x)
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(v, fn) for v in x)
    return copy.deepcopy(x)
