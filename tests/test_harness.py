"""The multi-rank harness itself: results come back per rank, and a crash or a hang becomes
a failure that shows every rank's output (a harness that cannot fail would prove nothing)."""

from __future__ import annotations

import time

import pytest

from hvdsync.testing import RanksFailed, run_ranks


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


def test_hang_becomes_timeout_failure():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        run_ranks(hang_on_rank_one, np=2, timeout=25)
    assert time.monotonic() - start < 60
    msg = str(err.value)
    assert "timed out" in msg
    assert "rank 0 before collective" in msg and "rank 1 before collective" in msg
