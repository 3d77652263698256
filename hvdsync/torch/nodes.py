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

import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hvdsync.core.stats import SyncStats
from hvdsync.core.topology import Topology, from_environment
from hvdsync.torch import engine

#: the values of ``between=``: the flat exchange (Horovod's), or two levels
BETWEEN = (None, "ranks", "nodes")
#: the process sets :func:`node_process_sets` gave, by their ranks (and the torch engine's)
_REGISTERED: dict[tuple[int, ...], Any] = {}


def check_between(between: Any) -> Optional[str]:
    """``between=`` as given, checked: ``None`` or ``"ranks"`` (flat), ``"nodes"``."""
    if between not in BETWEEN:
        raise ValueError(f"between must be 'nodes' (the techniques between nodes, synchronous "
                         f"inside each) or 'ranks'/None (every rank alike, Horovod's way); got "
                         f"{between!r}")
    return "nodes" if between == "nodes" else None


def _job_topology() -> Topology:
    """The launcher's layout, read before ``init`` (Horovod's or torchrun's variables)."""
    env = os.environ
    size = int(env.get("HOROVOD_SIZE", env.get("WORLD_SIZE", "1")))
    rank = int(env.get("HOROVOD_RANK", env.get("RANK", "0")))
    return from_environment(size, rank)


def node_process_sets() -> list:
    """Every node's process set, then each local rank's across the nodes, as this job is laid
    out (:mod:`hvdsync.core.topology`): ``hvd.init(process_sets=hvd.node_process_sets())``
    registers what ``between="nodes"`` runs on (Horovod: at init). Empty where the job is
    not several nodes of several ranks."""
    topology = _job_topology()
    if not topology.two_level:
        return []
    ops = engine.ops()  # (the engine chosen, else the one init() will choose)
    ranks = ([topology.node_ranks(n) for n in range(topology.nodes)]
             + [topology.cross_ranks(r) for r in range(topology.ranks_per_node)])
    return [_REGISTERED.setdefault(tuple(r), ops.ProcessSet(r)) for r in ranks]


@dataclass
class Communicators:
    """What an optimizer built with ``between=`` exchanges through: ``comm`` (every
    technique's collectives: between nodes in the two-level mode), ``node`` (the reduction
    inside the node, or ``None``), ``agree`` (the setup check: every rank), and how the job
    is laid out (``topology``; a string: why it cannot be, every rank then raises alike after
    the setup check), ``synchronous``: one node, so nothing runs between nodes."""

    comm: Any
    node: Optional["NodeReduce"] = None
    agree: Any = None
    topology: Any = None
    synchronous: bool = False

    def describe(self) -> str:
        """The levels, for the statistics' summary."""
        t = self.topology
        if not isinstance(t, Topology):
            return ""
        what = ("synchronous inside it, as Horovod: no technique runs" if self.synchronous
                else "one rank per node: the flat exchange" if t.ranks_per_node == 1
                else "full precision inside each, the techniques between them")
        return (f"between='nodes': {t.nodes} node{'s' * (t.nodes != 1)} x "
                f"{t.ranks_per_node} rank{'s' * (t.ranks_per_node != 1)}, {what}")


def communicators(between: Optional[str], process_set: Any, make: Any, stats: SyncStats,
                  techniques: list[str]) -> Communicators:
    """The communicators of an optimizer with ``between=`` (``make(process_set, wire)``
    builds one, ``wire``: with the optimizer's compression, else full precision): flat where
    ``between`` is ``None`` or the job reduces to it (one rank per node; one node: Horovod's
    synchronous exchange, every technique off). Flat on nodes of several ranks with
    ``techniques`` on: rank 0 says once what the two-level mode would change."""
    if between is None:
        _say_once(techniques)
        return Communicators(make(process_set, True))
    ops = engine.ops()
    if process_set.ranks and len(process_set.ranks) != ops.size():
        raise ValueError("between='nodes' runs over every rank: pass no process_set")
    try:
        topology = from_environment(ops.size(), ops.rank())
    except ValueError as e:  # (compared at the setup check, then raised on every rank)
        return Communicators(make(process_set, True), topology=str(e))
    if not topology.two_level:
        return Communicators(make(process_set, True), topology=topology,
                             synchronous=topology.nodes == 1)
    rank = ops.rank()
    node = _registered(topology.node_ranks(topology.node_of(rank)))
    cross = _registered(topology.cross_ranks(topology.local_rank_of(rank)))
    comm = make(cross, True)
    # one order on every rank, as on torch.distributed: a node reduction blocks, and two
    # ranks waiting in different orders would wait on each other
    comm.matches_by_name = False
    return Communicators(comm, NodeReduce(make(node, False), stats), make(process_set, True),
                         topology)


_said: list[bool] = []


def _say_once(techniques: list[str]) -> None:
    if _said or not techniques or engine.ops().rank() != 0:
        return
    try:
        topology = from_environment(engine.ops().size(), 0)
    except ValueError:
        return
    if topology.two_level:
        _said.append(True)
        warnings.warn(
            f"hvdsync: this job is {topology.nodes} nodes x {topology.ranks_per_node} ranks, "
            f"and {', '.join(t + '=' for t in techniques)} treat every rank alike: their "
            "traffic inside a node is compressed, skipped or delayed as if it crossed the "
            "network. DistributedOptimizer(..., between='nodes') averages inside each node in "
            "full precision and runs them between nodes only, once per node (docs/nodes.md)",
            RuntimeWarning, stacklevel=5)


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
