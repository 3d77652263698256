"""The tensor arithmetic the framework-neutral techniques ask of torch
(:class:`hvdsync.core.ports.TensorOps`): in place where allowed, many tensors at once where a
multi-tensor op exists (each op is a kernel launch on a GPU)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from hvdsync.torch.comm import payload_bytes
from hvdsync.torch.foreach import MultiTensorOps


class TorchOps(MultiTensorOps):
    """:class:`hvdsync.core.ports.TensorOps` on torch tensors (in place where allowed): the
    arithmetic of one tensor here, that of many at once in
    :class:`hvdsync.torch.foreach.MultiTensorOps` -- each in the file of the kernels it runs,
    so that a step's calls stay there."""

    @staticmethod
    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    @staticmethod
    def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b

    @staticmethod
    def accumulate(acc: torch.Tensor, x: torch.Tensor, sign: int = 1) -> torch.Tensor:
        return acc.add_(x) if sign > 0 else acc.sub_(x)

    @staticmethod
    def clone(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    @staticmethod
    def zero() -> torch.Tensor:
        return torch.zeros(())

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
