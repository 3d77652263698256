"""Horovod's torch API on ``torch.distributed`` (c10d): hvdsync without a Horovod build.

:mod:`hvdsync.torch.engine` routes Horovod's names here when the torch engine is active. This
module holds what touches c10d; :mod:`hvdsync.torch.c10d.derived` builds the rest from it,
:mod:`hvdsync.torch.functions` the object and state broadcasts, :mod:`hvdsync.torch.c10d.sets`
the process sets. How Horovod's semantics map: before each collective a script starts the
ranks compare a descriptor of it (:mod:`hvdsync.torch.c10d.checks`), so a mismatch raises
``HorovodInternalError`` on every rank instead of pairing wrong tensors; ``*_async`` calls
return a :class:`Handle` at once (:mod:`hvdsync.torch.c10d.calls`); a grouped allreduce
packs one flat buffer per dtype and averages are scaled sums (integers as Horovod scales
them); int16 travels as int32 and bool reduces with Min and Max only; uneven first
dimensions send their sizes first; a rank that dies makes the others' waits raise
``HorovodInternalError``. docs/backends.md names every function.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from hvdsync.safety import watchdog
from hvdsync.torch.c10d import checks, joining, launch
from hvdsync.torch.c10d.sets import (ProcessSet, add_process_set, forget_process_sets,  # noqa: F401
                                     global_process_set, group_of as _group,
                                     remove_process_set)
from hvdsync.torch.c10d.calls import (Handle, HorovodInternalError, poll,  # noqa: F401
                                      synchronize, waiting)
from hvdsync.torch.c10d.runtime import current, lend
from hvdsync.torch.compression import Compression  # noqa: F401  (part of the API)

# Horovod's reduce-op constants, with Horovod's values (a script may compare them)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_C10D_OPS = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
#: dtypes Gloo lacks, and the dtype they travel as (exact, and wrapping alike in sums)
_WIRE = {torch.int16: torch.int32}


class UnsupportedCall(HorovodInternalError, ValueError):
    """A call Horovod refuses with ``HorovodInternalError`` (a reduce op it lacks without MPI,
    such as Adasum; an op a collective does not take; negative splits), raised before anything
    is sent. A ``ValueError`` too, as this engine raised before."""


# -- the job ----------------------------------------------------------------------------------
def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job: the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), Gloo for CPU tensors and NCCL for CUDA ones; a lone
    process (no launcher) is a job of one rank, as with Horovod. An existing default process
    group (the script called ``init_process_group`` itself) is used as it is.
    ``process_sets``: :class:`ProcessSet` objects (or rank lists) to add at once."""
    if not current().joins:  # (a thread's own runtime is in its world from the start)
        return
    if comm is not None:
        raise ValueError("the torch engine takes no MPI communicator (comm=): Horovod's MPI "
                         "build does (HVDSYNC_BACKEND=horovod)")
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        # longer than hvdsync's own bound, so that its watchdog speaks first: it names what
        # was waited for and why that happens (docs/failures.md); c10d's is the backstop
        limit = watchdog.timeout_s()
        timeout = timedelta(seconds=1.5 * limit + 10) if limit > 0 else timedelta(days=365)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout, **launch.attempt_store(timeout))
        else:
            launch.refuse_other_launchers()
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
    for ps in () if process_sets in (None, "dynamic") else process_sets:  # always dynamic
        if getattr(ps, "process_set_id", None) is None:
            add_process_set(ps)
    launch.export_horovod_environment({f.__name__: f() for f in (
        rank, size, local_rank, local_size, cross_rank, cross_size)})


def shutdown() -> None:
    if not current().joins:
        return
    for lane in current().lanes.values():
        lane.close("hvd.shutdown() came before this collective started")
    current().lanes.clear()
    forget_process_sets()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    return current().api.is_initialized()


def _need_init() -> None:
    if not current().api.is_initialized():
        raise ValueError("hvdsync (torch backend) has not been initialized; use hvd.init().")


def size() -> int:
    _need_init()
    return current().api.get_world_size()


def rank() -> int:
    _need_init()
    return current().api.get_rank()


def local_rank() -> int:
    _need_init()
    return int(os.environ.get("LOCAL_RANK", rank()))


def local_size() -> int:
    _need_init()
    return int(os.environ.get("LOCAL_WORLD_SIZE", size()))


def cross_rank() -> int:
    return rank() // local_size()


def cross_size() -> int:
    return size() // local_size()


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank of ``process_set`` is here."""
    group = _group(process_set)
    now(lambda: _start("barrier", None, process_set, [], lambda: Handle(
        [current().api.barrier(group=group, async_op=True)], lambda: None)), "hvd.barrier()")


def join(device: int = -1, step_with: Optional[Callable[[int, int], bool]] = None) -> int:
    """Horovod's ``hvd.join()``: this rank is out of data; it answers the others' allreduces
    with zeros until every rank has joined (:mod:`hvdsync.torch.c10d.joining`), and returns
    the rank that joined last (the highest of those that joined in one round). Unbounded, as
    Horovod's: it waits for the slowest rank's data (within the process group's timeout,
    about 1.5 x ``HVDSYNC_TIMEOUT_SECONDS``). ``step_with(optimizer, step)``: take part in a
    step of hvdsync's optimizer (hvdsync.torch.joined), on this thread."""
    group, runtime = _group(global_process_set), current()
    if runtime.api.get_world_size(group) == 1:
        return rank()

    def gather(row: list[int]) -> list[list[int]]:  # in this rank's order of calls
        with waiting():
            handle = _on_lane(runtime, group, lambda: _gather_rows(
                torch.tensor(row, dtype=torch.int64), group), False)
        handle.what = None  # a joined rank waits for the others' data: no report, no bound
        return synchronize(handle)

    def reduce_zeros(call: dict) -> None:
        zeros = [torch.zeros(shape, dtype=getattr(torch, dtype))
                 for dtype, shape in zip(call["dtypes"], call["shapes"])]
        synchronize(_allreduce(zeros, call["op"], *call["scale_factors"], group))
    return joining.answer_until_all_joined(
        runtime.api.get_rank(group), gather,
        lambda d: checks.gather_json(d, global_process_set), reduce_zeros,
        step_with or (lambda optimizer, step: False))


def now(start: Callable[[], Handle], what: Optional[str] = None) -> Any:
    """A blocking form: ``start()`` starts a call (an ``*_async`` function's) and this thread
    waits for it (``what``: for the watchdog, if not the handle's own); where the lane is
    idle, what the call waits for before its data moves runs here, with no hop to the lane's
    thread (:func:`hvdsync.torch.c10d.calls.waiting`)."""
    with waiting():
        handle = start()
    if what is not None:
        handle.what = what
    return synchronize(handle)


def _set_ranks(process_set: Any) -> list[int]:
    return list(getattr(process_set, "ranks", None) or range(size()))


# -- the descriptor check (c10d_checks) -------------------------------------------------------

def _start(kind: str, name: Optional[str], process_set: Any, tensors: list,
           start: Callable[[], Handle], op: Any = None, root: Optional[int] = None,
           scales: tuple = (1.0, 1.0), uneven: bool = False) -> Handle:
    """Start a collective of a script or of hvdsync: ``start()`` starts its data collectives
    and returns their handle. A script's call first compares, on every rank of the set, what
    each was asked to do, and where they differ every rank raises the same
    ``HorovodInternalError`` (at ``synchronize``). Calls that wait for the peers before their
    data moves (that check, an uneven call's sizes) run on the group's lane, in this rank's
    order of calls; the call returns at once."""
    runtime = current()
    previous = runtime.in_flight.get(name) if name is not None else None
    # in flight until synchronized: c10d's root of a broadcast may finish before its peers
    # start, so this rank's "done" is not the job's (Horovod's coordinator knows the job's)
    if previous is not None and not previous.done:
        raise ValueError(checks.in_flight(kind, name))  # Horovod's: at once, nothing sent
    group = _group(process_set)
    n = runtime.api.get_world_size(group)
    desc = (checks.readable(kind, tensors, name, op, root, scales, uneven)
            if n > 1 and checks.wanted(name) else None)

    def job() -> Handle:
        if desc is not None:
            everyone = _gather_ints(torch.tensor(checks.descriptor(desc), dtype=torch.int64),
                                    group, f"the ranks' check of hvd.{kind} {name!r}")
            if any(e != everyone[0] for e in everyone):
                joining.differ(desc, everyone, lambda d: checks.gather_json(d, process_set),
                               _set_ranks(process_set))
        return start()
    return _track(name, _on_lane(runtime, group, job, desc is not None or (uneven and n > 1)))


def _on_lane(runtime: Any, group: Any, job: Callable[[], Handle], waits: bool) -> Handle:
    """``job()`` started in this rank's order of calls on ``group`` (``waits``: whether it
    waits for the peers before its data moves), its handle; simulated ranks start it on their
    own thread."""
    if not runtime.joins:
        return job()
    started = runtime.lane(group).start(job, waits)
    return started if isinstance(started, Handle) else Handle([], None, started)


def _track(name: Optional[str], handle: Handle) -> Handle:
    if name is not None and not name.startswith(checks.INTERNAL):
        in_flight = current().in_flight  # a script's named collectives not yet synchronized
        for done in [k for k, h in in_flight.items() if h.done]:
            del in_flight[done]
        in_flight[name] = handle
    return handle


#: more rows than any rank can hold: a gathered size this large is not a size
_MOST_ROWS = 2**40


def _gather_rows(mine: torch.Tensor, group: Any) -> Handle:
    """Every rank's ``mine`` (int64 vector, equal lengths), started: the handle gives them per
    rank, as lists. The descriptors, uneven collectives' sizes, hvdsync's entry tags."""
    api = current().api
    rows = [torch.empty_like(mine) for _ in range(api.get_world_size(group))]
    work = api.all_gather([lend(r) for r in rows], lend(mine), group=group, async_op=True)
    return Handle([work], lambda: torch.stack(rows).tolist())


def _gather_ints(mine: torch.Tensor, group: Any, what: Optional[str]) -> list[list[int]]:
    """:func:`_gather_rows`, waited for (``what``: for the watchdog; ``None``: unbounded)."""
    handle = _gather_rows(mine, group)
    handle.what = what
    return synchronize(handle)


# -- allreduce --------------------------------------------------------------------------------
def _check_op(op: Any, dtype: torch.dtype, scaled: bool) -> None:
    if op not in _C10D_OPS:
        raise UnsupportedCall(f"the torch backend reduces with Average, Sum, Min, Max or "
                              f"Product (Adasum is Horovod's own, with MPI); got op={op!r}")
    if dtype == torch.bool and (op not in (Min, Max) or scaled):
        raise ValueError("bool tensors reduce with op=hvd.Min (all ranks true) or hvd.Max (any "
                         "rank true), unscaled; for a count, reduce them as int32")


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """The positions of ``tensors`` per dtype, in order: one fused collective per dtype."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _scale(flat: torch.Tensor, factor: float) -> None:
    """``flat *= factor`` as Horovod scales: integers in double precision, truncated."""
    if factor == 1.0:
        return
    if flat.is_floating_point():
        flat.mul_(factor)
    else:
        flat.copy_(flat.double().mul_(factor))


def _reduce(flat: torch.Tensor, op: Any, prescale: float, postscale: float,
            outputs: list[torch.Tensor], group: Any) -> Handle:
    """Reduce ``flat`` (this rank's values: a packed copy, or the one output itself) into
    ``outputs`` (``flat`` split by numel, copied where it is not the output) with Horovod's
    pre/post scaling."""
    _scale(flat, prescale)
    n = current().api.get_world_size(group)
    work = (current().api.all_reduce(lend(flat), op=_C10D_OPS[op], group=group, async_op=True)
            if n > 1 else None)
    post = postscale / n if op == Average else postscale

    def finish() -> list[torch.Tensor]:
        _scale(flat, post)
        at = 0
        for out in outputs:
            k = out.numel()
            if flat.data_ptr() != out.data_ptr():
                out.copy_(flat[at:at + k].view_as(out))
            at += k
        return outputs
    return Handle([work] if work is not None else [], finish)


def _op_of(average: Optional[bool], op: Any) -> Any:
    if average is not None:
        if op is not None:
            raise ValueError("give op or average, not both")
        return Average if average else Sum
    return Average if op is None else op


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> Handle:
    """Start reducing ``tensor`` in place; :func:`synchronize` returns it."""
    return grouped_allreduce_async_([tensor], average, name, op, prescale_factor,
                                    postscale_factor, process_set).then_first()


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> Handle:
    """Start reducing ``tensors`` in place, fused: one allreduce per dtype."""
    op = _op_of(average, op)
    tensors = list(tensors)
    group = _group(process_set)
    by_dtype = _by_dtype(tensors)
    for dtype in by_dtype:  # all refused before any starts
        _check_op(op, dtype, prescale_factor != 1.0 or postscale_factor != 1.0)

    return _start("allreduce", name, process_set, tensors, lambda: _allreduce(
        tensors, op, prescale_factor, postscale_factor, group), op=op,
        scales=(prescale_factor, postscale_factor))


def _allreduce(tensors: list[torch.Tensor], op: Any, prescale: float, postscale: float,
               group: Any) -> Handle:
    """:func:`grouped_allreduce_async_`'s data: one allreduce per dtype (a joined rank's
    zeros take this path too: :mod:`hvdsync.torch.c10d.joining`)."""
    handles = []
    for dtype, idx in _by_dtype(tensors).items():
        group_tensors = [tensors[i] for i in idx]
        wire = _WIRE.get(dtype, dtype)
        if len(idx) == 1 and wire == dtype and group_tensors[0].is_contiguous():
            flat = group_tensors[0].detach().view(-1)  # in place: no copy in or out
        else:
            flat = torch.cat([t.detach().reshape(-1) for t in group_tensors]).to(wire)
        handles.append(_reduce(flat, op, prescale, postscale, group_tensors, group))

    def finish() -> list[torch.Tensor]:
        for h in handles:
            synchronize(h)
        return tensors
    return Handle([w for h in handles for w in h.works], finish)


# -- allgather --------------------------------------------------------------------------------
def grouped_allgather_async(tensors: list[torch.Tensor], name: Optional[str] = None,
                            process_set: Any = global_process_set) -> Handle:
    """Start gathering every rank's ``tensors`` (concatenated along dim 0 in rank order; the
    first dimension may differ between ranks): one blocking exchange of the sizes, then one
    asynchronous allgather per dtype of the padded, packed tensors."""
    group = _group(process_set)
    tensors = [t.detach() for t in tensors]
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("allgather needs tensors with at least one dimension")
    return _start("allgather", name, process_set, tensors,
                  lambda: _allgather(tensors, name, group), uneven=True)


def _allgather(tensors: list[torch.Tensor], name: Optional[str], group: Any) -> Handle:
    """:func:`grouped_allgather_async`'s start: the sizes (blocking), then the data."""
    n = current().api.get_world_size(group)
    if n == 1:
        out = [t.clone() for t in tensors]
        return Handle([], lambda: out)
    mine = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
    rows = _gather_ints(mine, group, f"the sizes of the allgather {name!r}")
    if any(not 0 <= v < _MOST_ROWS for r in rows for v in r):
        # Gloo can hand back what a peer that is gone never sent instead of failing
        raise HorovodInternalError(f"a collective failed: the sizes of the allgather {name!r} "
                                   f"came back as {rows} (a rank of the job failed or left it; "
                                   "its own output says why)")
    me = current().api.get_rank(group)
    works, unpack = [], []
    for dtype, idx in _by_dtype(tensors).items():
        per_row = [math.prod(tensors[i].shape[1:]) for i in idx]  # values per first-dim row
        lengths = [sum(rows[r][i] * k for i, k in zip(idx, per_row)) for r in range(n)]
        longest = max(lengths)
        wire = _WIRE.get(dtype, dtype)
        send = torch.zeros(longest, dtype=wire)
        if lengths[me]:
            send[:lengths[me]].copy_(torch.cat([tensors[i].reshape(-1) for i in idx]))
        recv = [torch.empty(longest, dtype=wire) for _ in range(n)]
        works.append(current().api.all_gather([lend(r) for r in recv], lend(send), group=group,
                                     async_op=True))
        unpack.append((idx, per_row, recv))

    def finish() -> list[torch.Tensor]:
        out: list[Any] = [None] * len(tensors)
        for idx, per_row, recv in unpack:
            pieces: dict[int, list[torch.Tensor]] = {i: [] for i in idx}
            for r in range(n):
                at = 0
                for i, k in zip(idx, per_row):
                    m = rows[r][i] * k
                    pieces[i].append(recv[r][at:at + m].view(rows[r][i], *tensors[i].shape[1:]))
                    at += m
            for i in idx:
                out[i] = torch.cat(pieces[i]).to(tensors[i].dtype)
        return out
    return Handle(works, finish)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: Any = global_process_set) -> Handle:
    return grouped_allgather_async([tensor], name, process_set).then_first()


# -- broadcast --------------------------------------------------------------------------------
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> Handle:
    """Start replacing ``tensor`` by ``root_rank``'s (a global rank, as on Horovod)."""
    group = _group(process_set)
    if root_rank not in _set_ranks(process_set):
        raise ValueError(f"root_rank {root_rank} is not in {process_set!r}")

    def start() -> Handle:
        if current().api.get_world_size(group) == 1:
            return Handle([], lambda: tensor)
        wire = _WIRE.get(tensor.dtype)
        buf = tensor if wire is None and tensor.is_contiguous() else tensor.detach().to(
            wire or tensor.dtype, memory_format=torch.contiguous_format)
        work = current().api.broadcast(lend(buf), src=root_rank, group=group, async_op=True)

        def finish() -> torch.Tensor:
            if buf is not tensor:
                tensor.copy_(buf)
            return tensor
        return Handle([work], finish)
    return _start("broadcast", name, process_set, [tensor], start, root=root_rank)


# -- alltoall ---------------------------------------------------------------------------------
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: Any = global_process_set) -> Handle:
    """Start sending rows of ``tensor`` to each rank of the set (``splits[i]`` rows to the
    i-th; default: equal parts) and receiving theirs; :func:`synchronize` gives ``(output,
    received_splits)``, the rows in rank order and how many came from each."""
    group = _group(process_set)
    tensor = tensor.detach()
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    n = current().api.get_world_size(group)
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by "
                             f"the {n} ranks; got {tensor.shape[0]}")
        sent = [tensor.shape[0] // n] * n
    else:
        sent = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
        if len(sent) != n or any(s < 0 for s in sent) or sum(sent) != tensor.shape[0]:
            raise UnsupportedCall(f"alltoall splits must be {n} counts >= 0 summing to the "
                                  f"first dimension {tensor.shape[0]}; got {sent}")

    def start() -> Handle:
        wire = _WIRE.get(tensor.dtype, tensor.dtype)
        me = current().api.get_rank(group)
        received = [row[me] for row in _gather_ints(torch.tensor(sent, dtype=torch.int64),
                                                     group, f"the splits of the alltoall "
                                                     f"{name!r}")]
        out = torch.empty((sum(received), *tensor.shape[1:]), dtype=wire)
        send = tensor.to(wire).contiguous()
        work = current().api.all_to_all_single(lend(out), lend(send), received, sent,
                                               group=group, async_op=True) if n > 1 else None
        if work is None:
            out.copy_(send)

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            return out.to(tensor.dtype), torch.tensor(received, dtype=torch.int32)
        return Handle([] if work is None else [work], finish)
    return _start("alltoall", name, process_set, [tensor], start, uneven=True)


from hvdsync.torch.functions import (allgather_object, broadcast_object,  # noqa: E402,F401
                                     broadcast_optimizer_state, broadcast_parameters)
from hvdsync.torch.c10d.derived import *  # noqa: E402,F401,F403 - the API built from the above
