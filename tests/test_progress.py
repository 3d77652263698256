"""Benchmarks show their progress (:mod:`hvdsync.testing.progress`): a rank's report reaches
the display of the process that launched the job -- what runs, its step of steps, the time
so far -- as plain lines in a log; nothing is written where no display asked for it."""

from __future__ import annotations

import io
import os
import time

from hvdsync.testing import progress, run_ranks


def reporting_body(steps: int) -> int:
    """On each rank: ``steps`` steps, each reported (only rank 0's reach the display)."""
    for i in range(1, steps + 1):
        progress.step(i, steps, f"method m, seed {i // 4}")
        time.sleep(0.02)
    return steps


def test_a_jobs_steps_reach_the_launchers_display(monkeypatch):
    monkeypatch.setattr(progress, "LOG_CHANGE_S", 0.0)  # a line for every change seen
    log = io.StringIO()
    with progress.shown(plain=True, stream=log) as show:
        show.cell("digits, 2 ranks, loopback")
        assert run_ranks(reporting_body, np=2, args=(12,), launcher="torchrun",
                         timeout=120) == [12, 12]
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("[progress] digits, 2 ranks, loopback; cell 0:00:0"), lines
    assert any(line.startswith("[progress] digits, 2 ranks, loopback | reporting_body on 2 "
                               "ranks") for line in lines), lines
    # a line for each method/seed the ranks went through (the display polls once a second),
    # the last one always: the job's last report
    shown = [line for line in lines if "| method m, seed" in line]
    assert shown and all(", step " in line and "/12; cell " in line for line in shown), lines
    assert shown[-1].startswith("[progress] digits, 2 ranks, loopback | method m, seed 3, "
                                "step 12/12; cell "), lines


def steps_logged(change_s: float, monkeypatch) -> list[str]:
    """A cell, then reports (in this process: straight to the display), logged with a line
    at most every ``change_s`` seconds when only what runs changes."""
    monkeypatch.setattr(progress, "LOG_CHANGE_S", change_s)
    log = io.StringIO()
    with progress.shown(plain=True, stream=log) as show:
        show.cell("lm, 4 ranks, 100 Mbit/s")
        progress.step(3, 10, "horovod, seed 0")
        progress.step(4, 10, "horovod, seed 0")  # same method: no line (until a minute)
        progress.step(1, 10, "hvdsync streaming, seed 0")
    lines = log.getvalue().splitlines()
    assert all(line.endswith(", run 0:00:00") for line in lines), lines
    return [line.split(";")[0] for line in lines]


def test_plain_lines_when_what_runs_changes(monkeypatch):
    assert steps_logged(0.0, monkeypatch) == [
        "[progress] lm, 4 ranks, 100 Mbit/s",
        "[progress] lm, 4 ranks, 100 Mbit/s | horovod, seed 0, step 3/10",
        "[progress] lm, 4 ranks, 100 Mbit/s | hvdsync streaming, seed 0, step 1/10"]


def test_a_log_is_not_flooded_and_keeps_the_last_change(monkeypatch):
    """Methods a second apart (timed rounds) give a line every few seconds, not one each;
    the last change is shown when the display closes."""
    assert steps_logged(5.0, monkeypatch) == [
        "[progress] lm, 4 ranks, 100 Mbit/s",
        "[progress] lm, 4 ranks, 100 Mbit/s | hvdsync streaming, seed 0, step 1/10"]


def test_a_rank_reports_nothing_without_a_display(monkeypatch, tmp_path):
    """No display, no file: a benchmark body run by a test, or a user's job, writes nothing;
    with one, only rank 0 writes."""
    monkeypatch.setattr(progress, "_target", [])
    monkeypatch.delenv(progress.ENV, raising=False)
    progress.step(1, 2, "x")
    assert progress._target == [""] and os.listdir(tmp_path) == []
    for rank, written in (("1", False), ("0", True)):
        monkeypatch.setattr(progress, "_target", [])
        monkeypatch.setenv(progress.ENV, str(tmp_path / "progress"))
        monkeypatch.setenv("RANK", rank)
        progress.step(2, 2, "x")
        assert (tmp_path / "progress").exists() == written, rank
    assert (tmp_path / "progress").read_text() == "2\t2\tx"
