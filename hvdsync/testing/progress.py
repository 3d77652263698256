"""Progress of long runs of rank jobs (the benchmarks), shown by the process that launches them.

On a rank, :func:`step` tells what runs (a method and seed) and its step of steps: rank 0
writes it to a file the launcher names in the environment (:data:`ENV`; nothing where none is
named). The launching process opens the display with :func:`shown` and names each cell; while
a job runs the launcher polls the ranks' file (:func:`poll`): one updating line on a terminal
(``rich``), in a log a plain line whenever what runs changes and one a minute otherwise.

    with progress.shown() as show:
        show.cell("lm, 2 ranks, 100 Mbit/s")
        run_ranks(body, np=2)          # body calls progress.step(i, steps, "horovod seed 0")
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Optional, TextIO

#: the environment variable that names the file a job's rank 0 reports to
ENV = "HVDSYNC_PROGRESS_FILE"
#: a rank writes at most this often (and always its last step)
EVERY_S = 0.25
#: in a log, a line at least this often while a step count moves, and at most this often
#: when only what runs changes (a method a second would flood it)
LOG_EVERY_S, LOG_CHANGE_S = 60.0, 5.0

_written = [0.0]
_target: list[str] = []  # this process's file to report to ("": none), once looked up


def step(done: int, total: int, what: str = "") -> None:
    """On a rank: ``done`` of ``total`` steps of ``what`` (e.g. ``"horovod, seed 0"``). Rank 0's
    goes to the launcher's display, at most every :data:`EVERY_S` seconds. In the process that
    shows the display itself (an in-process measurement), straight to it."""
    if _display:
        _display[-1].report(done, total, what)
        return
    if not _target:
        path = os.environ.get(ENV)
        _target.append(path if path and _rank() == 0 else "")
    path = _target[0]
    if not path:
        return  # (a few hundred ns: cheap enough inside a timed loop)
    now = time.monotonic()
    if done < total and now - _written[0] < EVERY_S:
        return
    _written[0] = now
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{done}\t{total}\t{what}")
    os.replace(tmp, path)  # (the launcher never reads half a line)


def _rank() -> int:
    for name in ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


class Display:
    """The launcher's side: the cell that runs, and the ranks' last report of it."""

    def __init__(self, stream: TextIO = sys.stderr, plain: Optional[bool] = None):
        self.stream = stream
        self.plain = not stream.isatty() if plain is None else plain
        self.started = time.monotonic()
        self._cell, self._cell_started = "", self.started
        self._job = ""  # the function the running job runs (shown until a rank reports)
        self._last: tuple[int, int, str] = (0, 0, "")
        self._logged = (0.0, "")
        self._pending = False  # a change not yet shown in a log (LOG_CHANGE_S)
        self._live = None
        if not self.plain:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)
            self._live = Progress(TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TextColumn("cell"),
                                  TimeElapsedColumn(), TextColumn("run {task.fields[run]}"),
                                  console=Console(file=stream), transient=False)
            self._task = self._live.add_task("", total=None, run="0:00:00")
            self._live.start()

    def cell(self, name: str) -> None:
        """A new cell of the run starts (a workload, ranks and link; a method's job)."""
        self._cell, self._cell_started, self._last = name, time.monotonic(), (0, 0, "")
        if self._live is not None:
            self._live.reset(self._task, total=None, description=name)
            self._refresh_run()
        else:
            self._line()  # (a new cell: always a line)

    def job(self, name: str) -> None:
        """A job of ranks starts (``name``: what it runs), in the current cell."""
        self._job, self._last = name, (0, 0, "")
        self.report(0, 0, "")

    def report(self, done: int, total: int, what: str) -> None:
        """The ranks' last report (``done`` of ``total`` steps of ``what``)."""
        what = what or self._job
        changed = what != self._last[2]
        self._last = (done, total, what)
        if self._live is not None:
            self._live.update(self._task, completed=done, total=total or None,
                              description=" | ".join(x for x in (self._cell, what) if x))
            self._refresh_run()
        else:
            self._pending = self._pending or changed
            self.tick()

    def tick(self) -> None:
        """A second passed (the launcher polls): in a log, the line a change left pending
        once :data:`LOG_CHANGE_S` have passed since the last, or one at least every
        :data:`LOG_EVERY_S` while steps go on."""
        if self._live is not None:
            self._refresh_run()
            return
        since = time.monotonic() - self._logged[0]
        if (self._pending and since >= LOG_CHANGE_S) or (self._last[1] and
                                                         since >= LOG_EVERY_S):
            self._line()

    def _refresh_run(self) -> None:
        self._live.update(self._task, run=_clock(time.monotonic() - self.started))

    def _line(self) -> None:
        done, total, what = self._last
        now = time.monotonic()
        parts = [x for x in (self._cell, what) if x]
        steps = f", step {done}/{total}" if total else ""
        print(f"[progress] {' | '.join(parts)}{steps}; cell {_clock(now - self._cell_started)}"
              f", run {_clock(now - self.started)}", file=self.stream, flush=True)
        self._logged, self._pending = (now, what), False

    def close(self) -> None:
        if self._pending:  # (the last change, where the throttle held it back)
            self._line()
        if self._live is not None:
            self._live.stop()
            self._live = None


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


#: the display of this process, while :func:`shown` holds one
_display: list[Display] = []


@contextlib.contextmanager
def shown(plain: Optional[bool] = None, stream: TextIO = sys.stderr) -> Iterator[Display]:
    """Show the progress of the rank jobs this process launches until the block ends
    (``plain``: plain lines even on a terminal; ``None``: plain where ``stream`` is no
    terminal)."""
    display = Display(stream, plain)
    _display.append(display)
    try:
        yield display
    finally:
        _display.remove(display)
        display.close()


def cell(name: str) -> None:
    """:meth:`Display.cell` of the display shown now, if any."""
    if _display:
        _display[-1].cell(name)


def job_env(workdir: str) -> dict[str, str]:
    """What a launcher adds to its ranks' environment so that they report into ``workdir``
    (nothing while no display is shown)."""
    return {ENV: os.path.join(workdir, "progress")} if _display else {}


def job(name: str) -> None:
    """A launcher starts a job of ranks that runs ``name`` (:meth:`Display.job`)."""
    if _display:
        _display[-1].job(name)


def poll(workdir: str) -> None:
    """The launcher, while its job runs: show the ranks' last report from ``workdir``."""
    if not _display:
        return
    try:
        with open(os.path.join(workdir, "progress")) as f:
            done, total, what = f.read().split("\t", 2)
    except (OSError, ValueError):  # (nothing reported yet)
        _display[-1].tick()
        return
    report = (int(done), int(total), what or _display[-1]._job)
    if report != _display[-1]._last:
        _display[-1].report(*report)
    else:
        _display[-1].tick()
