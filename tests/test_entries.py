"""A collective entry point called on some ranks only -- ``if hvd.rank() == 0: opt.flush()``,
a save on rank 0 only -- is refused on every rank within seconds, naming what each side
called (hvdsync.safety.entries, docs/failures.md), with every technique: real ranks on Horovod and
torchrun for the techniques whose first collective differs in kind, simulated ranks for every
technique (a refused job is broken, so every case is a job of its own)."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from typing import Optional

import pytest
import torch
from torch import nn

from hvdsync.testing import run_ranks
from tests.models import MLP, run_job, teacher_batches

CASES = {
    "plain": {},
    "clip": dict(clip=dict(max_norm=1.0)),
    "threshold": dict(threshold=dict(threshold=0.6, max_skip=4)),
    "select": dict(select=dict(k=1, max_wait=3)),
    "lowrank": dict(lowrank=dict(rank=2, warmup_steps=0, min_compression=0)),
    "delay": dict(delay=dict(staleness=1, average_every=4)),
    "streaming": dict(delay="streaming"),
}


def one_rank_flushes(case: str, what: str = "flush") -> dict:
    """Every rank trains; before step 3 rank 0 alone also calls ``flush()`` (or
    ``save_checkpoint``). Returns what each rank raised and how long after that point."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), **CASES[case])
    started = None
    try:
        for step, (x, y) in enumerate(teacher_batches(hvd.rank(), 40)):
            if step == 3:
                started = time.monotonic()
                if hvd.rank() == 0:
                    if what == "flush":
                        opt.flush()
                    else:
                        hvd.save_checkpoint(os.path.join(tempfile.gettempdir(),
                                                         f"entries{os.getpid()}.pt"), model, opt)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    except hvd.RanksDisagree as e:
        return dict(error=str(e), seconds=time.monotonic() - started)
    return dict(error=None, seconds=None)


# real ranks: the first collectives that differ in kind (a step's data against flush's
# averaging or the outer exchange, and against a save's gather), on each engine; every
# technique on simulated ranks below
REAL = [("horovodrun", "delay", "flush"), ("horovodrun", "plain", "save"),
        ("torchrun", "threshold", "flush"), ("torchrun", "streaming", "save")]


@pytest.mark.parametrize("launcher,case,what", REAL, ids=["-".join(r) for r in REAL])
def test_a_call_on_rank_0_only_is_refused_on_every_rank(launcher, case, what):
    out = run_job(one_rank_flushes, 2, (case, what), timeout=120, launcher=launcher)
    called = "flush()" if what == "flush" else "save_checkpoint"
    for r in out:
        assert r["error"] is not None, out
        assert f"rank 0: {called}" in r["error"] and "rank 1: a training step" in r["error"]
        assert "on every rank" in r["error"], r["error"]
        assert r["seconds"] < 30, out
    assert out[0]["error"] == out[1]["error"]


@pytest.mark.parametrize("case", list(CASES))
def test_every_technique_refuses_a_save_on_one_rank_and_a_flush_that_communicates(case):
    """Simulated ranks (threads): a save on rank 0 only is refused with every technique; a
    flush on rank 0 only is refused where it communicates, and where it sends nothing
    (nothing to flush) it is no collective and training goes on, replicas equal."""
    from hvdsync.testing import run_threads
    for what in ("save", "flush"):
        out = run_threads(one_rank_flushes, 2, args=(case, what))
        communicates = what == "save" or case in ("threshold", "delay", "streaming")
        if communicates:
            assert all(r["error"] and "the ranks called different collectives" in r["error"]
                       for r in out), (what, out)
        else:
            assert [r["error"] for r in out] == [None, None], (what, out)


# -- the stall report -------------------------------------------------------------------------
def one_rank_stops(seconds: float, stopped: int = 1, keywords: Optional[dict] = None) -> str:
    """Rank ``stopped`` stops for ``seconds`` (SIGSTOP, as a debugger or a swapped-out host
    would do; a child process continues it) before step 3's backward, while the others wait in
    that step's collectives. ``keywords``: the optimizer's (``between="nodes"``...). Returns
    what hvdsync printed to stderr on this rank."""
    import io
    import subprocess
    import sys

    import hvdsync.torch as hvd
    hvd.init(process_sets=hvd.node_process_sets())  # (none but on nodes of several ranks)
    torch.manual_seed(0)
    model = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   **(keywords or {}))
    printed, sys.stderr = sys.stderr, io.StringIO()
    try:
        for step, (x, y) in enumerate(teacher_batches(hvd.rank(), 5), start=1):
            if step == 3 and hvd.rank() == stopped:
                subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGSTOP)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    finally:
        printed, sys.stderr = sys.stderr.getvalue(), printed
    return printed


@pytest.mark.parametrize("launcher", ["horovodrun", "torchrun"])
def test_a_stalled_rank_is_reported_by_the_others(launcher):
    out = run_job(one_rank_stops, 2, (3.0,), timeout=100, launcher=launcher,
                  env={"HVDSYNC_STALL_WARNING_SECONDS": "1"})
    assert out[1] == "", out  # the stopped rank waited for nobody
    assert out[0].count("hvdsync: stall:") == 1, out  # once per wait
    report = out[0][out[0].index("hvdsync: stall:"):]
    assert report.startswith("hvdsync: stall: rank 0 has waited "), report
    assert "in a training step (step 3)" in report and "entry tags" in report, report
    assert "docs/failures.md" in report


def test_the_stall_report_comes_within_75_s_by_default():
    """The defaults: reported after 60 s, looked for every 5 s at most (so by 65 s)."""
    from hvdsync.safety import watchdog
    assert watchdog.stall_s() == 60 and watchdog.period_s() <= 5


# -- Keras: the compiled step and the eager step pipeline (delay=) ---------------------------
def keras_flush_on_rank_0() -> dict:
    """``model.fit`` with ``delay=``; a callback on rank 0 only calls ``flush()`` after the
    third batch (a rank-0-only evaluation's habit). What each rank raised, and how long after
    that batch."""
    import keras

    import hvdsync.keras as hvd
    from tests.keras_models import make_optimizer, mlp, one_tensorflow_thread, teacher_data
    hvd.init()
    one_tensorflow_thread()
    model = mlp(seed=0)
    x, y = teacher_data(hvd.rank(), 20 * 16)
    opt = hvd.DistributedOptimizer(make_optimizer("sgd", 0.1),
                                   delay=dict(staleness=1, average_every=4))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    started = []

    class FlushOnRank0(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                started.append(time.monotonic())
                if hvd.rank() == 0:
                    self.model.optimizer.flush()
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), FlushOnRank0()])
    except Exception as e:  # noqa: BLE001 - inside fit, TensorFlow wraps what a step raised
        return dict(error=str(e), type=type(e).__name__,
                    seconds=time.monotonic() - started[0], graph=opt._hv.graph_path)
    return dict(error=None)


@pytest.mark.parametrize("path", ["compiled", "pipeline"])
def test_keras_a_flush_on_rank_0_only_is_refused_on_every_rank(path):
    """In the compiled step (its entry tag a graph op beside the data, checked before the
    update) and through Keras' eager step pipeline: every rank raises within seconds, naming
    both entries."""
    env = {"HVDSYNC_KERAS_PIPELINE": "1"} if path == "pipeline" else {}
    out = run_ranks(keras_flush_on_rank_0, np=2, timeout=180, env=env)
    said = "\n".join(f"rank {r}: {o}" for r, o in enumerate(out))
    assert all(r["error"] and "the ranks called different collectives -- rank 0: flush()"
               in r["error"] and "rank 1: a training step" in r["error"] for r in out), said
    assert out[0]["type"] == "RanksDisagree", out  # (rank 1's comes through TensorFlow)
    assert all(r["graph"] == (path == "compiled") for r in out), out
    assert all(r["seconds"] < 30 for r in out), out
