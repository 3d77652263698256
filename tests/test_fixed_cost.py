"""The fixed cost per step, counted as a GPU pays it: ops dispatched per step (each one not a
view is a kernel launch on CUDA), on 2 real ranks, against the bare optimizer's step and
torch's own ``clip_grad_norm_(foreach=True)`` in the same job. Counts, not timings: the same
numbers on every machine (benchmarks/bench_fixed_cost.py measures the time; docs/benchmarks.md,
"Fixed cost per step")."""

from __future__ import annotations

import math

import pytest
import torch

import hvdsync.torch as hvd
from benchmarks.bench_fixed_cost import METHODS, ops_body
from hvdsync.techniques.clip.technique import ClipPolicy
from hvdsync.techniques.clip.config import ClipConfig

BARE, FOREACH = "bare optimizer (no exchange)", "bare + clip_grad_norm_(foreach)"
OURS = [name for name, (kind, _) in METHODS.items() if kind == "hvdsync"]
DEPTHS = (12, 48)


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    if np_ != 2:
        return {}
    methods = [BARE, FOREACH, "horovod"] + OURS
    # 8 steps: delay="streaming" synchronizes a fragment every 2 (its mean over a cycle);
    # after 10 (warm-ups over); width 32 (what a step dispatches does not depend on it)
    return {"counts": (ops_body, methods, list(DEPTHS), 8, 10, 32, False)}


@pytest.fixture(scope="module")
def counts(torch_job, request):
    """Each method's ops per step on its costlier rank (lowrank='s Q rounds start in batches
    as this rank sees P arrive: a rank may dispatch an op more or less)."""
    ranks = torch_job(request.module, 2)["counts"]
    return {m: {d: dict(ops=max(r[m][d]["ops"] for r in ranks)) for d in DEPTHS}
            for m in ranks[0]}


def added(counts: dict, name: str, depth: int) -> float:
    return counts[name][depth]["ops"] - counts[BARE][depth]["ops"]


def test_clip_costs_at_most_twice_torch_foreach_clip(counts):
    # torch's clip_grad_norm_(foreach=True): 8 ops for one global norm
    assert added(counts, "clip=", 12) <= 2 * added(counts, FOREACH, 12), counts["clip="][12]
    assert added(counts, "clip= global", 12) <= 2 * added(counts, FOREACH, 12)


@pytest.mark.parametrize("name", [n for n in OURS if not n.startswith("clip=")])
def test_every_other_technique_adds_at_most_40_ops(counts, name):
    assert added(counts, name, 12) <= 40, counts[name][12]


@pytest.mark.parametrize("name", OURS)
def test_no_technique_grows_by_more_than_2_ops_per_layer(counts, name):
    lo, hi = DEPTHS
    growth = (added(counts, name, hi) - added(counts, name, lo)) / (hi - lo)
    assert growth <= 2.0, (name, added(counts, name, lo), added(counts, name, hi))


def test_the_plain_path_costs_nothing_per_layer_and_less_than_horovod(counts):
    for depth in DEPTHS:
        # the step's finite check (3), the entry tag's detach in Horovod's allreduce (a view
        # of a host tensor: no kernel on a GPU; hvdsync.safety.entries)
        assert added(counts, "hvdsync (nothing on)", depth) <= 4
        assert added(counts, "hvdsync (nothing on)", depth) < added(counts, "horovod", depth)


def test_an_adaptive_limit_of_zero_leaves_a_zero_gradient_zero():
    """Every norm seen was 0 (a dead layer): the limit is 0 and 0 / 0 must not turn the next
    zero gradient into NaN (the step would be skipped on every rank for nothing)."""
    hvd.init()
    policy = ClipPolicy(ClipConfig(ema=(0.9, 2.0), warmup=1), 1)
    policy.observe(0, 0.0)
    assert 0 < policy.norm_limit(0) < 1e-30
    lin = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1),
                                   named_parameters=lin.named_parameters(),
                                   clip=dict(ema=(0.9, 2.0), warmup=1))
    before = [p.detach().clone() for p in lin.parameters()]
    for _ in range(3):
        opt.zero_grad()
        (lin(torch.zeros(4, 3)) * 0).sum().backward()
        opt.step()
    assert opt.stats.total.counters.get("nonfinite_steps", 0) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, lin.parameters()))
    assert all(math.isfinite(x) for p in lin.parameters() for x in p.grad.flatten().tolist())
