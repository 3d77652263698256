"""The two-level mode on torch (``between="nodes"``, docs/nodes.md): inside a node every
layer's gradient is averaged in full precision as backward makes it ready; between nodes the
techniques run on that node gradient, over the ranks of one local rank across the nodes, so
each keeps its meaning per layer (clip's norm, a decider's statistics, sparse's rows, lowrank's
factors and delay's replicas are the node's). Every rank of a node runs the same exchange on
the same values, so the replicas of a node stay identical.

Horovod registers process sets at ``init`` (adding them later needs its dynamic mode, which
slows every collective): ``hvd.init(process_sets=hvd.node_process_sets())``. The torch engine
adds them when an optimizer asks.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from hvdsync.core.stats import SyncStats
from hvdsync.core.topology import Communicators, Topology, levels, process_set_ranks
from hvdsync.core.wire import Pending
from hvdsync.torch import engine
from hvdsync.torch.comm import payload_bytes

#: the process sets :func:`node_process_sets` gave, by their ranks (and the torch engine's)
_REGISTERED: dict[tuple[int, ...], Any] = {}


def node_process_sets() -> list:
    """Every node's process set, then each local rank's across the nodes, as this job is laid
    out (:mod:`hvdsync.core.topology`): ``hvd.init(process_sets=hvd.node_process_sets())``
    registers what ``between="nodes"`` runs on (Horovod: at init). Empty where the job is
    not several nodes of several ranks."""
    ops = engine.ops()  # (the engine chosen, else the one init() will choose)
    return [_REGISTERED.setdefault(tuple(r), ops.ProcessSet(r)) for r in process_set_ranks()]


def communicators(between: Optional[str], process_set: Any, make: Any, stats: SyncStats,
                  techniques: list[str]) -> Communicators:
    """The communicators of an optimizer with ``between=`` (``make(process_set, wire, op)``
    builds one, ``wire``: with the optimizer's compression, else full precision; ``op``: a
    reduction other than the optimizer's; :func:`hvdsync.core.topology.levels`)."""
    ops = engine.ops()

    def two_level(topology: Topology) -> Communicators:
        rank = ops.rank()
        node = _registered(topology.node_ranks(topology.node_of(rank)))
        cross = _registered(topology.cross_ranks(topology.local_rank_of(rank)))
        # (collectives start in one order on every rank, as on torch.distributed: a node's
        # reduction blocks, and two ranks waiting in different orders would wait on each other)
        comm = OwnedCross(make(cross, True), make(node, False, ops.Sum),
                          topology.local_rank_of(rank), topology.ranks_per_node, stats)
        return Communicators(comm, NodeReduce(make(node, False), stats),
                             make(process_set, True), topology)
    return levels(between, process_set, ops.size(), ops.rank(), make, two_level, techniques)


def _registered(ranks: list[int]) -> Any:
    found = _REGISTERED.get(tuple(ranks))
    if found is not None and found.process_set_id is not None:
        return found
    if engine.active_name() == "horovod":
        raise RuntimeError("between='nodes' on Horovod runs on process sets registered at "
                           "init: call hvd.init(process_sets=hvd.node_process_sets())")
    for r in node_process_sets():  # the torch engine adds them now (every rank, in order)
        if r.process_set_id is None:
            engine.ops().add_process_set(r)
    return _REGISTERED[tuple(ranks)]


class NodeReduce:
    """Averages (or sums, with ``op=Sum``) each ready layer's gradients inside the node, in
    full precision, before anything else sees them; counts the bytes (``bytes_intra_node``)."""

    def __init__(self, comm: Any, stats: SyncStats):
        self.comm, self.stats = comm, stats

    def __call__(self, layers: list[list[Optional[torch.Tensor]]], name: str) -> None:
        grads = [g for layer in layers for g in layer if g is not None]
        if grads:
            pending = self.comm.allreduce(f"hvdsync.node.{name}", grads)
            pending.wait()
            self.stats.count("bytes_intra_node", pending.nbytes)


class OwnedCross:
    """The cross-node communicator of a rank in the two-level mode. Each of the techniques'
    data collectives is run by one rank of the node -- its *owner*, the local rank with the
    fewest bytes so far: the same choice on every rank of the node, which make the same calls
    in the same order -- and its result is shared inside the node, an allreduce of sums to
    which the others bring zeros (the same bits). So a node's link carries one worker's bytes,
    not one per rank; and a rank's cross-node peers (the same local rank on every node) own the
    same collectives, so none waits for a peer that sends nothing. What is small or differs
    between a node's ranks (control rounds, entry tags, the setup's gathers) every rank runs
    itself."""

    def __init__(self, cross: Any, share: Any, local_rank: int, local_size: int,
                 stats: SyncStats):
        self._cross, self._share, self._me, self._stats = cross, share, local_rank, stats
        self._load = [0] * local_size  # bytes each local rank has run so far
        self.matches_by_name = False  # (see communicators())

    def __getattr__(self, name: str) -> Any:  # the rest is the cross-node communicator's
        return getattr(self._cross, name)

    @property
    def size(self) -> int:
        return self._cross.size

    def _owner(self, nbytes: int) -> int:
        owner = min(range(len(self._load)), key=lambda r: (self._load[r], r))
        self._load[owner] += max(nbytes, 1)
        return owner

    def _owned(self, nbytes: int, start: Any, share: Any, what: str) -> Pending:
        """``start()`` (a pending) on the owner of ``nbytes``; at the first wait -- on every
        rank at the same point of its calls -- ``share(its result, or None on the others)``
        gives the result inside the node and the bytes that took."""
        inner = start() if self._owner(nbytes) == self._me else None

        def wait() -> Any:
            result, sent = share(inner.wait() if inner is not None else None)
            self._stats.count("bytes_intra_node", sent)
            return result
        return Pending(wait, inner.ready if inner is not None else lambda: True,
                       inner.nbytes if inner is not None else 0,
                       inner.collectives if inner is not None else 0,
                       what=f"{what} (shared inside the node)")

    def _owned_in_place(self, name: str, tensors: list, start: Any, what: str) -> Pending:
        """:meth:`_owned` for a ``start()`` whose result is ``tensors``, reduced in place: the
        others bring zeros to the sharing sum."""
        def share(got: Any) -> tuple[list, int]:
            if got is None:
                for t in tensors:
                    t.zero_()
            return tensors, _shared(self._share, f"{name}.shared", tensors)
        return self._owned(sum(payload_bytes(t) for t in tensors), start, share, what)

    def allreduce(self, name: str, tensors: list) -> Pending:
        tensors = list(tensors)
        if self.size == 1 or any(t.is_sparse for t in tensors):  # (Horovod's sparse path)
            return self._cross.allreduce(name, tensors)
        return self._owned_in_place(name, tensors,
                                    lambda: self._cross.allreduce(name, tensors),
                                    f"the allreduce {name!r}")

    def allgather_async(self, name: str, tensors: list) -> Pending:
        """Every node's 1-d ``tensors`` alike in size (an encoding's parts): gathered by the
        owner, shared inside the node."""
        if self.size == 1:
            return self._cross.allgather_async(name, tensors)
        out = [t.new_zeros(t.numel() * self.size) for t in tensors]

        def start() -> Pending:
            return self._cross.allgather_async(name, tensors).then(
                lambda got: [o.copy_(g) for o, g in zip(out, got)])
        return self._owned_in_place(name, out, start, f"the allgather {name!r}")

    def sum_rows(self, name: str, tensors: list) -> Pending:
        """``sparse=``'s dense route: summed across nodes by the owner, shared inside."""
        if self.size == 1:
            return self._cross.sum_rows(name, tensors)
        return self._owned_in_place(name, list(tensors),
                                    lambda: self._cross.sum_rows(name, tensors),
                                    f"the allreduce {name!r}")

    def gather_rows(self, name: str, tensors: list) -> Pending:
        """``sparse=``'s rows (a node's ranks hold the same node gradient, so the same rows):
        gathered by the owner; inside the node, the gathered row counts, then the rows."""
        if self.size == 1:
            return self._cross.gather_rows(name, tensors)

        def share(got: Any) -> tuple[list, int]:
            rows = torch.tensor([g.shape[0] for g in got] if got is not None
                                else [0] * len(tensors), dtype=torch.int64)
            nbytes = _shared(self._share, f"{name}.rows", [rows])
            out = got if got is not None else [t.new_zeros((n, *t.shape[1:])) for t, n in
                                               zip(tensors, rows.tolist())]
            return out, nbytes + _shared(self._share, f"{name}.shared", out)
        # the owner by a row's bytes, the same on every node (their row counts differ, and
        # the same local rank must own this gather on every node, or its peers wait apart)
        return self._owned(sum(math.prod(t.shape[1:]) * t.element_size() for t in tensors),
                           lambda: self._cross.gather_rows(name, tensors), share,
                           f"the allgather {name!r}")

    def average(self, groups: list[tuple[str, list]]) -> None:
        """The parameters averaged across nodes by one rank of the node, shared inside it."""
        if self.size == 1:
            return
        tensors = [t for _, ts in groups for t in ts]
        self._owned_in_place(f"hvdsync.outer.average.{groups[0][0]}", tensors,
                             lambda: _done(self._cross.average(groups), tensors),
                             "the parameter averaging").wait()


def _shared(comm: Any, name: str, tensors: list) -> int:
    """Sum ``tensors`` over the node in place -- one rank's values, the others' zeros: the
    same bits -- as one buffer of their bytes in int32 words (any dtype: Horovod sums no
    8-bit one); returns the bytes sent."""
    raw = [t.contiguous().view(-1).view(torch.uint8) for t in tensors]
    n = sum(r.numel() for r in raw)
    words = torch.cat(raw + [torch.zeros((-n) % 4, dtype=torch.uint8)]).view(torch.int32)
    pending = comm.allreduce(name, [words])
    pending.wait()
    out, at = words.view(torch.uint8), 0
    for t, r in zip(tensors, raw):
        t.view(-1).view(torch.uint8).copy_(out[at:at + r.numel()])
        at += r.numel()
    return pending.nbytes


def _done(_: Any, result: list) -> Pending:
    """A pending already finished with ``result`` (what a blocking call left in place)."""
    return Pending.resolved(result)
