"""Horovod's process sets on the torch engine: each one a c10d group.

Horovod: a :class:`ProcessSet` is a sorted list of ranks, registered on every rank
(``hvd.init(process_sets=[...])`` or ``hvd.add_process_set``) and passed as ``process_set=`` to
a collective or to ``DistributedOptimizer``; ranks are global ranks everywhere (a broadcast's
``root_rank`` too), ``ps.rank()`` is the place in the set. The same holds here; c10d makes a
group collectively, so :func:`add_process_set` runs on every rank, in the same order, as
Horovod requires. docs/backends.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch.distributed as dist

from hvdsync.torch import engine


class ProcessSet:
    """A subset of the ranks that run collectives together (a c10d group). Make one with
    ``hvd.add_process_set`` on every rank, or pass it to ``hvd.init(process_sets=[...])``."""

    def __init__(self, ranks: Sequence[int]):
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise ValueError("ProcessSet takes a list of ranks (the torch engine has no MPI "
                             f"communicators); got {ranks!r}")
        ranks = sorted(ranks)
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet takes a list of integer ranks; got {ranks!r}")
        self.ranks: list[int] = ranks
        self.process_set_id: Optional[int] = None

    def size(self) -> Optional[int]:
        """How many ranks the set has (``None`` until added)."""
        if self.process_set_id is None:
            return None
        return len(self.ranks) if self.ranks else engine.ops().size()

    def rank(self) -> Optional[int]:
        """This rank's place in the set (``None`` until added, -1 outside it)."""
        if self.process_set_id is None:
            return None
        me = engine.ops().rank()
        if not self.ranks:
            return me
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool:
        """Whether this rank is in the set."""
        return not self.ranks or engine.ops().rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])  # every rank: Horovod's id 0
global_process_set.process_set_id = 0
_added: dict[int, tuple[ProcessSet, Any]] = {}  # process_set_id -> (set, its c10d group)


def add_process_set(process_set: Any) -> ProcessSet:
    """Make ``process_set`` (a :class:`ProcessSet` or a list of ranks) usable and return it.
    Every rank calls it, in the same order."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    world = engine.ops().size()
    if not ps.ranks or any(r < 0 or r >= world for r in ps.ranks) or len(set(ps.ranks)) < len(
            ps.ranks):
        raise ValueError(f"a process set needs distinct ranks in [0, {world}); got {ps.ranks}")
    if ps.ranks == list(range(world)) or any(s.ranks == ps.ranks for s, _ in _added.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    group = dist.new_group(ps.ranks)
    ps.process_set_id = max([0, *_added]) + 1
    _added[ps.process_set_id] = (ps, group)
    return ps


def remove_process_set(process_set: Any) -> bool:
    """Retire ``process_set`` (never the global one); whether it was added. Every rank calls
    it."""
    pid = getattr(process_set, "process_set_id", None)
    if not pid or pid not in _added:
        return False
    ps, group = _added.pop(pid)
    if ps.included():
        dist.destroy_process_group(group)
    ps.process_set_id = None
    return True


def forget_process_sets() -> None:
    """At shutdown: every added set is gone with the process group."""
    for ps, _ in _added.values():
        ps.process_set_id = None
    _added.clear()


def group_of(process_set: Any) -> Any:
    """The c10d group of ``process_set`` (``None``: every rank). A set this rank is not in, or
    one never added, is an error, as on Horovod."""
    pid = getattr(process_set, "process_set_id", None)
    if pid == 0:  # Horovod's own global set object too
        return None
    if pid not in _added:
        raise ValueError(f"{process_set!r} was not added: call hvd.add_process_set on every "
                         "rank first (or pass it to hvd.init(process_sets=[...]))")
    if not process_set.included():
        raise ValueError(f"rank {engine.ops().rank()} is not in {process_set!r}; only its ranks "
                         "may use it")
    return _added[pid][1]
