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
from collections.abc import Mapping
from dataclasses import dataclass

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
