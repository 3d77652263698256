"""The multi-rank harness itself: results come back per rank, and a crash, a hang or a killed
rank becomes a failure that shows every rank's output and leaves no process behind (a
harness that cannot fail would prove nothing)."""

from __future__ import annotations

import time

import pytest

from hvdsync.testing import RanksFailed, processes_of, run_ranks


def rank_times(scale):
    import horovod.torch as hvd
    import torch
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="t").item()
    return hvd.rank() * scale, hvd.size(), total


def crash_on_rank_one():
    import horovod.torch as hvd
    hvd.init()
    print(f"rank {hvd.rank()} alive", flush=True)
    if hvd.rank() == 1:
        raise ValueError("boom on rank one")
    time.sleep(60)


def hang_on_rank_one():
    import horovod.torch as hvd
    import torch
    hvd.init()
    print(f"rank {hvd.rank()} before collective", flush=True)
    if hvd.rank() == 1:
        time.sleep(600)  # never joins the allreduce below: rank 0 waits forever
    hvd.allreduce(torch.ones(1), name="never_matched")


@pytest.mark.parametrize("np_", [2, 3])
def test_results_per_rank(np_):
    res = run_ranks(rank_times, np=np_, args=(10,), timeout=120)
    total = sum(range(np_))
    assert res == [(10 * r, np_, total) for r in range(np_)]


def test_crash_is_reported_with_rank_output():
    with pytest.raises(RanksFailed) as err:
        run_ranks(crash_on_rank_one, np=2, timeout=120)
    msg = str(err.value)
    assert "boom on rank one" in msg
    assert "rank 0 alive" in msg and "----- rank 1" in msg
    assert processes_of(err.value.workdir) == []  # rank 0 was sleeping: killed, not orphaned


def test_hang_becomes_timeout_failure():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        run_ranks(hang_on_rank_one, np=2, timeout=12)
    assert time.monotonic() - start < 60
    msg = str(err.value)
    assert "timed out" in msg
    assert "rank 0 before collective" in msg and "rank 1 before collective" in msg
    assert processes_of(err.value.workdir) == []


def killed_mid_training(where: str, steps: int = 200):
    """Train with hvdsync on every rank; rank 1 is SIGKILLed at step 5, either between steps
    or while its ranks are inside a collective (rank 0 joins the step's reductions late)."""
    import os
    import signal
    import threading

    import torch

    import hvdsync.torch as hvd
    from tests.models import MLP, teacher_batches
    hvd.init()
    model = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    print(f"rank {hvd.rank()} training", flush=True)
    for step, (x, y) in enumerate(teacher_batches(hvd.rank(), steps)):
        if step == 5 and hvd.rank() == 1:
            if where == "between":
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if step == 5 and hvd.rank() == 0 and where == "inside":
            time.sleep(1.0)  # rank 1 is already waiting inside the step's allreduces
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return "finished"


#: the most seconds a job with a dead rank may take to end (documented in docs/failures.md)
DEAD_RANK_BOUND_S = 60


@pytest.mark.parametrize("launcher", ["horovodrun", "torchrun"])
@pytest.mark.parametrize("where", ["between", "inside"])
def test_killed_rank_ends_the_job_and_leaves_nothing(where, launcher):
    start = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        run_ranks(killed_mid_training, np=2, args=(where,), timeout=180, launcher=launcher)
    elapsed = time.monotonic() - start
    assert elapsed < DEAD_RANK_BOUND_S, elapsed
    msg = str(err.value)
    assert "exited with code" in msg and "rank 0 training" in msg
    assert processes_of(err.value.workdir) == []

