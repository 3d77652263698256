"""A bound on every wait hvdsync makes for a collective, so a job cannot hang forever.

If a rank never joins a collective -- it died unnoticed, skipped a call, was configured
differently -- the others would wait forever. Each blocking wait of hvdsync runs inside
:func:`guard`; one background thread watches them. After ``HVDSYNC_STALL_WARNING_SECONDS``
(default 60; ``0``: off) the rank prints a stall report (what it waits for, since when, the
entry point and step: :mod:`hvdsync.safety.entries`), so the rank missing from the reports is the
one to look at; after ``HVDSYNC_TIMEOUT_SECONDS`` (default 900; ``0``: forever) it prints
what was waited for and why that usually happens, and exits with code 70, so the launcher
ends the job. The hot path pays an environment lookup and two dictionary writes per wait.
docs/failures.md.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional

ENV = "HVDSYNC_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_S = 900.0
STALL_ENV = "HVDSYNC_STALL_WARNING_SECONDS"
DEFAULT_STALL_S = 60.0
EXIT_CODE = 70

_waits: dict[int, tuple[str, float]] = {}  # thread id -> (what, started)
_reported: set[tuple[str, float]] = set()  # waits whose stall report is printed
_lock = threading.Lock()
_thread: list[threading.Thread] = []
_entry = ["hvdsync's setup", 0]  # what this rank is doing (entries.begin), for the report


def timeout_s() -> float:
    """The bound in seconds (``0``: none), from ``HVDSYNC_TIMEOUT_SECONDS``."""
    return _seconds(ENV, DEFAULT_TIMEOUT_S)


def stall_s() -> float:
    """When a wait is reported as stalled (``0``: never), from
    ``HVDSYNC_STALL_WARNING_SECONDS``."""
    return _seconds(STALL_ENV, DEFAULT_STALL_S)


def _seconds(env: str, default: float) -> float:
    raw = os.environ.get(env, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{env} must be a number of seconds, got {raw!r}") from None
    if value != value:
        raise ValueError(f"{env} must be a number of seconds, got {raw!r}")
    return max(value, 0.0)


def entered(what: str, step: int) -> None:
    """This rank began an entry point (a training step, ``flush()``...): named in the stall
    report."""
    _entry[0], _entry[1] = what, step


class guard:
    """``with guard(what):`` marks a blocking wait for ``what`` (a collective's name and
    purpose). A class rather than a generator-based context manager: it runs on every wait
    of every step."""

    __slots__ = ("what", "key", "outer")

    def __init__(self, what: str):
        self.what = what
        self.key: Optional[int] = None

    def __enter__(self) -> None:
        if timeout_s() <= 0 and stall_s() <= 0:
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


def period_s() -> float:
    """How often the watching thread looks: at most 5 s, a tenth of the shorter bound."""
    bounds = [b for b in (timeout_s(), stall_s()) if b > 0]
    return min(5.0, max(min(bounds) / 10, 0.2)) if bounds else 5.0


def _watch() -> None:
    while True:
        time.sleep(period_s())
        limit, stall = timeout_s(), stall_s()
        now = time.monotonic()
        waits = list(_waits.values())
        for what, started in waits:
            if 0 < limit < now - started:
                _give_up(what, now - started)
            if 0 < stall < now - started and (what, started) not in _reported:
                _reported.add((what, started))
                _report(what, now - started, limit)
        _reported.intersection_update(waits)


def _report(what: str, waited: float, limit: float) -> None:
    since = time.strftime("%H:%M:%S", time.localtime(time.time() - waited))
    doing, step = _entry
    end = (f"it ends this process after {limit:g} s ({ENV})" if limit > 0
           else f"it waits forever ({ENV}=0)")
    sys.stderr.write(
        f"\nhvdsync: stall: rank {launcher_rank()} has waited {waited:.0f} s (since {since}) "
        f"for {what}, in {doing} (step {step}). Every rank that waits prints this; a rank "
        "that does not has stopped, is still computing, or made another call (a flush(), a "
        "save, an evaluation on some ranks only). hvdsync reports once per wait; "
        f"{end}. See docs/failures.md.\n")
    sys.stderr.flush()


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
