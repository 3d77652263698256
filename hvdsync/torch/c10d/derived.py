"""The part of Horovod's torch API that the torch engine builds from :mod:`hvdsync.torch.c10d`'s
collectives: the copying and blocking forms, the autograd forms (a script may differentiate
through ``hvd.allgather`` as through Horovod's), reducescatter, the info functions and the
timeline calls. Each call reaches the engine through :func:`hvdsync.torch.engine.ops`, so the
simulated ranks (:mod:`hvdsync.testing.simulated`) run the same code. docs/backends.md.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.autograd import Function

from hvdsync.torch import engine
from hvdsync.torch.compression import Compression

__all__ = ["allreduce_async", "allreduce_", "grouped_allreduce_async", "grouped_allreduce_",
           "broadcast_async", "broadcast_", "sparse_allreduce_async", "entry_tag_async",
           "grouped_reducescatter_async", "reducescatter_async", "grouped_allreduce", "allreduce",
           "grouped_allgather", "allgather", "broadcast", "alltoall", "grouped_reducescatter",
           "reducescatter", "mpi_built", "mpi_enabled", "mpi_threads_supported",
           "gloo_built", "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
           "rocm_built", "check_extension", "start_timeline", "stop_timeline"]


def _gps() -> Any:
    return engine.ops().global_process_set


# -- copying and blocking forms ---------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: Any = None) -> Any:
    """Start reducing a copy of ``tensor``; ``synchronize`` returns the result."""
    return engine.ops().allreduce_async_(tensor.detach().clone(), average, name, op,
                                         prescale_factor, postscale_factor,
                                         process_set or _gps())


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None) -> torch.Tensor:
    ops = engine.ops()
    return ops.now(lambda: ops.allreduce_async_(tensor, average, name, op, prescale_factor,
                                                postscale_factor, process_set or _gps()))


def grouped_allreduce_async(tensors: list[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None) -> Any:
    return engine.ops().grouped_allreduce_async_(
        [t.detach().clone() for t in tensors], average, name, op, prescale_factor,
        postscale_factor, process_set or _gps())


def grouped_allreduce_(tensors: list[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: Any = None
                       ) -> list[torch.Tensor]:
    ops = engine.ops()
    return ops.now(lambda: ops.grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set or _gps()))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = None) -> Any:
    return engine.ops().broadcast_async_(tensor.detach().clone(), root_rank, name,
                                         process_set or _gps())


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = None) -> torch.Tensor:
    ops = engine.ops()
    return ops.now(lambda: ops.broadcast_async_(tensor, root_rank, name, process_set or _gps()))


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op: Any,
                           process_set: Any = None) -> Callable[[], torch.Tensor]:
    """A sparse COO gradient summed (or averaged) by gathering every rank's indices and
    values, as Horovod does; returns a function giving the (uncoalesced) result."""
    ops, ps = engine.ops(), process_set or _gps()
    indices = ops.allgather_async(tensor._indices().transpose(0, 1).contiguous(),
                                  None if name is None else f"{name}.indices", ps)
    values = ops.allgather_async(tensor._values(), None if name is None else f"{name}.values",
                                 ps)

    def result() -> torch.Tensor:
        v, i = ops.synchronize(values), ops.synchronize(indices)
        if op == ops.Average:
            v = v / ps.size()
        return torch.sparse_coo_tensor(i.transpose(0, 1), v, tensor.size())
    return result


def entry_tag_async(kind: int, step: int, name: str, process_set: Any = None,
                    optimizer: int = 0) -> Any:
    """hvdsync's entry tag (:mod:`hvdsync.safety.entries`) on this engine: this rank's entry
    ``kind`` and ``step`` (of ``optimizer``: its tags' identity) gathered from every rank in
    the shape of a script call's check, so that a rank in ``hvd.join()`` takes part in the
    step, and one in a call of the script's own pairs with it and every side raises
    (:mod:`hvdsync.torch.c10d.joining`). The handle gives every rank's row."""
    ops, ps = engine.ops(), process_set or _gps()
    group = ops._group(ps)
    row = torch.tensor(ops.checks.entry_row(kind, step, optimizer), dtype=torch.int64)
    return ops._start("entry", name, ps, [], lambda: ops._gather_rows(row, group))


# -- reducescatter ----------------------------------------------------------------------------
def split_rows(rows: int, n: int) -> list[tuple[int, int]]:
    """Horovod's split of ``rows`` over ``n`` ranks, ``(start, count)`` each: the first
    ``rows % n`` ranks get one more."""
    base, extra = divmod(rows, n)
    return [(j * base + min(j, extra), base + (j < extra)) for j in range(n)]


def reduce_scatter(tensors: list[torch.Tensor], op: Any, prescale: float, postscale: float,
                   process_set: Any) -> Any:
    """Reduce ``tensors`` over the set, each rank receiving its rows (:func:`split_rows`) of
    each: per dtype, one c10d reduce-scatter of a buffer that holds every rank's rows
    contiguously, each rank's part padded to the longest (at most a row of each tensor more
    than an even split). A reduce-scatter's bytes, where an allreduce would move twice
    them."""
    ops = engine.ops()
    group = ops._group(process_set)
    api = ops.current().api
    n, me = api.get_world_size(group), api.get_rank(group)
    works, unpack = [], []
    for dtype, idx in ops._by_dtype(tensors).items():
        splits = [split_rows(tensors[i].shape[0], n) for i in idx]
        per_row = [math.prod(tensors[i].shape[1:]) for i in idx]
        lengths = [sum(s[j][1] * k for s, k in zip(splits, per_row)) for j in range(n)]
        chunk = max(lengths)
        wire, device = ops._WIRE.get(dtype, dtype), tensors[idx[0]].device
        send = torch.zeros(n * chunk, dtype=wire, device=device)
        for j in range(n):
            parts = [tensors[i][s[j][0]:s[j][0] + s[j][1]].reshape(-1)
                     for i, s in zip(idx, splits)]
            if lengths[j]:
                send[j * chunk:j * chunk + lengths[j]].copy_(torch.cat(parts))
        ops._scale(send, prescale)
        if n == 1:
            mine = send  # (nothing to send: this rank's part is the whole)
        else:
            mine = torch.empty(chunk, dtype=wire, device=device)
            works.append(api.reduce_scatter_single(ops.lend(mine), ops.lend(send),
                                                   op=ops._C10D_OPS[op], group=group,
                                                   async_op=True))
        unpack.append((idx, splits, per_row, mine))
    post = postscale / n if op == ops.Average else postscale

    def finish() -> list[torch.Tensor]:
        out: list[Any] = [None] * len(tensors)
        for idx, splits, per_row, mine in unpack:
            ops._scale(mine, post)
            at = 0
            for i, s, k in zip(idx, splits, per_row):
                t, count = tensors[i], s[me][1]
                out[i] = mine[at:at + count * k].reshape(count, *t.shape[1:]).to(t.dtype)
                at += count * k
        return out
    return ops.Handle(works, finish)


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: Optional[str] = None,
                                op: Any = None, process_set: Any = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0
                                ) -> Any:
    """Start reducing ``tensors`` over the set; each rank gets its part of the first
    dimension (Horovod's split): one reduce-scatter per dtype
    (:func:`reduce_scatter`)."""
    ops, ps = engine.ops(), process_set or _gps()
    op = ops.Average if op is None else op
    if op not in (ops.Average, ops.Sum):  # Horovod's rule, and its exception
        raise ops.UnsupportedCall(f"reducescatter reduces with Average or Sum, as Horovod's; "
                                  f"got op={op!r}")
    tensors = [t.detach() for t in tensors]
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("reducescatter needs tensors with at least one dimension")
    for dtype in {t.dtype for t in tensors}:  # all refused before any starts
        ops._check_op(op, dtype, prescale_factor != 1.0 or postscale_factor != 1.0)
    return ops._start("reducescatter", name, ps, tensors,
                      lambda: reduce_scatter(tensors, op, prescale_factor, postscale_factor, ps),
                      op=op, scales=(prescale_factor, postscale_factor))


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = None,
                        process_set: Any = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Any:
    return grouped_reducescatter_async([tensor], name, op, process_set, prescale_factor,
                                       postscale_factor).then_first()


# -- the autograd forms (Horovod's gradients) -------------------------------------------------
class _Allreduce(Function):
    @staticmethod
    def forward(ctx, op, pre, post, ps, name, *tensors):
        ctx.args = (op, pre, post, ps)
        return tuple(engine.ops().now(lambda: grouped_allreduce_async(
            list(tensors), None, name, op, pre, post, ps)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        return (None,) * 5 + tuple(grouped_allreduce(list(grads), op=op, prescale_factor=pre,
                                                     postscale_factor=post, process_set=ps))


def grouped_allreduce(tensors: list[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None
                      ) -> list[torch.Tensor]:
    """The reduced ``tensors`` (new tensors, differentiable), compressed on the wire."""
    packed = [compression.compress(t) for t in tensors]
    out = _Allreduce.apply(engine.ops()._op_of(average, op), prescale_factor, postscale_factor,
                           process_set or _gps(), name, *[c for c, _ in packed])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, packed)]


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> torch.Tensor:
    """The reduced ``tensor`` (a new tensor, differentiable), compressed as Horovod's is."""
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor,
                             postscale_factor, process_set)[0]


class _Allgather(Function):
    @staticmethod
    def forward(ctx, ps, name, *tensors):
        ctx.ps, ctx.dims = ps, [t.shape[0] for t in tensors]
        ops = engine.ops()
        return tuple(ops.now(lambda: ops.grouped_allgather_async(list(tensors), name, ps)))

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.ps
        reduced = grouped_allreduce(list(grads), average=True, process_set=ps)
        dims = grouped_allgather([torch.tensor([d]) for d in ctx.dims], process_set=ps)
        me = ps.rank()
        return (None, None) + tuple(g.narrow(0, int(d[:me].sum()), own) for g, d, own
                                    in zip(reduced, dims, ctx.dims))


def grouped_allgather(tensors: list[torch.Tensor], name: Optional[str] = None,
                      process_set: Any = None) -> list[torch.Tensor]:
    """Every rank's ``tensors`` concatenated along dim 0 in rank order (differentiable)."""
    return list(_Allgather.apply(process_set or _gps(), name, *tensors))


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: Any = None) -> torch.Tensor:
    return grouped_allgather([tensor], name, process_set)[0]


class _Broadcast(Function):
    @staticmethod
    def forward(ctx, tensor, root, name, ps):
        ctx.root, ctx.ps = root, ps
        return broadcast_(tensor.detach().clone(), root, name, ps)

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, average=True, process_set=ctx.ps)
        if engine.ops().rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Any = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` (a new tensor, differentiable)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set or _gps())


class _Alltoall(Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, ps):
        ops = engine.ops()
        out, received = ops.now(lambda: ops.alltoall_async(tensor, splits, name, ps))
        ctx.ps, ctx.received = ps, received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        return alltoall(grad, splits=ctx.received, process_set=ctx.ps)[0], None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: Any = None) -> Any:
    """Rows of ``tensor`` sent to each rank (``splits``; default equal parts), theirs
    received in rank order (differentiable); with ``splits``, also how many rows came from
    each rank."""
    out, received = _Alltoall.apply(tensor, splits, name, process_set or _gps())
    return out if splits is None else (out, received)


class _Reducescatter(Function):
    @staticmethod
    def forward(ctx, op, pre, post, ps, name, *tensors):
        ctx.args = (op, pre, post, ps)
        ops = engine.ops()
        return tuple(ops.now(lambda: grouped_reducescatter_async(list(tensors), name, op, ps,
                                                                 pre, post)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        factor = (ps.size() if op == engine.ops().Sum else 1) * pre * post
        return (None,) * 5 + tuple(grouped_allgather([g * factor for g in grads],
                                                      process_set=ps))


def grouped_reducescatter(tensors: list[torch.Tensor], name: Optional[str] = None,
                          compression: Any = Compression.none, op: Any = None,
                          process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Each rank's part of the reduced ``tensors`` (differentiable; Horovod's split)."""
    packed = [compression.compress(t) for t in tensors]
    out = _Reducescatter.apply(engine.ops().Average if op is None else op, prescale_factor,
                               postscale_factor, process_set or _gps(), name,
                               *[c for c, _ in packed])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, packed)]


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: Any = Compression.none, op: Any = None,
                  process_set: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    return grouped_reducescatter([tensor], name, compression, op, process_set,
                                 prescale_factor, postscale_factor)[0]


# -- the info functions, the timeline (join: hvdsync.torch.c10d) ---------------------------------------------------
def mpi_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def gloo_built() -> bool:
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    return dist.is_initialized() and "gloo" in str(dist.get_backend()).lower()


def nccl_built() -> bool:
    return dist.is_nccl_available()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    return torch.version.hip is not None


def check_extension(*args: Any, **kwargs: Any) -> None:
    """Horovod checks its compiled extension here; the torch engine has none."""


_TIMELINE_WARNED: list[bool] = []


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """A no-op on the torch engine (one warning): Horovod's timeline records its own
    coordinator's cycles; use ``torch.profiler`` for c10d's collectives."""
    if not _TIMELINE_WARNED:
        _TIMELINE_WARNED.append(True)
        warnings.warn("hvd.start_timeline records nothing on the torch engine (Horovod's "
                      "timeline traces its coordinator); torch.profiler traces c10d's "
                      "collectives", RuntimeWarning, stacklevel=2)


def stop_timeline() -> None:
    """A no-op on the torch engine (see :func:`start_timeline`)."""
