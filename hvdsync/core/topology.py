"""Nodes, not GPUs: which ranks share a node (fast links inside, the network between), the
layout the two-level mode runs on (``between="nodes"``, docs/nodes.md).

It comes from the launcher: Horovod's ``HOROVOD_LOCAL_SIZE``/``HOROVOD_LOCAL_RANK``/
``HOROVOD_CROSS_RANK`` (hvdsync's ``init()`` sets them on torchrun too), else torchrun's
``LOCAL_WORLD_SIZE``/``LOCAL_RANK``/``GROUP_RANK``. Ranks are laid out node by node, as both
launchers assign them. ``HVDSYNC_RANKS_PER_NODE`` overrides it: one host acting as several
nodes (tests, single-host experiments). Nodes of unequal size are refused, with the reason.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hvdsync.safety import elastic

#: the values of ``between=``: the flat exchange (Horovod's), or two levels
BETWEEN = (None, "ranks", "nodes")
#: the environment variable that makes one host act as nodes of this many ranks
OVERRIDE = "HVDSYNC_RANKS_PER_NODE"

#: (local size, local rank, node) as each launcher names them
_LAUNCHERS = (("HOROVOD_LOCAL_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_CROSS_RANK"),
              ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK"))


@dataclass(frozen=True)
class Topology:
    """``size`` ranks on nodes of ``ranks_per_node`` each, node ``n`` holding the ranks
    ``n * ranks_per_node`` .. ``(n + 1) * ranks_per_node - 1``."""

    size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.size % self.ranks_per_node:
            raise ValueError(
                f"between='nodes' needs nodes of equal size: {self.size} ranks do not make "
                f"nodes of {self.ranks_per_node} (launch the same number of ranks on every "
                f"node, or set {OVERRIDE} to a divisor of {self.size})")

    @property
    def nodes(self) -> int:
        return self.size // self.ranks_per_node

    @property
    def two_level(self) -> bool:
        """Several nodes of several ranks: both levels have something to do (one node is
        Horovod's synchronous exchange; one rank per node, the flat one)."""
        return self.nodes > 1 and self.ranks_per_node > 1

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of node ``node`` (the fast level)."""
        first = node * self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))

    def cross_ranks(self, local_rank: int) -> list[int]:
        """The ranks with local rank ``local_rank``, one on each node (the slow level)."""
        return [n * self.ranks_per_node + local_rank for n in range(self.nodes)]


def from_environment(size: int, rank: int, env: Mapping[str, str] = os.environ) -> Topology:
    """This job's layout, as the launcher (or :data:`OVERRIDE`) describes it to ``rank`` of
    ``size``; a lone host without a launcher's word is one node. Raises ``ValueError`` where
    the ranks are not laid out node by node, or nodes differ in size."""
    if env.get(OVERRIDE):
        try:
            per_node = int(env[OVERRIDE])
        except ValueError:
            raise ValueError(f"{OVERRIDE} must be a whole number of ranks, got "
                             f"{env[OVERRIDE]!r}") from None
        return Topology(size, per_node)
    for local_size, local_rank, node in _LAUNCHERS:
        if local_size in env:
            per_node = int(env[local_size])
            topology = Topology(size, per_node)
            where = (int(env.get(local_rank, rank % per_node)),
                     int(env.get(node, rank // per_node)))
            if where != (topology.local_rank_of(rank), topology.node_of(rank)):
                raise ValueError(
                    f"between='nodes' needs the ranks laid out node by node; rank {rank} is "
                    f"local rank {where[0]} of node {where[1]} ({local_rank}, {node}), not "
                    f"{topology.local_rank_of(rank)} of {topology.node_of(rank)}")
            return topology
    return Topology(size, size)


def check_between(between: Any) -> Optional[str]:
    """``between=`` as given, checked: ``None`` or ``"ranks"`` (flat), ``"nodes"``."""
    if between not in BETWEEN:
        raise ValueError(f"between must be 'nodes' (the techniques between nodes, synchronous "
                         f"inside each) or 'ranks'/None (every rank alike, Horovod's way); got "
                         f"{between!r}")
    return "nodes" if between == "nodes" else None


def process_set_ranks(env: Mapping[str, str] = os.environ) -> list[list[int]]:
    """The ranks of every node, then of each local rank across the nodes, as the launcher
    lays the job out (read before ``init``): what an adapter's ``node_process_sets()``
    registers. Empty where the job is not several nodes of several ranks."""
    size = int(env.get("HOROVOD_SIZE", env.get("WORLD_SIZE", "1")))
    rank = int(env.get("HOROVOD_RANK", env.get("RANK", "0")))
    t = from_environment(size, rank, env)
    if not t.two_level:
        return []
    return ([t.node_ranks(n) for n in range(t.nodes)]
            + [t.cross_ranks(r) for r in range(t.ranks_per_node)])


@dataclass
class Communicators:
    """What an optimizer built with ``between=`` exchanges through: ``comm`` (every
    technique's collectives: between nodes in the two-level mode), ``node`` (the reduction
    inside the node, or ``None``), ``agree`` (the setup check: every rank), and how the job
    is laid out (``topology``; a string: why it cannot be, every rank then raises alike after
    the setup check), ``synchronous``: one node, so nothing runs between nodes."""

    comm: Any
    node: Any = None
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


def levels(between: Optional[str], process_set: Any, size: int, rank: int, make: Callable,
           two_level: Callable[[Topology], Communicators],
           techniques: list[str]) -> Communicators:
    """An adapter's :class:`Communicators` for ``between`` (``make(process_set, wire)``: a
    communicator, ``wire``: with the optimizer's compression): flat where ``between`` is
    ``None`` or the job reduces to it (one rank per node; one node: Horovod's synchronous
    exchange, every technique off), else ``two_level(topology)``'s. Flat on nodes of several
    ranks with ``techniques`` on: rank 0 says once what the two-level mode would change."""
    if between is None:
        advice = flat_advice(size, techniques) if rank == 0 and not _said else None
        if advice is not None:
            _said.append(True)
            warnings.warn(advice, RuntimeWarning, stacklevel=5)
        return Communicators(make(process_set, True))
    if process_set.ranks and len(process_set.ranks) != size:
        raise ValueError("between='nodes' runs over every rank: pass no process_set")
    if elastic.launched():  # (its process sets would have to be registered at every reset)
        raise NotImplementedError("between='nodes' does not run under Horovod Elastic yet; "
                                  "torchrun's restarts (--max-restarts) start it afresh")
    try:
        topology = from_environment(size, rank)
    except ValueError as e:  # (compared at the setup check, then raised on every rank)
        return Communicators(make(process_set, True), topology=str(e))
    if not topology.two_level:
        return Communicators(make(process_set, True), topology=topology,
                             synchronous=topology.nodes == 1)
    return two_level(topology)


_said: list[bool] = []  # (the flat job's advice, said once a process)


def flat_advice(size: int, techniques: list[str]) -> Optional[str]:
    """What rank 0 says once where a job of several nodes of several ranks runs
    ``techniques`` flat, or ``None``."""
    try:
        t = from_environment(size, 0)
    except ValueError:
        return None
    if not techniques or not t.two_level:
        return None
    return (f"hvdsync: this job is {t.nodes} nodes x {t.ranks_per_node} ranks, and "
            f"{', '.join(n + '=' for n in techniques)} treat every rank alike: their traffic "
            "inside a node is compressed, skipped or delayed as if it crossed the network. "
            "DistributedOptimizer(..., between='nodes') averages inside each node in full "
            "precision and runs them between nodes only, once per node (docs/nodes.md)")
