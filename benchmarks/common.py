"""Helpers shared by the benchmarks: timing loops, Markdown tables, result files."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

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
