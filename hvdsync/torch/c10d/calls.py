"""A collective in flight on the torch engine: its :class:`Handle`, and the :class:`Lane`
that starts a rank's calls in order without waiting for its peers at the call.

c10d pairs the collectives of a group by the order each rank starts them. A script's call is
checked first (its descriptor gathered from every rank: :mod:`hvdsync.torch.c10d.checks`),
and an uneven one sends its sizes first: both wait for the peers. Horovod's ``*_async`` calls
return at once, so these waits run on a lane, one worker thread per group, which starts the
calls one after another in the order this rank made them; the call returns a handle at once,
and :func:`synchronize` waits for the lane, then the data. A call that waits for nobody
(hvdsync's own: unchecked, equal sizes) starts on the caller's thread while the lane is idle:
the same order, no thread hop. Simulated ranks start every call on their own thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

from hvdsync.safety import watchdog


def _bounded(what: Optional[str]) -> Any:
    """The watchdog's guard of a wait for ``what``; none where ``what`` is ``None``."""
    return watchdog.guard(what) if what else nullcontext()


_here = threading.local()  # .waiting: this thread starts a call it waits for at once


@contextmanager
def waiting() -> Iterator[None]:
    """Within the block, a call started is waited for at once (a blocking form): where its
    lane is idle, this thread runs what it waits for before its data moves, no hop."""
    outer, _here.waiting = getattr(_here, "waiting", False), True
    try:
        yield
    finally:
        _here.waiting = outer


class Queued:
    """A call waiting on its lane: once started, the handle its start gave, or the error it
    raised."""

    __slots__ = ("job", "lane", "ready", "inner", "error")

    def __init__(self, job: Callable[[], Any], lane: "Lane"):
        self.job: Optional[Callable[[], Any]] = job
        self.lane = lane
        self.ready = threading.Event()
        self.inner: Any = None
        self.error: Optional[BaseException] = None


class Lane:
    """The calls of one group on this rank, started in call order (see the module doc). A
    call is started by the lane's thread, or by the caller's where it waits for that call
    first and nothing runs before it (a blocking call: no thread hop)."""

    def __init__(self, name: str, context: Callable[[], Any]):
        self.name = name
        self._context = context  # the block a job runs in (its runtime: running_on)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._jobs: deque[Queued] = deque()
        self._runner: Optional[int] = None  # the thread that runs a call now
        self._worker: Optional[threading.Thread] = None

    def start(self, job: Callable[[], Any], waits: bool) -> Any:
        """Start ``job`` (it starts the collectives and returns their handle) after every
        call this rank made before; ``waits``: whether it waits for the peers before its
        data moves. Returns the handle, or a :class:`Queued` one where it is not started
        yet."""
        if threading.get_ident() == self._runner:
            return job()  # a call a running job makes (the readable form of a mismatch)
        with self._lock:
            idle = self._runner is None and not self._jobs
            if idle and not waits:
                return job()  # nothing before it: started here, still in order
            if not (idle and getattr(_here, "waiting", False)):
                queued = Queued(job, self)
                self._jobs.append(queued)
                if self._worker is None:
                    self._worker = threading.Thread(target=self._run, daemon=True,
                                                    name=f"hvdsync-c10d-{self.name}")
                    self._worker.start()
                self._wake.notify()
                return queued
            self._runner = threading.get_ident()  # a blocking form: it waits here anyway
        try:
            return job()
        finally:
            self._release()

    def run_here(self, queued: Queued) -> None:
        """The caller waits for ``queued`` now: where it is next and nothing runs, this
        thread starts it."""
        with self._lock:
            if self._runner is not None or not self._jobs or self._jobs[0] is not queued:
                return
            self._jobs.popleft()
            self._runner = threading.get_ident()
        self._run_one(queued)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._jobs or self._runner is not None:
                    self._wake.wait()
                queued = self._jobs.popleft()
                self._runner = threading.get_ident()
            self._run_one(queued)
            queued = None  # (nothing of a started call stays referenced here)

    def _run_one(self, queued: Queued) -> None:
        try:
            with self._context():
                queued.inner = queued.job()
        except BaseException as e:  # noqa: BLE001 -- raised at synchronize, on the caller
            queued.error = e
        # c10d's works hold the tensors lent to them until they are dropped
        # (hvdsync.torch.c10d.runtime.lend): the job's closure goes now
        queued.job = None
        self._release()
        queued.ready.set()

    def _release(self) -> None:
        """The running call has started: the next may."""
        with self._lock:
            self._runner = None
            if self._jobs:
                self._wake.notify()

    def close(self, why: str) -> None:
        """Calls not started yet fail with ``why`` (the process group is going away)."""
        with self._lock:
            while self._jobs:
                queued = self._jobs.popleft()
                queued.error = RuntimeError(why)
                queued.ready.set()


class HorovodInternalError(RuntimeError):
    """Horovod's error for a collective that failed: ranks that called it differently, a rank
    that left the job."""


# -- handles ----------------------------------------------------------------------------------
class Handle:
    """An operation in flight: c10d works, and what turns their buffers into the result; or
    ``queued``, a call its :class:`Lane` has not started yet."""

    __slots__ = ("works", "finish", "result", "done", "queued", "first", "what")

    def __init__(self, works: list, finish: Optional[Callable[[], Any]],
                 queued: Optional[Queued] = None):
        self.works, self.finish, self.done, self.queued = works, finish, False, queued
        self.result: Any = None
        self.first = False
        #: what the watchdog names while this handle is waited for (``None``: not bounded,
        #: not reported: ``hvd.join()`` waits for the slowest rank's data)
        self.what: Optional[str] = "a collective the script started (hvd.synchronize)"

    def then_first(self) -> "Handle":
        """This handle, giving the first of its results (one tensor of a grouped call)."""
        self.first = True
        return self

    def started(self) -> None:
        """Wait for the lane to start this call (bounded, reported if it stalls); raises
        what the start raised (a mismatch: ``HorovodInternalError``)."""
        queued, self.queued = self.queued, None
        if queued is None:
            return
        if not queued.ready.is_set():
            queued.lane.run_here(queued)
        if not queued.ready.is_set():
            with _bounded(self.what and f"the start of {self.what} (its check waits for the "
                          "peers)"):
                queued.ready.wait()
        if queued.error is not None:
            raise queued.error
        self.works, self.finish = queued.inner.works, queued.inner.finish
        queued.inner = None


def poll(handle: Handle) -> bool:
    """Whether ``handle``'s collectives have completed (a later :func:`synchronize` will not
    block)."""
    if not isinstance(handle, Handle):
        raise ValueError(f"Handle {handle!r} was not created or has been cleared.")  # Horovod's
    if handle.done:
        return True
    queued = handle.queued
    if queued is not None:
        if not queued.ready.is_set():
            return False
        if queued.error is not None:
            return True  # (synchronize raises it)
        return all(w.is_completed() for w in queued.inner.works)
    return all(w.is_completed() for w in handle.works)


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle`` and return its result (a tensor, or a list for grouped calls). A
    collective that failed (a rank left, a connection closed) raises
    ``HorovodInternalError``. Not a handle: ``None``, as Horovod returns for a handle it does
    not know."""
    if not isinstance(handle, Handle):
        return None
    if not handle.done:
        try:
            handle.started()
            if not poll(handle):  # a wait: bounded, and reported if it stalls
                with _bounded(handle.what):
                    for w in handle.works:
                        w.wait()
        except HorovodInternalError:
            handle.works, handle.done = [], True
            raise
        except RuntimeError as e:
            handle.works, handle.done = [], True
            raise HorovodInternalError(f"a collective failed: {e} (a rank of the job failed or "
                                       "left it; its own output says why)") from e
        result = handle.finish()
        handle.result, handle.done = result[0] if handle.first else result, True
        handle.works = []
    return handle.result
