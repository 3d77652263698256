"""Collectives in flight: :class:`Pending`, what every transport returns and every
communicator gives (docs/design.md, "One lifecycle: roles and moments")."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional

from hvdsync.safety.watchdog import guard


class Pending:
    """Collectives in flight. ``wait()`` finishes them and returns their result (the first
    call does the work; later calls return the same result); ``ready()`` says, without
    blocking, whether ``wait()`` would return at once. ``nbytes`` and ``collectives`` are
    what this rank handed to Horovod for it (for :class:`hvdsync.core.stats.SyncStats`)."""

    nbytes: int
    collectives: int
    what: str

    def __init__(self, wait: Optional[Callable[[], Any]] = None,
                 ready: Optional[Callable[[], bool]] = None, nbytes: int = 0,
                 collectives: int = 0, what: str = "a collective", guarded: bool = True):
        self.what = what  # for the watchdog's message
        self._wait = wait
        self._ready = ready
        self._done = wait is None
        self._result: Any = None
        self.nbytes = nbytes
        self.collectives = collectives
        self._guarded = guarded  # False: it waits for others whose wait() is guarded
        #: run before the first wait: the communicator's check of the entry tags started
        #: before this collective (hvdsync.safety.entries), which raises if the ranks entered apart
        self.before: Optional[Callable[[], None]] = None

    @classmethod
    def resolved(cls, result: Any = None) -> "Pending":
        """A pending that is already finished with ``result`` (nothing was sent)."""
        p = cls()
        p._result = result
        return p

    def wait(self) -> Any:
        if not self._done:
            self._checked()
            if self._guarded:
                with guard(self.what):
                    self._result = self._wait()
            else:
                self._result = self._wait()
            self._done = True
            self._wait = self._ready = None
        return self._result

    def _checked(self) -> None:
        """Run :attr:`before` once, ahead of the first wait."""
        if self.before is not None:
            before, self.before = self.before, None
            before()

    def wait_idle(self) -> Any:
        """:meth:`wait`, without keeping a core busy meanwhile: polls :meth:`ready` with
        short sleeps first. Horovod's torch ``synchronize()`` spins (a 4 s wait used 5.8 s
        of CPU), which on a CPU rank takes the core from the threads that move the data and
        from the other ranks of a shared host. For waits on background exchanges that can
        be polled; a pending that cannot be polled is simply waited for."""
        if not self._done and self._ready is not None:
            self._checked()
            with guard(self.what):
                self.ready_within(math.inf)
        return self.wait()

    def ready_within(self, seconds: float) -> bool:
        """Whether it becomes ready within ``seconds``, polling with short sleeps instead of
        spinning: 20 us, growing to 200 us (a step of a few ms must not lose one to a sleep
        that outlasts the exchange; longer ones poll 5000 times a second at most)."""
        deadline, sleep = time.monotonic() + seconds, 2e-5
        while not self.ready():
            if time.monotonic() > deadline:
                return False
            time.sleep(sleep)
            sleep = min(1.5 * sleep, 2e-4)
        return True

    def ready(self) -> bool:
        if self._done:
            return True
        return self._ready is not None and self._ready()

    def used(self) -> None:
        """Its result went into an update: a transport that lends memory to an exchange
        (``lowrank=``'s error feedback inside ``delay=``) commits it here. Nothing by
        default."""

    def discard(self) -> None:
        """Its result is dropped unused (a flush, a restore): what the exchange took from a
        technique's memory goes back. Nothing by default."""

    def then(self, fn: Callable[[Any], Any]) -> "Pending":
        """A pending that waits for this one and returns ``fn(result)``; same counts."""
        return Pending(lambda: fn(self.wait()), self.ready, self.nbytes, self.collectives,
                       self.what, guarded=False)  # (this one's wait() is guarded already)


def wait_all(pendings: Sequence[Pending]) -> list:
    """Every pending's :meth:`Pending.wait`, in order: their results."""
    return [p.wait() for p in pendings]


def finish_dropped(pendings: Sequence[Pending], what: str) -> list[Pending]:
    """Wait for collectives whose results are thrown away; one that fails is dropped with them
    (one ``RuntimeWarning`` for all, naming ``what``): it belonged to a world that is gone --
    Horovod Elastic restores the last commit after a rank died, and the collectives in flight
    then can only raise. Returns the ones that finished."""
    finished, failed = [], []
    for p in pendings:
        try:
            p.wait()
            finished.append(p)
        except Exception as e:  # noqa: BLE001 - its results are discarded anyway
            failed.append(e)
    if failed:
        warnings.warn(f"hvdsync: {len(failed)} collective(s) of {what} failed ({failed[0]}); "
                      "dropped with them", RuntimeWarning, stacklevel=3)
    return finished
