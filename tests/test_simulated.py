"""The simulated ranks themselves (:func:`hvdsync.testing.run_threads`): they must behave like
separate processes on a process group -- or fail loudly -- for the in-process tests of the core
to mean anything. Each check here has its real-rank counterpart in test_torch_backend.py /
test_harness.py."""

from __future__ import annotations

import time

import pytest
import torch

from hvdsync.testing import RanksFailed, run_threads
from tests.models import MLP, teacher_batches
from tests.test_torch_backend import api_semantics


def test_horovods_api_gives_what_real_ranks_give(request, torchrun_job):
    """The API checks of the real torchrun job, on 3 simulated ranks: same answers."""
    simulated = run_threads(api_semantics, 3)
    real = torchrun_job(request.module, 3)["api"]
    skip = {"backend", "horovod_loaded", "summary", "lent", "lent_returned"}
    for sim, rr in zip(simulated, real):
        assert sim["backend"] == "simulated"
        assert sim["summary"].startswith("hvdsync on simulated, 3 ranks; techniques: "), \
            sim["summary"]
        for key in set(rr) - skip:
            assert _close(sim[key], rr[key]), (key, sim[key], rr[key])


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == pytest.approx(b)


def _rank_and_draws() -> tuple[int, list[float], float]:
    import random

    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(hvd.rank())
    first = torch.rand(2).tolist()
    hvd.allreduce(torch.ones(1), name="yield")  # another rank runs meanwhile
    return hvd.rank(), first + torch.rand(2).tolist(), random.random()


def test_each_rank_keeps_its_own_random_state():
    results = run_threads(_rank_and_draws, 3)
    assert [r for r, _, _ in results] == [0, 1, 2]
    for r, draws, _ in results:
        torch.manual_seed(r)
        assert draws == torch.rand(4).tolist()  # as if no other rank had drawn in between
    # unseeded generators start alike, as processes started alike do
    assert len({py for _, _, py in results}) == 1


def _one_rank_differs(kind: str) -> None:
    import hvdsync.torch as hvd
    hvd.init()
    r = hvd.rank()
    if kind == "shape":  # a name of hvdsync's own: past the engine's check of a script's calls
        hvd.allreduce(torch.ones(2 + (r == 1)), name="hvdsync.x")
    elif kind == "skipped":
        if r != 1:
            hvd.allreduce(torch.ones(2), name="only some")
    elif kind == "raises":
        if r == 2:
            raise KeyError("rank 2's own error")
        hvd.allreduce(torch.ones(2), name="after")


def test_ranks_that_differ_fail_every_rank_with_the_reason():
    with pytest.raises(RanksFailed, match=r"differs between ranks.*\(2,\).*\(3,\)") as info:
        run_threads(_one_rank_differs, 3, args=("shape",))
    assert all(f"--- rank {r} ---" in str(info.value) for r in range(3))


def test_a_rank_that_skips_a_collective_fails_in_bounded_time():
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"waited 1 s .* rank\(s\) \[1\] never started it"):
        run_threads(_one_rank_differs, 3, args=("skipped",), timeout=1.0)
    assert time.monotonic() - start < 10


def test_a_rank_that_raises_ends_the_others_waits():
    with pytest.raises(RanksFailed) as info:
        run_threads(_one_rank_differs, 3, args=("raises",), timeout=30.0)
    message = str(info.value)
    assert "rank 2's own error" in message and "--- rank 0 ---" in message


def _train(options: dict) -> list[float]:
    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), **options)
    for x, y in teacher_batches(hvd.rank(), 6):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.flush()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


TRAINED = [{}, dict(lowrank=dict(rank=2, warmup_steps=1, min_compression=0))]


def torchrun_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's real ranks, in the session's shared torchrun job (tests/conftest.py)."""
    if np_ == 3:
        return {"api": (api_semantics,)}
    if np_ == 2:
        return {f"train/{sorted(options)}": (_train, options) for options in TRAINED}
    return {}


@pytest.mark.parametrize("options", TRAINED, ids=["nothing", "lowrank"])
def test_training_matches_real_ranks_bit_for_bit(request, torchrun_job, options):
    """2 ranks: a sum of two is the same in any order, so the simulation must give the very
    parameters torchrun's Gloo ranks give."""
    simulated = run_threads(_train, 2, args=(options,))
    real = torchrun_job(request.module, 2)[f"train/{sorted(options)}"]
    assert simulated == real
