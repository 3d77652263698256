"""A bound on every wait hvdsync makes for a collective, so a job cannot hang forever.

Horovod waits for a collective until every rank has joined it. If a rank never does -- it
died without the launcher noticing, it skipped a call the others made, the ranks were
configured differently -- the others wait forever (Horovod's stall inspector only warns,
and did not even warn with Gloo in our tests, docs/failures.md). hvdsync wraps each of its
blocking waits in :func:`guard`; one background thread checks the waits in progress, and if
one has lasted longer than ``HVDSYNC_TIMEOUT_SECONDS`` (default 900; ``0`` waits forever) it
prints what was waited for, and why that usually happens, and ends the process with exit
code 70. The launcher (``horovodrun``) then stops the other ranks: the job ends, with a
message, instead of hanging.

The cost on the hot path is an environment lookup and two dictionary writes per wait; the
thread wakes every few seconds.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional

ENV = "HVDSYNC_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_S = 900.0
EXIT_CODE = 70

_waits: dict[int, tuple[str, float]] = {}  # thread id -> (what, started)
_lock = threading.Lock()
_thread: list[threading.Thread] = []


def timeout_s() -> float:
    """The bound in seconds (``0``: none), from ``HVDSYNC_TIMEOUT_SECONDS``."""
    raw = os.environ.get(ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{ENV} must be a number of seconds, got {raw!r}") from None
    return max(value, 0.0)


class guard:
    """``with guard(what):`` marks a blocking wait for ``what`` (a collective's name and
    purpose). A class rather than a generator-based context manager: it runs on every wait
    of every step."""

    __slots__ = ("what", "key", "outer")

    def __init__(self, what: str):
        self.what = what
        self.key: Optional[int] = None

    def __enter__(self) -> None:
        if timeout_s() <= 0:
            return
        if not _thread:
            _start()
        self.key = key = threading.get_ident()
        self.outer = _waits.get(key)
        _waits[key] = (self.what, time.monotonic())

    def __exit__(self, *exc) -> None:
        if self.key is None:
            return
        if self.outer is None:
            _waits.pop(self.key, None)
        else:
            _waits[self.key] = self.outer


def _start() -> None:
    with _lock:
        if not _thread:
            t = threading.Thread(target=_watch, name="hvdsync-watchdog", daemon=True)
            _thread.append(t)
            t.start()


def _watch() -> None:
    while True:
        limit = timeout_s()
        time.sleep(min(5.0, max(limit / 10, 0.2)) if limit > 0 else 5.0)
        if limit <= 0:
            continue
        now = time.monotonic()
        for what, started in list(_waits.values()):
            if now - started > limit:
                _give_up(what, now - started)


def launcher_rank() -> str:
    """This process's rank as its launcher set it (``horovodrun`` or ``torchrun``), before
    any ``init``; ``"?"`` outside a launched job."""
    return os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "?"))


def _give_up(what: str, waited: float) -> None:
    rank = launcher_rank()
    sys.stderr.write(
        f"\nhvdsync: rank {rank} waited {waited:.0f} s for {what} and gives up "
        f"({ENV}={timeout_s():g}). Another rank did not take part: it died, it skipped a call "
        "every rank must make (flush(), a save or an evaluation on one rank only), or the "
        "ranks were set up differently. Ending this process so the job stops instead of "
        "hanging; see docs/failures.md.\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_CODE)
