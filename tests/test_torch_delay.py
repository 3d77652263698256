"""``delay=`` (torch): local updates with stale global gradients and K-step averaging, on 2
and 3 real ranks with different data per rank."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

import hvdsync.torch as hvd
from hvdsync import DelayConfig
from hvdsync.techniques.delay.technique import DelayPolicy, staleness_histogram
from hvdsync.core.stats import SyncStats
from tests.models import (LOGIC_IDS, LOGIC_JOBS, MLP, REAL_NP, REAL_NP_IDS,
                          assert_construction_fails, job_group, logic_runs,
                          teacher_batches)


def make_opt(model: nn.Module, opt_name: str) -> torch.optim.Optimizer:
    return {"sgd": lambda p: torch.optim.SGD(p, lr=0.1),
            "momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=0.01)}[opt_name](model.parameters())


def delay_body(cfg: dict, opt_name: str, steps: int, slow_rank: int = -1,
               sleep_s: float = 0.0) -> dict:
    """Train a float64 MLP with delay=cfg. Per step: this rank's local gradients (seen by
    hooks registered before the wrapper's), the ids folded in, the parameters and the
    optimizer state after the step. ``slow_rank`` sleeps ``sleep_s`` before each backward."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP().double()
    named = dict(model.named_parameters())
    local: dict[str, torch.Tensor] = {}
    for n, p in named.items():
        p.register_post_accumulate_grad_hook(
            lambda p, n=n: local.__setitem__(n, p.grad.detach().clone()))
    opt = hvd.DistributedOptimizer(make_opt(model, opt_name),
                                   named_parameters=model.named_parameters(), delay=cfg)
    rec = dict(theta0={n: p.detach().numpy().copy() for n, p in named.items()},
               grads=[], folded=[], waited=[], params=[], state=[], outstanding=[])
    for x, y in teacher_batches(hvd.rank(), steps):
        if hvd.rank() == slow_rank:
            time.sleep(sleep_s)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.double()), y).backward()
        opt.step()
        rec["grads"].append({n: g.numpy().copy() for n, g in local.items()})
        status = opt.delay_status
        rec["folded"].append(status["last_folded"])
        rec["waited"].append(status["last_waited"])
        rec["outstanding"].append(status["outstanding"])
        rec["params"].append({n: p.detach().numpy().copy() for n, p in named.items()})
        rec["state"].append({f"{n}.{k}": v.numpy().copy() for n, p in named.items()
                             for k, v in opt.state.get(p, {}).items()
                             if torch.is_tensor(v) and v.shape == p.shape})
    rec["stats"] = opt.stats.as_dict()
    rec["staleness"] = status["staleness"]
    rec["saved_step"] = opt.state_dict()["hvdsync"]["techniques"]["delay"]["policy"]["step"]
    return rec


STEPS = 12
CASES = {
    # staleness 2, average every 4: steps 4, 8, 12 drain and average
    "sgd": (dict(staleness=2, average_every=4), "sgd", STEPS),
    "momentum": (dict(staleness=2, average_every=4), "momentum", STEPS),
    "adam": (dict(staleness=1, average_every=3), "adam", STEPS),
    "state_average": (dict(staleness=2, average_every=4, optimizer_state="average"),
                      "momentum", STEPS),
    # a rank 25 ms slower per step: the others run ahead until the bound makes them wait
    "slow_rank": (dict(staleness=1, average_every=4), "momentum", STEPS, 1, 0.025),
    "slow_rank_loose": (dict(staleness=3, average_every=6), "adam", STEPS, 0, 0.025),
}


@pytest.fixture(scope="module", params=LOGIC_JOBS, ids=LOGIC_IDS)
def runs(request):
    runs = logic_runs(request, delay_body, CASES)
    runs["launcher"] = request.param[1]
    return runs


def averaging_steps(case: str) -> list[int]:
    k = CASES[case][0]["average_every"]
    return [t for t in range(1, STEPS + 1) if t % k == 0]


@pytest.mark.parametrize("case", list(CASES))
def test_every_global_gradient_used_exactly_once_within_the_bound(runs, case):
    staleness = CASES[case][0]["staleness"]
    for rank, r in enumerate(runs[case]):
        used = [j for ids in r["folded"] for j in ids]
        assert sorted(used) == list(range(1, STEPS + 1)), (rank, r["folded"])
        for t, ids in enumerate(r["folded"], start=1):
            assert ids == sorted(ids, reverse=True), "not newest first"
            assert all(0 <= t - j <= staleness for j in ids), (rank, t, ids)
            # no id older than the bound is still outstanding after a step
            assert all(t - j < staleness for j in r["outstanding"][t - 1]), (rank, t)
        for t in averaging_steps(case):
            assert r["outstanding"][t - 1] == [], f"step {t} did not drain"
        hist = r["staleness"]
        assert sum(hist.values()) == STEPS and max(hist) <= staleness, hist


@pytest.mark.parametrize("case", list(CASES))
def test_parameters_equal_on_all_ranks_after_each_averaging_step(runs, case):
    results = runs[case]
    for t in averaging_steps(case):
        for rank, r in enumerate(results[1:], start=1):
            for n, v in r["params"][t - 1].items():
                diff = np.abs(v - results[0]["params"][t - 1][n]).max()
                assert diff == 0.0, f"{case} step {t} {n} rank {rank}: {diff}"
    # and between averaging steps the replicas did drift (the technique did something)
    drift = max(np.abs(r["params"][0][n] - results[0]["params"][0][n]).max()
                for r in results[1:] for n in r["params"][0])
    assert drift > 0


def test_plain_sgd_folds_exactly(runs):
    """Plain SGD makes the fold arithmetic visible: after step t every rank holds
    theta_0 - lr * (sum of the global gradients it folded + its own unfolded local ones),
    with G_j the mean over ranks of the recorded local gradients."""
    results = runs["sgd"]
    lr = 0.1
    for rank, r in enumerate(results):
        folded: set[int] = set()
        for t in range(1, STEPS + 1):
            folded |= set(r["folded"][t - 1])
            for n, theta0 in r["theta0"].items():
                total = np.zeros_like(theta0)
                for j in range(1, t + 1):
                    if j in folded:
                        total += np.mean([q["grads"][j - 1][n] for q in results], axis=0)
                    else:
                        total += r["grads"][j - 1][n]
                diff = np.abs(r["params"][t - 1][n] - (theta0 - lr * total)).max()
                assert diff <= 1e-10, f"rank {rank} step {t} {n}: {diff}"


def test_optimizer_state_local_or_averaged(runs):
    """"local": each rank keeps its own momentum (they differ after averaging steps);
    "average": the momentum buffers are averaged with the parameters."""
    for case, equal in (("momentum", False), ("state_average", True)):
        results = runs[case]
        for t in averaging_steps(case):
            diff = max(np.abs(r["state"][t - 1][k] - results[0]["state"][t - 1][k]).max()
                       for r in results[1:] for k in r["state"][t - 1])
            assert (diff == 0.0) == equal, (case, t, diff)


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_waits_only_for_what_the_bound_or_a_drain_makes_due(runs, case):
    cfg = CASES[case][0]
    for rank, r in enumerate(runs[case]):
        for t, ids in enumerate(r["waited"], start=1):
            drain = t % cfg["average_every"] == 0
            assert all(drain or t - j >= cfg["staleness"] for j in ids), (rank, t, ids)
            assert set(ids) <= set(r["folded"][t - 1]), (rank, t)  # what it waited for, it used
        waited_steps = sum(bool(ids) for ids in r["waited"])
        assert waited_steps == r["stats"]["total"].get("waited", 0)
        assert r["saved_step"] == STEPS
    # a slow rank: the others wait for it (real time: simulated ranks run one at a time, so a
    # sleeping rank holds the others back instead of letting them run ahead)
    if len(CASES[case]) > 3 and runs["launcher"] != "simulated":
        slow = CASES[case][3]
        for rank, r in enumerate(runs[case]):
            if rank == slow:
                continue
            assert any(r["waited"]), f"rank {rank} never waited for the slow rank"
            if cfg["staleness"] == 1:  # 25 ms behind per step: due by the bound, not a drain
                assert any(ids and t % cfg["average_every"]
                           for t, ids in enumerate(r["waited"], start=1)), r["waited"]


# -- synchronous settings equal Horovod ----------------------------------------------------
def parity_body(cfg: dict, opt_name: str, steps: int, fp16: bool) -> float:
    import hvdsync.torch as hvd
    import horovod.torch as horovod
    hvd.init()
    torch.set_num_threads(1)
    compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
    models, opts = [], []
    for wrapper, kwargs in ((horovod.DistributedOptimizer, {}),
                            (hvd.DistributedOptimizer, dict(delay=cfg))):
        torch.manual_seed(0)
        m = MLP()
        models.append(m)
        opts.append(wrapper(make_opt(m, opt_name), named_parameters=[
            (f"{len(opts)}.{n}", p) for n, p in m.named_parameters()],
            compression=compression, **kwargs))
    for x, y in teacher_batches(hvd.rank(), steps):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    assert opts[1].delay_status["staleness"] == {0: steps}
    return max((a - b).abs().max().item()
               for a, b in zip(models[0].parameters(), models[1].parameters()))


PARITY = {  # case: (delay, optimizer, steps, fp16 compression)
    "s0-momentum": (dict(staleness=0, average_every=4), "momentum", 20, False),
    "s0-adam": (dict(staleness=0, average_every=4), "adam", 20, False),
    "k1-momentum": (dict(staleness=2, average_every=1), "momentum", 20, False),
    "k1-adam": (dict(staleness=2, average_every=1), "adam", 20, False),
    "s0-fp16": (dict(staleness=0), "momentum", 20, True),
}


@pytest.fixture(scope="module", params=REAL_NP, ids=REAL_NP_IDS)
def parity_runs(request, torch_job):
    return torch_job(request.module, request.param, "parity")


@pytest.mark.parametrize("case", list(PARITY))
def test_synchronous_settings_equal_horovod(parity_runs, case):
    # fp16 ring sums depend on where a tensor sits in Horovod's fusion buffer (3 ranks)
    tol = 5e-4 if PARITY[case][3] else 1e-6
    for diff in parity_runs[case]:
        assert diff <= tol


# -- flush, save / restore -------------------------------------------------------------------
def flush_body() -> dict:
    """7 steps with K=4 leave global gradients outstanding; flush() makes replicas equal. A
    checkpoint taken after flush() restores the step counter (the averaging schedule)."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = MLP()
    cfg = dict(staleness=2, average_every=4)
    opt = hvd.DistributedOptimizer(make_opt(model, "momentum"),
                                   named_parameters=model.named_parameters(), delay=cfg)
    batches = teacher_batches(hvd.rank(), 7)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dropped = opt.flush()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = hvd.allgather(params.unsqueeze(0), name="flush.params")
    again = opt.flush()  # right after averaging: nothing to do
    state = opt.state_dict()
    opt2 = hvd.DistributedOptimizer(make_opt(model, "momentum"),
                                    named_parameters=model.named_parameters(), delay=cfg)
    opt2.load_state_dict(state)
    return dict(dropped=dropped, again=again, spread=(gathered - gathered[0]).abs().max().item(),
                discarded=opt.stats._current.counters.get("discarded", 0),
                restored_step=opt2.delay_status["step"])


def test_flush_makes_replicas_identical_and_checkpoint_keeps_the_schedule(request, torch_job):
    for r in torch_job(request.module, 3, "flush")["flush"]:
        assert r["spread"] == 0.0
        assert 0 <= r["dropped"] <= 2 and r["discarded"] == r["dropped"]
        assert r["again"] == 0
        assert r["restored_step"] == 7


# -- converges --------------------------------------------------------------------------------
def digits_body(delay: dict | None) -> float:
    from examples.torch.train_digits import train
    return train(epochs=8, delay=delay, verbose=False)["accuracy"]


def test_converges_on_digits_with_stale_gradients(request, torch_job):
    acc = torch_job(request.module, 2, "digits")["stale"][0]
    assert acc >= 0.93, acc


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared torch job (tests/conftest.py)."""
    cases = job_group("parity", parity_body, PARITY)
    if np_ == 2:
        cases.update(job_group("logic", delay_body, CASES))
        cases.update(job_group("digits", digits_body,
                               {"stale": (dict(staleness=2, average_every=8),)}))
    if np_ == 3:
        cases.update(job_group("flush", flush_body, {"flush": ()}))
    return cases


# -- the schedule alone ---------------------------------------------------------------------
def test_policy_waits_at_the_bound_and_drains_on_averaging_steps():
    policy = DelayPolicy(DelayConfig(staleness=2, average_every=5), SyncStats([]))
    policy.step = 5  # step 6 in progress
    assert policy.plan([4, 5, 6], ready=set()) == ([4], [4])
    assert policy.plan([4, 5, 6], ready={5, 6}) == ([4], [6, 5, 4])
    assert policy.plan([5, 6], ready={6}) == ([], [6])
    policy.step = 9  # step 10 averages
    assert policy.averages_now()
    assert policy.plan([8, 9, 10], ready={8}) == ([9, 10], [10, 9, 8])
    sync = DelayPolicy(DelayConfig(staleness=0), SyncStats([]))
    assert sync.plan([1], ready=set()) == ([1], [1]) and not sync.averages_now()
    # fold="due": what has arrived waits for its turn (the bound, or the drain)
    due = DelayPolicy(DelayConfig(staleness=2, average_every=5, fold="due"), SyncStats([]))
    due.step = 5
    assert due.plan([4, 5, 6], ready={4, 5, 6}) == ([], [4])
    assert due.plan([5, 6], ready={5, 6}) == ([], [])
    due.step = 9
    assert due.plan([8, 9, 10], ready={8}) == ([9, 10], [10, 9, 8])


def test_staleness_histogram_from_counters():
    assert staleness_histogram({"staleness_2": 3, "waited": 1, "staleness_0": 5}) == {0: 5, 2: 3}


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(delay=dict(staleness=-1)), ValueError, "staleness must be an int >= 0"),
    (dict(delay=dict(average_every=0)), ValueError, "average_every must be an int >= 1"),
    (dict(delay=dict(staleness=1.5)), ValueError, "staleness must be an int"),
    (dict(delay=dict(optimizer_state="sum")), ValueError, "optimizer_state must be one of"),
    (dict(delay=dict(stale=1)), TypeError,
     r"unknown key\(s\) 'stale' \(did you mean 'staleness'\?\)"),
    (dict(delay=[1]), TypeError, "delay must be a DelayConfig"),
    (dict(delay=2, op=hvd.Sum), ValueError, "needs op=Average"),
    (dict(delay=2, threshold=0.5), ValueError, "cannot be combined with threshold"),
    (dict(delay=2, select=1), ValueError, "cannot be combined with select"),
    (dict(delay=2, sparse=True), ValueError, "cannot be combined with sparse"),
    (dict(delay=2, clip=dict(max_norm=1.0, mode="global")), ValueError, "clip mode 'local'"),
])
def test_bad_config_fails_at_construction(kwargs, exc, pattern):
    assert_construction_fails(exc, pattern, **kwargs)


def test_config_shorthands():
    assert DelayConfig.coerce(True) == DelayConfig()
    assert DelayConfig.coerce(3) == DelayConfig(staleness=3)
    assert DelayConfig.coerce(False) is None
    assert DelayConfig(staleness=0).synchronous and DelayConfig(average_every=1).synchronous
