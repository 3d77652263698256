"""Horovod's torch API on ``torch.distributed`` (c10d): hvdsync without a Horovod build.

The torch adapter and a user's script call the same names as on Horovod (``init``, ``rank``,
``allreduce``, ``grouped_allreduce_async_``, ``allgather``, ``broadcast_parameters``,
``synchronize``, ``poll`` ...); :mod:`hvdsync.torch.engine` routes them here when the torch
backend is active (launched by ``torchrun``, Horovod not installed, ``HVDSYNC_BACKEND=torch``
or ``hvd.init(backend="torch")``). docs/backends.md compares the two.

How Horovod's semantics map onto c10d:

* **Order, not names.** Horovod matches collectives across ranks by name; c10d by the order
  they are started on a process group. hvdsync's pipeline starts its collectives in the same
  order on every rank (docs/design.md, the no-hang rule), which is all c10d needs; ``name``
  arguments are accepted and ignored.
* **Asynchronous.** Every ``*_async`` call starts one c10d collective with ``async_op=True``
  and returns a handle; :func:`synchronize` waits for it and finishes the result (scaling,
  copying out of the fused buffer), :func:`poll` asks whether it completed.
* **Fusion.** A grouped allreduce packs its tensors into one flat buffer per dtype (as
  Horovod's fusion buffer does) and runs one allreduce on it.
* **Averages** are sums scaled by ``postscale / size`` after the reduction (``prescale``
  before), as Horovod applies ``Average``.
* **Allgather of different first dimensions** (Horovod allows them, c10d does not): the
  ranks' sizes are gathered first (a small blocking collective), then the padded data
  asynchronously, and the padding is cut off in :func:`synchronize`.
* **Process sets**: the global one only.
* **Failures.** A rank that dies closes its connections: the others' next wait raises (and
  ``torchrun`` stops the job); a wait for a rank that hangs is bounded by
  :mod:`hvdsync.watchdog` (``HVDSYNC_TIMEOUT_SECONDS``: it names what was waited for), with
  the process group's own timeout a little longer as a backstop.
"""

from __future__ import annotations

import atexit
import math
import os
import pickle
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from hvdsync import watchdog
from hvdsync.torch.compression import Compression  # noqa: F401  (part of the API)

# Horovod's reduce-op constants, with Horovod's values (a script may compare them)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_C10D_OPS = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


class ProcessSet:
    """The global process set (every rank): the only one the torch backend has."""

    process_set_id = 0

    @property
    def ranks(self) -> list[int]:
        return list(range(size()))

    def included(self) -> bool:
        return True

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def __repr__(self) -> str:
        return "ProcessSet(global, torch.distributed)"


global_process_set = ProcessSet()


def _check_set(process_set: Any) -> None:
    # Horovod's global set (id 0) is accepted too: scripts pass hvd.global_process_set
    if getattr(process_set, "process_set_id", None) != 0:
        raise ValueError("the torch backend has the global process set only (every rank); got "
                         f"{process_set!r}. Use Horovod (HVDSYNC_BACKEND=horovod) for others.")


def _check_op(op: Any) -> None:
    if op not in _C10D_OPS:
        raise ValueError(f"the torch backend reduces with Average, Sum, Min, Max or Product "
                         f"(Adasum is Horovod's own); got op={op!r}")


# -- tensors lent to c10d ---------------------------------------------------------------------
# Gloo's worker thread drops a finished work a moment after wait() has returned. If a tensor the
# work holds has no Python reference left by then, dropping it needs the GIL, and a thread that
# asks for the GIL while the interpreter shuts down is ended mid-destructor: the process aborts
# ("terminate called without an active exception"). So c10d only ever gets aliases (their own
# reference count, same storage) that stay referenced here until c10d has let go of them, and
# at exit we wait (a moment, bounded) for that before the interpreter tears down.
_lent: list[torch.Tensor] = []


def _lend(tensor: torch.Tensor) -> torch.Tensor:
    """An alias of ``tensor`` for c10d (same storage), kept until c10d has dropped it."""
    _lent[:] = [t for t in _lent if t._use_count() > 1]
    alias = tensor.detach()
    _lent.append(alias)
    return alias


@atexit.register
def _await_returns(limit_s: float = 2.0) -> bool:
    """Wait until c10d has dropped every lent tensor (bounded: a collective that never
    finished keeps its own); whether it had. Runs at exit."""
    deadline = time.monotonic() + limit_s
    while any(t._use_count() > 1 for t in _lent) and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL that Gloo's threads need to drop their works
    returned = all(t._use_count() == 1 for t in _lent)
    _lent.clear()
    return returned


# -- the job ----------------------------------------------------------------------------------
def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job: the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), Gloo for CPU tensors and NCCL for CUDA ones; a lone
    process (no launcher) is a job of one rank, as with Horovod. An existing default process
    group (the script called ``init_process_group`` itself) is used as it is."""
    if comm is not None or process_sets:
        raise ValueError("the torch backend takes no comm or process_sets (Horovod/MPI only)")
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    # longer than hvdsync's own bound, so that its watchdog speaks first: it names what was
    # waited for and why that happens (docs/failures.md); c10d's timeout is the backstop
    limit = watchdog.timeout_s()
    timeout = timedelta(seconds=1.5 * limit + 10) if limit > 0 else timedelta(days=365)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, **_attempt_store(timeout))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)


def _attempt_store(timeout: timedelta) -> dict[str, Any]:
    """After ``torchrun --max-restarts`` started the workers again: a store whose keys are
    this attempt's. torchrun's agent keeps one store across attempts, so a restarted worker
    could read a previous attempt's address of a peer before the peer wrote its new one and
    fail to connect (seen here with Gloo: "Connection refused" at init; docs/elastic.md).
    Nothing to change on a first attempt."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dict(store=dist.PrefixStore(f"hvdsync/attempt{attempt}", store),
                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    return dist.is_initialized()


def _need_init() -> None:
    if not dist.is_initialized():
        raise ValueError("hvdsync (torch backend) has not been initialized; use hvd.init().")


def size() -> int:
    _need_init()
    return dist.get_world_size()


def rank() -> int:
    _need_init()
    return dist.get_rank()


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
    _check_set(process_set)
    dist.barrier()


def join(device: int = -1) -> int:
    raise NotImplementedError("hvd.join() (uneven inputs) is Horovod's: use Horovod as the "
                              "backend (HVDSYNC_BACKEND=horovod), or give every rank as many "
                              "batches")


# -- handles ----------------------------------------------------------------------------------
class Handle:
    """An operation in flight: c10d works, and what turns their buffers into the result."""

    __slots__ = ("works", "finish", "result", "done")

    def __init__(self, works: list, finish: Callable[[], Any]):
        self.works, self.finish, self.done = works, finish, False
        self.result: Any = None


def poll(handle: Handle) -> bool:
    """Whether ``handle``'s collectives have completed (a later :func:`synchronize` will not
    block)."""
    return handle.done or all(w.is_completed() for w in handle.works)


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle`` and return its result (a tensor, or a list for grouped calls)."""
    if not handle.done:
        for w in handle.works:
            w.wait()
        handle.result, handle.done = handle.finish(), True
        handle.works = []
    return handle.result


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """The positions of ``tensors`` per dtype, in order: one fused collective per dtype."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _reduce(flat: torch.Tensor, op: Any, prescale: float, postscale: float,
            outputs: list[torch.Tensor]) -> Handle:
    """Reduce ``flat`` (this rank's values: a packed copy, or the one output itself) into
    ``outputs`` (``flat`` split by numel, copied where it is not the output) with Horovod's
    pre/post scaling."""
    _check_op(op)
    if prescale != 1.0:
        flat.mul_(prescale)
    n = size()
    work = dist.all_reduce(_lend(flat), op=_C10D_OPS[op], async_op=True) if n > 1 else None
    post = postscale / n if op == Average else postscale

    def finish() -> list[torch.Tensor]:
        if post != 1.0:
            if flat.is_floating_point():
                flat.mul_(post)
            else:  # integers average as Horovod's do: rounded towards zero
                flat.copy_(torch.div(flat * postscale, n, rounding_mode="trunc"))
        at = 0
        for out in outputs:
            k = out.numel()
            if flat.data_ptr() != out.data_ptr():
                out.copy_(flat[at:at + k].view_as(out))
            at += k
        return outputs
    return Handle([work] if work is not None else [], finish)


# -- allreduce --------------------------------------------------------------------------------
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


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> Handle:
    """Start reducing a copy of ``tensor``; :func:`synchronize` returns the result."""
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor,
                            postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = global_process_set) -> torch.Tensor:
    """The reduced ``tensor`` (a new tensor), compressed on the wire as Horovod's is."""
    compressed, ctx = compression.compress(tensor)
    out = synchronize(allreduce_async(compressed, average, name, op, prescale_factor,
                                      postscale_factor, process_set))
    return compression.decompress(out, ctx)


class _Grouped(Handle):
    __slots__ = ()

    def then_first(self) -> Handle:
        finish = self.finish
        self.finish = lambda: finish()[0]
        return self


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> _Grouped:
    """Start reducing ``tensors`` in place, fused: one allreduce per dtype."""
    _check_set(process_set)
    op = _op_of(average, op)
    tensors = list(tensors)
    handles = []
    for idx in _by_dtype(tensors).values():
        group = [tensors[i] for i in idx]
        if len(group) == 1 and group[0].is_contiguous():
            flat = group[0].detach().view(-1)  # in place: no copy in or out
        else:
            flat = torch.cat([t.detach().reshape(-1) for t in group])
        handles.append(_reduce(flat, op, prescale_factor, postscale_factor, group))

    def finish() -> list[torch.Tensor]:
        for h in handles:
            synchronize(h)
        return tensors
    return _Grouped([w for h in handles for w in h.works], finish)


def grouped_allreduce_async(tensors: list[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> _Grouped:
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op,
                                    prescale_factor, postscale_factor, process_set)


def grouped_allreduce(tensors: list[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    packed = [compression.compress(t) for t in tensors]
    out = synchronize(grouped_allreduce_async([c for c, _ in packed], average, name, op,
                                              prescale_factor, postscale_factor, process_set))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, packed)]


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op: Any,
                           process_set: Any = global_process_set) -> Callable[[], torch.Tensor]:
    """A sparse COO gradient summed (or averaged) by gathering every rank's indices and
    values, as Horovod does; returns a function giving the (uncoalesced) result."""
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(), process_set=
                              process_set)
    values = allgather_async(tensor._values(), process_set=process_set)

    def result() -> torch.Tensor:
        v, i = synchronize(values), synchronize(indices)
        if op == Average:
            v = v / size()
        return torch.sparse_coo_tensor(i.transpose(0, 1), v, tensor.size())
    return result


# -- allgather --------------------------------------------------------------------------------
def grouped_allgather_async(tensors: list[torch.Tensor], name: Optional[str] = None,
                            process_set: Any = global_process_set) -> _Grouped:
    """Start gathering every rank's ``tensors`` (concatenated along dim 0 in rank order; the
    first dimension may differ between ranks): one blocking exchange of the sizes, then one
    asynchronous allgather per dtype of the padded, packed tensors."""
    _check_set(process_set)
    tensors = [t.detach() for t in tensors]
    n = size()
    if n == 1:
        out = [t.clone() for t in tensors]
        return _Grouped([], lambda: out)
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("allgather needs tensors with at least one dimension")
    mine = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
    gathered_sizes = [torch.empty_like(mine) for _ in range(n)]
    with watchdog.guard(f"the sizes of the allgather {name!r}"):
        dist.all_gather([_lend(g) for g in gathered_sizes], _lend(mine), async_op=True).wait()
    rows = torch.stack(gathered_sizes).tolist()  # rows[r][i]: first dim of tensor i on rank r
    works, unpack = [], []
    for dtype, idx in _by_dtype(tensors).items():
        per_row = [math.prod(tensors[i].shape[1:]) for i in idx]  # values per first-dim row
        lengths = [sum(rows[r][i] * k for i, k in zip(idx, per_row)) for r in range(n)]
        longest = max(lengths)
        send = torch.zeros(longest, dtype=dtype)
        if lengths[rank()]:
            send[:lengths[rank()]].copy_(torch.cat([tensors[i].reshape(-1) for i in idx]))
        recv = [torch.empty(longest, dtype=dtype) for _ in range(n)]
        works.append(dist.all_gather([_lend(r) for r in recv], _lend(send), async_op=True))
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
                out[i] = torch.cat(pieces[i])
        return out
    return _Grouped(works, finish)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: Any = global_process_set) -> Handle:
    return grouped_allgather_async([tensor], name, process_set).then_first()


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    with watchdog.guard(f"the allgather {name!r}"):
        return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather(tensors: list[torch.Tensor], name: Optional[str] = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> list[Any]:
    """Every rank's ``obj`` (pickled), in rank order."""
    _check_set(process_set)
    data = _pickled(obj)
    sizes = allgather(torch.tensor([data.numel()], dtype=torch.int64), name).tolist()
    everyone = allgather(data, name)
    return [pickle.loads(everyone[sum(sizes[:r]):sum(sizes[:r + 1])].numpy().tobytes())
            for r in range(len(sizes))]


# -- broadcast --------------------------------------------------------------------------------
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> Handle:
    _check_set(process_set)
    if size() == 1:
        return Handle([], lambda: tensor)
    work = dist.broadcast(_lend(tensor), src=root_rank, async_op=True)
    return Handle([work], lambda: tensor)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = global_process_set) -> Handle:
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> Any:
    """``root_rank``'s ``obj`` (pickled), on every rank."""
    _check_set(process_set)
    if size() == 1:
        return obj
    mine = rank() == root_rank
    data = _pickled(obj) if mine else None
    length = broadcast_(torch.tensor([0 if data is None else data.numel()]), root_rank, name)
    if mine:
        broadcast_(data, root_rank, name)
        return obj
    data = broadcast_(torch.empty(int(length), dtype=torch.uint8), root_rank, name)
    return pickle.loads(data.numpy().tobytes())


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Every rank takes ``root_rank``'s tensors, in place: ``params`` is a ``state_dict`` or
    ``named_parameters()`` (Horovod's contract: a dict is taken in sorted order)."""
    if isinstance(params, dict):
        items: Iterable = sorted(params.items())
    elif hasattr(params, "__iter__"):  # a list, or named_parameters()' generator
        items = list(params)
    else:
        raise ValueError(f"invalid params of type {type(params)}")
    handles = []
    for entry in items:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise ValueError("params must be a state_dict or a list of (name, tensor) pairs")
        _, p = entry
        if isinstance(p, torch.Tensor):
            handles.append(broadcast_async_(p, root_rank))
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Any = None) -> None:
    """Every rank takes ``root_rank``'s optimizer state (moments, step counts, learning
    rates and other per-group options)."""
    # the base class's state: hvdsync's wrapper adds its techniques' state to state_dict(),
    # which hvd.broadcast_optimizer_state broadcasts on its own (shared part only)
    state = broadcast_object(torch.optim.Optimizer.state_dict(optimizer), root_rank)
    if rank() != root_rank:
        torch.optim.Optimizer.load_state_dict(optimizer, state)
