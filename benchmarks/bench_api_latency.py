"""What a script's own collectives cost on each engine: Horovod's torch API on ``horovodrun``
against the same calls on ``torchrun`` (hvdsync.torch.c10d), with and without the ranks' check
of each call (docs/backends.md, "Errors instead of hangs": one small blocking round before
each collective a script starts; hvdsync's own training collectives skip it).

Small tensors (256 float32), so the figure is the per-call latency: a Horovod cycle against one
or two Gloo round trips. 2 ranks x 1 core on this host; each round runs one job per engine,
rounds interleaved; the table gives the median over rounds, [min, max], and the ratio to
Horovod in the same round.

    .venv/bin/python -m benchmarks.bench_api_latency [--rounds 3] [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.common import markdown_table, report, shows_progress
from hvdsync.testing import run_ranks
from hvdsync.testing import progress

CALLS = ("allreduce", "allgather", "broadcast", "alltoall")


def latency_body(calls: int) -> dict:
    """Per collective, microseconds per blocking call (after 20 warm-up calls); on the torch
    engine with the check (``checked``) and without (``HVDSYNC_CHECK_COLLECTIVES=0``)."""
    import torch

    import hvdsync.torch as hvd
    hvd.init()
    x = torch.ones(256)
    run = {"allreduce": lambda: hvd.allreduce(x, name="lat"),
           "allgather": lambda: hvd.allgather(x, name="lat"),
           "broadcast": lambda: hvd.broadcast(x, 0, name="lat"),
           "alltoall": lambda: hvd.alltoall(x, name="lat")}
    modes = ("checked", "unchecked") if hvd.backend_name() == "torch" else ("horovod",)
    out: dict = {}
    for mode in modes:
        os.environ["HVDSYNC_CHECK_COLLECTIVES"] = "0" if mode == "unchecked" else "1"
        for what, call in run.items():
            progress.step(len(out), len(modes) * len(run), f"{what}, {mode}")
            for _ in range(20):
                call()
            hvd.allreduce(torch.zeros(1), name="lat.sync")
            start = time.perf_counter()
            for _ in range(calls):
                call()
            out[f"{what}/{mode}"] = (time.perf_counter() - start) / calls * 1e6
    return out


@shows_progress
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--name", default="api_latency_np2")
    args = parser.parse_args(argv)
    rounds = []
    for _ in range(args.rounds):
        horovod = run_ranks(latency_body, np=2, args=(args.calls,), timeout=300)[0]
        torch_engine = run_ranks(latency_body, np=2, args=(args.calls,), timeout=300,
                                 launcher="torchrun")[0]
        rounds.append({**horovod, **torch_engine})
    rows, data = [], {}
    for what in CALLS:
        row = [f"`hvd.{what}` (256 floats)"]
        for mode in ("horovod", "checked", "unchecked"):
            us = [r[f"{what}/{mode}"] for r in rounds]
            ratios = [r[f"{what}/{mode}"] / r[f"{what}/horovod"] for r in rounds]
            row.append(f"{statistics.median(us):.0f} [{min(us):.0f}, {max(us):.0f}] "
                       f"({statistics.median(ratios):.2f}x)")
            data[f"{what}/{mode}"] = dict(us=us, ratio_to_horovod=ratios)
        rows.append(row)
    table = markdown_table(["call", "Horovod (horovodrun), us", "torch engine, checked",
                            "torch engine, unchecked (HVDSYNC_CHECK_COLLECTIVES=0)"], rows)
    report(args.name, f"a script's collective, per blocking call, 2 ranks, {args.rounds} rounds",
           table, {"rounds": rounds, "figures": data}, "benchmarks.bench_api_latency", argv)


if __name__ == "__main__":
    main()
