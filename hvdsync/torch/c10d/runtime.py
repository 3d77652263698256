"""Where :mod:`hvdsync.torch.c10d`'s collectives run: a :class:`Runtime` -- a process group's
API and the state of the collectives on it -- given to the module, the process's own
(:data:`PROCESS`, torch.distributed) or a thread's (:func:`running_on`: simulated ranks run
the same module over an in-memory group, no copy of it)."""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from hvdsync.torch.c10d.calls import Lane


class Runtime:
    """What :mod:`hvdsync.torch.c10d`'s collectives run on: ``api``, the part of
    ``torch.distributed`` they call (``is_initialized``, ``get_rank``, ``get_world_size``,
    ``all_reduce``, ``all_gather``, ``reduce_scatter_single``, ``broadcast``, ``barrier``,
    ``all_to_all_single``), and
    what they keep while they run: the tensors lent to it, a script's named collectives in
    flight. The process runs on torch.distributed (:data:`PROCESS`); a thread may run on a
    runtime of its own (:func:`running_on`: the simulated ranks of
    :mod:`hvdsync.testing.simulated`), which ``init()`` and ``shutdown()`` leave as it is
    (``joins=False``)."""

    def __init__(self, api: Any, joins: bool = True):
        self.api = api
        self.joins = joins
        self.lent: list[torch.Tensor] = []
        self.in_flight: dict[str, Any] = {}  # name -> c10d.Handle
        self.lanes: dict[Any, Any] = {}  # c10d group -> its lane.Lane (joins only)

    def lane(self, group: Any) -> Any:
        """The :class:`~hvdsync.torch.c10d.calls.Lane` of ``group`` (``None``: every rank)."""
        lane = self.lanes.get(group)
        if lane is None:
            lane = self.lanes[group] = Lane("world" if group is None else str(len(self.lanes)),
                                            lambda: running_on(self))
        return lane


_thread = threading.local()  # .runtime: this thread's own (running_on)
_lending = threading.Lock()


@contextmanager
def running_on(runtime: Runtime) -> Iterator[None]:
    """Within the block, this thread's collectives run on ``runtime``."""
    outer = getattr(_thread, "runtime", None)
    _thread.runtime = runtime
    try:
        yield
    finally:
        _thread.runtime = outer


def current() -> Runtime:
    """This thread's runtime: its own, else the process's."""
    return getattr(_thread, "runtime", None) or PROCESS


# -- tensors lent to c10d ---------------------------------------------------------------------
# Gloo's worker thread drops a finished work a moment after wait() has returned. If a tensor the
# work holds has no Python reference left by then, dropping it needs the GIL, and a thread that
# asks for the GIL while the interpreter shuts down is ended mid-destructor: the process aborts
# ("terminate called without an active exception"). So c10d only ever gets aliases (their own
# reference count, same storage) that stay referenced here until c10d has let go of them, and
# at exit we wait (a moment, bounded) for that before the interpreter tears down.
def lend(tensor: torch.Tensor) -> torch.Tensor:
    """An alias of ``tensor`` for c10d (same storage), kept until c10d has dropped it."""
    lent = current().lent
    alias = tensor.detach()
    with _lending:  # (a lane's thread lends too: hvdsync.torch.c10d.calls)
        lent[:] = [t for t in lent if t._use_count() > 1]
        lent.append(alias)
    return alias


@atexit.register
def _await_returns(limit_s: float = 2.0) -> bool:
    """Wait until c10d has dropped every lent tensor (bounded: a collective that never
    finished keeps its own); whether it had. Runs at exit."""
    deadline, lent = time.monotonic() + limit_s, PROCESS.lent
    while any(t._use_count() > 1 for t in lent) and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL that Gloo's threads need to drop their works
    returned = all(t._use_count() == 1 for t in lent)
    lent.clear()
    return returned


#: the process's own runtime: torch.distributed's default process group
PROCESS = Runtime(dist)
