"""``flush()`` means identical replicas, for every technique and every pair that combines
(torch, 2 and 3 real ranks, different data per rank), also with gradient accumulation,
parameter groups, a frozen parameter and a learning-rate scheduler -- on both backends
(Horovod and torch.distributed), which must give the same parameters.

``threshold=`` is the case that needs work: its skipped layers take provisional local steps,
so before ``flush()`` the replicas differ; ``flush()`` synchronizes every pending layer as its
due sync would. "Nothing lost, nothing counted twice" is checked against plain SGD's algebra:
every sync puts a layer back at its last sync point and takes one step with the ranks'
averaged accumulation, so after ``flush()`` the parameters are the start minus the learning
rate times the sum over steps of the rank-averaged gradients, whatever was skipped when."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from torch import nn

from hvdsync.core import rules
from hvdsync.testing import run_threads
from tests.models import SHARED_JOBS, MLP, job_group, run_cases, shared_runs, teacher_batches
from tests.test_torch_compositions import BagModel, bag_batches

STEPS, MORE = 11, 3
# what each technique is given here (small enough that something is pending at the flush)
TECHNIQUES = {
    "clip": dict(clip=dict(max_norm=0.5)),
    "threshold": dict(threshold=dict(threshold=0.6, max_skip=4)),
    "select": dict(select=dict(k=1, max_wait=2)),
    "sparse": dict(sparse=True),
    "lowrank": dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0)),
    "delay": dict(delay=dict(staleness=2, average_every=4)),
}


def _combines(names: tuple[str, ...]) -> bool:
    try:
        rules.configure(op="average", sparse_as_dense=False,
                        **{k: v for n in names for k, v in TECHNIQUES[n].items()})
        return True
    except ValueError:
        return False


SINGLES = [(n,) for n in TECHNIQUES]
PAIRS = [p for p in itertools.combinations(TECHNIQUES, 2) if _combines(p)]
# the outer synchronization (local steps, K 8 in fragments, int8): exchanges in flight
OUTER = dict(delay="streaming")
# hard: 2 backward passes, 2 parameter groups, a frozen bias, StepLR, and Horovod's start of
# training (broadcast_parameters + broadcast_optimizer_state, which runs a local init step and
# hands over rank 0's technique state)
SETUPS = ("plain", "hard")


def _options(names: tuple[str, ...]) -> dict:
    if names == ("outer",):
        return dict(OUTER)
    return {k: v for n in names for k, v in TECHNIQUES[n].items()}


def flush_body(names: tuple[str, ...], setup: str, momentum: float,
               group_mb: float | None = None) -> dict:
    """Train, flush, train a little more, flush again; every rank's parameters both times,
    the largest spread before the first flush, and this rank's summed local gradients.
    ``group_mb``: the ready groups' size (None: the default, here one group)."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    bag = "sparse" in names
    model = BagModel() if bag else MLP()
    hard = setup == "hard"
    passes = 1 if setup == "plain" else 2  # "passes": gradient accumulation alone
    if hard:
        (model.fc if bag else model.fc1).bias.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    head = list(model.head.parameters()) if bag else list(model.out.parameters())
    rest = [p for p in params if all(p is not h for h in head)]
    groups = ([{"params": rest}, {"params": head, "lr": 0.05}] if hard
              else [{"params": params}])
    base = torch.optim.SGD(groups, lr=0.1, momentum=momentum)
    sizes = {} if group_mb is None else dict(group_mb=group_mb)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **_options(names), **sizes)
    if hard:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5) if hard else None
    batches = (bag_batches(hvd.rank(), (STEPS + MORE) * passes) if bag
               else [(x, None, y) for x, y in
                     teacher_batches(hvd.rank(), (STEPS + MORE) * passes)])
    start = [p.detach().clone() for p in params]
    local_sum = [torch.zeros_like(p) for p in params]

    def train(steps: range) -> None:
        for t in steps:
            opt.zero_grad()
            for x, offsets, y in batches[t * passes:(t + 1) * passes]:
                loss = nn.functional.cross_entropy(model(x, offsets) if bag else model(x), y)
                # this rank's own gradient, as the technique receives it
                for acc, g in zip(local_sum, torch.autograd.grad(loss, params,
                                                                 retain_graph=True)):
                    acc += g.to_dense() if g.is_sparse else g
                loss.backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()

    def gathered() -> np.ndarray:
        flat = torch.cat([p.detach().flatten() for p in params]).unsqueeze(0)
        return hvd.allgather(flat, name="flush.params").numpy()

    train(range(STEPS))
    before = gathered()
    pending = len(opt.techniques["threshold"].anchor) if "threshold" in names else None
    opt.flush()
    first_flush = gathered()
    train(range(STEPS, STEPS + MORE))
    opt.flush()
    second_flush = gathered()
    return dict(spread_before=float(np.abs(before - before[0]).max()), pending=pending,
                first=first_flush, second=second_flush,
                start=torch.cat([p.flatten() for p in start]).numpy(),
                local_sum=torch.cat([g.flatten() for g in local_sum]).numpy())


CASES = {f"{'+'.join(names)}/{setup}": (names, setup, 0.9)
         for names in SINGLES + PAIRS + [("outer",)] for setup in SETUPS}
# plain SGD at a constant lr: the algebra of "nothing lost" holds (up to float32 rounding)
ALGEBRA = {f"threshold/{setup}/sgd": (("threshold",), setup, 0.0)
           for setup in ("plain", "passes")}


# ready groups of every layer alone (each sent from its hook) and of the last two layers
# (sent in backward) then the first (in synchronize()): the same arithmetic as one group
GROUP_SIZES = {"alone": 0.0, "two": 1300 / 2**20}  # the MLP's out + fc2: 1360 bytes
GROUPED = {f"{'+'.join(names)}/groups_{size}": (names, "plain", 0.9, mb)
           for names in SINGLES + [("outer",)] for size, mb in GROUP_SIZES.items()}

_RUNS: dict[tuple[int, str], dict] = {}


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """Horovod's runs, in the session's shared torch job (tests/conftest.py)."""
    grouped = GROUPED if np_ == 2 else {}
    return (job_group("flush", flush_body, {**CASES, **ALGEBRA, **grouped}) if np_ in (2, 3)
            else {})


def torchrun_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """torch.distributed's runs, in the session's shared torchrun job."""
    return job_group("flush", flush_body, {**CASES, **ALGEBRA, **GROUPED}) if np_ == 2 else {}


def _flush_runs(request, np_: int, launcher: str) -> dict:
    """Every case on ``np_`` ranks of ``launcher``'s backend: the shared jobs' (real ranks), or
    one job per module (simulated)."""
    if launcher in SHARED_JOBS:
        return shared_runs(request, np_, launcher, "flush")
    if (np_, launcher) not in _RUNS:
        _RUNS[np_, launcher] = run_cases(flush_body, np_, {**CASES, **ALGEBRA}, timeout=600,
                                         launcher=launcher)
    return _RUNS[np_, launcher]


#: torch.distributed at 2 ranks (bit for bit with Horovod); at 3 ranks its agreement with
#: Horovod is the parity tests' (tests/test_torch_parity.py, tests/test_torch_backend.py):
#: this matrix cost a 3-process job ~30 s on 2 cores
JOBS = [(2, "horovodrun"), (3, "horovodrun"), (2, "torchrun"), (2, "simulated"),
        (3, "simulated")]


@pytest.fixture(scope="module", params=JOBS, ids=[f"np{n}-{lau}" for n, lau in JOBS])
def flush_runs(request):
    return _flush_runs(request, *request.param)


# 2 ranks: a sum of two is the same in any order, so the backends agree to the bit; 3 ranks:
# Horovod's ring, c10d's Gloo allreduce and the simulation add in different orders (float32
# rounding)
BACKEND_TOL = {2: 0.0, 3: 1e-5}


# delay='s stale-gradient scheme folds in the global gradients that have arrived: when they
# arrive decides the result, run to run on either backend (its replicas still match after
# flush(), above); the outer synchronization ("outer") is on the step counter alone
REPRODUCIBLE = [c for c in CASES if "delay" not in c]


OTHERS = [(n, launcher) for n, launcher in JOBS if launcher != "horovodrun"]


@pytest.mark.parametrize("np_, other", OTHERS, ids=[f"{lau}-{n}" for n, lau in OTHERS])
@pytest.mark.parametrize("case", REPRODUCIBLE)
def test_same_parameters_on_every_backend(request, np_, other, case):
    """torch.distributed and the simulated ranks (which sum in rank order) give Horovod's
    parameters."""
    on_horovod = _flush_runs(request, np_, "horovodrun")[case][0]
    on_other = _flush_runs(request, np_, other)[case][0]
    for key in ("first", "second"):
        np.testing.assert_allclose(on_other[key], on_horovod[key], rtol=0,
                                   atol=BACKEND_TOL[np_], err_msg=f"{case} {key}")


@pytest.mark.parametrize("case", list(CASES))
def test_flush_leaves_identical_replicas(flush_runs, case):
    ranks = flush_runs[case]
    for r in ranks:
        for key in ("first", "second"):
            assert np.isfinite(r[key]).all()
            for row in r[key][1:]:
                np.testing.assert_array_equal(row, r[key][0], err_msg=f"{case} {key}")


@pytest.mark.parametrize("setup", SETUPS)
def test_threshold_replicas_differed_before_the_flush(flush_runs, setup):
    """The test can fail: with layers pending, the replicas were apart before flush()."""
    r = flush_runs[f"threshold/{setup}"][0]
    assert r["pending"] > 0 and r["spread_before"] > 1e-4, r


@pytest.mark.parametrize("setup", ["plain", "passes"])
def test_threshold_flush_loses_nothing_and_folds_once(flush_runs, setup):
    """Plain SGD: after flush() the parameters are the start minus lr times the sum over
    all steps of the rank-averaged local gradients (with 2 backward passes: both passes)."""
    ranks = flush_runs[f"threshold/{setup}/sgd"]
    assert ranks[0]["pending"] > 0
    mean_sum = np.mean([r["local_sum"] for r in ranks], axis=0)
    expected = ranks[0]["start"] - 0.1 * mean_sum
    np.testing.assert_allclose(ranks[0]["second"][0], expected, rtol=0, atol=2e-5)
    # and at the first flush the replicas were already identical (checked per case above)
    assert not np.array_equal(ranks[0]["first"][0], ranks[0]["second"][0])


GROUPED_JOBS = [(2, "horovodrun"), (2, "torchrun")]


@pytest.mark.parametrize("np_, launcher", GROUPED_JOBS, ids=[f"{lau}" for _, lau in GROUPED_JOBS])
@pytest.mark.parametrize("case", list(GROUPED))
def test_ready_groups_change_no_bit(request, np_, launcher, case):
    """However backward's layers are grouped (each alone, two together, all in one), a
    technique computes the same: the same parameters bit for bit (delay='s stale-gradient
    scheme, which folds what has arrived, leaves identical replicas); and where collectives
    pair by order (torch.distributed) groups cut at different layers still start them alike."""
    runs = _flush_runs(request, np_, launcher)
    ranks = runs[case]
    for r in ranks:
        for key in ("first", "second"):
            for row in r[key][1:]:
                np.testing.assert_array_equal(row, r[key][0], err_msg=f"{case} {key}")
    names = case.split("/")[0]
    if "delay" in names.split("+"):
        return
    one_group = runs[f"{names}/plain"]
    for key in ("first", "second"):
        np.testing.assert_array_equal(ranks[0][key], one_group[0][key], err_msg=f"{case} {key}")


def first_group(group_mb: float | None) -> tuple[int, int]:
    """Eight 256x256 layers (257 KB of gradients each), one step: the step's ready groups, and
    how many layers' sends started before backward ended."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), clip=1.0,
                                   **({} if group_mb is None else dict(group_mb=group_mb)))
    x = torch.randn(4, 256, requires_grad=True)
    ends: list[float] = []
    x.register_hook(lambda g: ends.append(time.perf_counter()))  # the end of backward
    model(x).square().mean().backward()
    opt.step()
    return (opt.stats.last.counters["ready_groups"],
            sum(t < ends[0] for _, t in opt.send_times))


@pytest.mark.parametrize("group_mb, groups, early", [
    (None, 2, 4),  # 25 MiB groups, the first closed at 1 MiB: 4 layers sent during backward
    (25.0, 1, 0),  # every group 25 MiB: one, sent when backward ends
    (0.3, 4, 6),  # 2 layers a group
    (0.0, 8, 7),  # every layer alone
], ids=["default", "one", "small", "alone"])
def test_the_default_first_ready_group_closes_at_1_mib_and_sends_during_backward(
        group_mb, groups, early):
    for got in run_threads(first_group, 2, args=(group_mb,)):
        assert got == (groups, early)
