"""Ready groups (docs/design.md, "Ready groups"): which of the layers backward makes ready go
together, and, where the engine pairs collectives by the order they start
(torch.distributed), the one fixed order layers are taken in -- last layer first, a layer
ready early held until those before it are taken, so that every rank starts the same
collectives in the same order (the no-hang rule). A group closes once its layers'
parameters weigh ``group_bytes`` (the step's first at ``first_group_bytes``): cut by the
parameters' bytes, never a sparse gradient's payload, every rank cuts the same groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

#: the default size of a ready group (torch DDP's bucket size: large enough that a model of
#: a few tens of MB is clipped in one or two groups, small enough that big models still send
#: while backward runs)
DEFAULT_GROUP_BYTES = 25 * 2**20
#: the step's first ready group closes sooner (DDP's first bucket): the layers backward makes
#: first start their sends while the rest of backward runs, even in a model of a few MB
FIRST_GROUP_BYTES = 2**20


def default_group_bytes(technique_names: list[str], fuses_by_itself: bool) -> tuple[int, int]:
    """The ready groups' sizes when the user gives none, for an adapter whose layers become
    ready during backward (torch's hooks): ``(group_bytes, first_group_bytes)``.
    Where the engine fuses by itself (Horovod's cycle) and only the plain exchange runs, every
    layer goes alone, the moment backward makes it ready, as Horovod's optimizer sends it (a
    group held back the first MiB: 1.06x Horovod's step on a bandwidth-bound ResNet, issue
    82). Else DDP's buckets: the techniques work a group at a time, and an engine that pairs
    by order sends a group in one collective."""
    if fuses_by_itself and list(technique_names) == ["plain"]:
        return 0, 0
    return DEFAULT_GROUP_BYTES, FIRST_GROUP_BYTES


class ReadyGroups:
    """Cuts one step's ready layers into groups. ``layer_bytes(li)``: layer ``li``'s
    parameters' bytes (asked once per layer); ``in_order``: layers are taken in one fixed
    order (the engine pairs collectives by order)."""

    def __init__(self, n_layers: int, layer_bytes: Callable[[int], int], group_bytes: int,
                 first_group_bytes: Optional[int] = None, in_order: bool = False):
        self.n = n_layers
        self.group_bytes = group_bytes
        self.first_group_bytes = group_bytes if first_group_bytes is None else first_group_bytes
        self._bytes_of = layer_bytes
        self._bytes: dict[int, int] = {}  # (static: the parameters' bytes)
        #: the order layers are taken in (None: as they come, Horovod pairs by name)
        self.order: Optional[list[int]] = list(reversed(range(n_layers))) if in_order else None
        self.new_step()

    def new_step(self) -> None:
        self._arrived = [False] * self.n  # ready from backward, maybe not taken yet
        self._taken = 0  # how many of ``order`` are taken
        #: taken, waiting for the rest of their group
        self.open: list[int] = []
        self._size = 0
        self._limit = self.first_group_bytes

    def arrive(self, li: int) -> list[list[int]]:
        """Layer ``li`` is ready: the groups that close now, in order (most often none; where
        layers are taken in order, a layer may release several held back for it)."""
        if self.order is None:
            return self.join(li)
        self._arrived[li] = True
        order, closed = self.order, []
        while self._taken < self.n and self._arrived[order[self._taken]]:
            self._taken += 1
            closed += self.join(order[self._taken - 1])
        return closed

    def join(self, li: int) -> list[list[int]]:
        """Layer ``li`` joins the open group; it closes if big enough (returned)."""
        self.open.append(li)
        size = self._bytes.get(li)
        if size is None:
            size = self._bytes[li] = self._bytes_of(li)
        self._size += size
        return [self.close()] if self._size >= self._limit else []

    def close(self) -> list[int]:
        """The open group, closed now (empty if none); the next one is a later group."""
        group, self.open, self._size = self.open, [], 0
        self._limit = self.group_bytes
        return group

    def rest(self, missing: list[int]) -> list[tuple[int, bool]]:
        """At the end of backward, the layers not taken yet in the order to take them, each
        with whether it arrived (held back by an earlier layer: it only joins) or not (one of
        ``missing``: filled first)."""
        if self.order is None:
            return [(li, False) for li in missing]
        return [(li, self._arrived[li]) for li in self.order[self._taken:]]
