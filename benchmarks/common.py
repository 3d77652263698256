"""Helpers shared by the benchmarks: timing loops, Markdown tables, result files."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import wraps
from pathlib import Path

from hvdsync.testing import progress

RESULTS = Path(__file__).resolve().parent / "results"


def median_step_time(step: Callable[[], None], steps: int) -> float:
    """Median wall time of ``steps`` calls of ``step`` (seconds)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def fmt(x):
        return f"{x:.3f}" if isinstance(x, float) else str(x)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(name: str, data: dict, table: str, command: str) -> Path:
    """Write ``results/<name>.json`` and ``results/<name>.md`` (table + how it was made)."""
    RESULTS.mkdir(exist_ok=True)
    meta = {"command": command, "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
            "python": platform.python_version()}
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, **data}, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(
        f"{table}\n\nMade by `{command}` on {meta['date']} ({meta['machine']}).\n")
    return RESULTS / f"{name}.json"


def report(name: str, title: str, table: str, data: dict, module: str, argv) -> None:
    """Print the table under its title and write the results with the command that made them."""
    print(f"{title}\n{table}")
    args = sys.argv[1:] if argv is None else list(argv)
    write_results(name, data, table, " ".join([f"python -m {module}", *args]))


def shows_progress(main: Callable) -> Callable:
    """A benchmark's ``main``, showing what runs while it runs: the cell, the method and seed,
    the step of steps and the time so far (:mod:`hvdsync.testing.progress`: one updating line
    on a terminal, plain lines in a log)."""
    @wraps(main)
    def run(*args, **kwargs):
        with progress.shown():
            return main(*args, **kwargs)
    return run
