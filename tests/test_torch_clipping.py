"""``clip=`` (torch): pipelined per-layer clipping, checked against a by-hand reference on
known gradients, on 2 and 3 real ranks."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

import hvdsync.torch as hvd
from hvdsync import ClipConfig
from tests.models import (LOGIC_IDS, LOGIC_JOBS, REAL_NP, REAL_NP_IDS, assert_construction_fails,
                          call, job_group, logic_runs)

SHAPES = {"a.weight": (3, 4), "a.bias": (3,), "b.weight": (2, 3), "b.bias": (2,)}
LAYERS = {"a": ["a.weight", "a.bias"], "b": ["b.weight", "b.bias"]}


def known_grads(rank: int, step: int, scales: dict) -> dict[str, np.ndarray]:
    """Rank ``rank``'s gradient at ``step``: fixed random directions times a per-(step, layer,
    rank) scale from ``scales`` (default 1)."""
    g = np.random.default_rng(1000 * step + rank)
    out = {}
    for layer, names in LAYERS.items():
        s = scales.get((step, layer, rank), scales.get((step, layer), 1.0))
        for n in names:
            out[n] = (g.standard_normal(SHAPES[n]) * s).astype(np.float32)
    return out


# -- the by-hand reference ---------------------------------------------------------------------
def reference(cfg: dict, np_: int, steps: int, scales: dict, params: dict) -> list[dict]:
    """Expected averaged gradients per step, computed directly from the rules."""
    c = ClipConfig(**cfg)
    history: dict[tuple[int, str], list[float]] = {}

    def norm_of(gs):
        return math.sqrt(sum(float((x.astype(np.float64) ** 2).sum()) for x in gs))

    def running(xs, beta):  # bias-corrected exponential average
        k = len(xs)
        w = [(1 - beta) * beta ** (k - 1 - i) for i in range(k)]
        return sum(wi * x for wi, x in zip(w, xs)) / (1 - beta ** k)

    def clip(layer, gs, key):
        raw = norm_of(gs)
        if c.value is not None:
            gs = [np.clip(x, *c.value) for x in gs]
        limit = math.inf
        if c.max_norm is not None:
            limit = c.max_norm
        if c.ratio is not None:
            limit = min(limit, c.ratio * max(norm_of([params[n] for n in LAYERS[layer]]), c.eps))
        hist = history.setdefault(key, [])
        if len(hist) >= max(c.warmup, 1):
            if c.ema is not None:
                limit = min(limit, c.ema[1] * running(hist, c.ema[0]))
            if c.variance is not None:
                beta, k = c.variance
                mean = running(hist, beta)
                var = max(running([h * h for h in hist], beta) - mean * mean, 0.0)
                limit = min(limit, mean + k * math.sqrt(var))
        hist.append(raw)
        n = norm_of(gs)
        return [x * (limit / n) for x in gs] if n > limit else gs

    out = []
    for t in range(steps):
        per_rank = [known_grads(r, t, scales) for r in range(np_)]
        avg = {}
        for layer, names in LAYERS.items():
            if c.mode == "local":
                clipped = [clip(layer, [g[n] for n in names], (r, layer))
                           for r, g in enumerate(per_rank)]
                summed = [sum(cl[i] for cl in clipped) / np_ for i in range(len(names))]
            else:
                mean = [sum(g[n] for g in per_rank) / np_ for n in names]
                summed = clip(layer, mean, (0, layer))
            avg.update(zip(names, summed))
        out.append(avg)
    return out


# -- the ranks -----------------------------------------------------------------------------
class Known(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2)


def clip_body(cfg: dict, steps: int, scales: dict, nan_at: tuple | None = None) -> dict:
    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    m = Known()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                   named_parameters=m.named_parameters(), clip=cfg)
    named = dict(m.named_parameters())
    grads, clipped, nonfinite = [], [], []
    for t in range(steps):
        g = known_grads(hvd.rank(), t, scales)
        if nan_at is not None and nan_at[:2] == (t, hvd.rank()):
            g[nan_at[2]][0] = np.nan
        loss = sum((named[n] * torch.from_numpy(g[n])).sum() for n in SHAPES)
        loss.backward()
        opt.step()
        grads.append({n: p.grad.numpy().copy() for n, p in named.items()})
        clipped.append(opt.stats.last.counters.get("clipped", 0))
        nonfinite.append(opt.stats.last.counters.get("nonfinite", 0))
        opt.zero_grad()
    return dict(grads=grads, clipped=clipped, nonfinite=nonfinite,
                params={n: p.detach().numpy().copy() for n, p in named.items()})


FIXED_CASES = {
    "norm": dict(max_norm=2.0),
    "value": dict(value=(-0.5, 0.5)),
    "ratio": dict(ratio=0.5),
    "value+norm": dict(value=(-1.5, 1.5), max_norm=3.0),
    "norm-global": dict(max_norm=2.0, mode="global"),
}
ADAPTIVE_CASES = {
    "ema": dict(ema=(0.9, 1.5), warmup=3),
    "variance": dict(variance=(0.8, 2.0), warmup=3),
    "ema+variance": dict(ema=(0.5, 2.0), variance=(0.9, 1.0), warmup=2),
}
# Layer a is large on rank 0 only at step 1; layer b is always small.
BIG = {(1, "a", 0): 10.0, (0, "b"): 0.1, (1, "b"): 0.1, (2, "b"): 0.1}
# Norms steady for the warm-up, then a spike on rank 1 at step 4 that must be clipped.
SPIKE = {(4, "a", 1): 20.0, (5, "b"): 5.0}
CASES = {**{k: (v, 3, BIG) for k, v in FIXED_CASES.items()},
         **{k: (v, 6, SPIKE) for k, v in ADAPTIVE_CASES.items()}}


@pytest.fixture(scope="module", params=LOGIC_JOBS, ids=LOGIC_IDS)
def rule_runs(request) -> tuple[int, dict[str, list[dict]]]:
    return request.param[0], logic_runs(request, clip_body, CASES, timeout=180)


def check_against_reference(name, rule_runs):
    np_, runs = rule_runs
    cfg, steps, scales = CASES[name]
    results = runs[name]
    expected = reference(cfg, np_, steps, scales, results[0]["params"])
    for rank, res in enumerate(results):
        for t in range(steps):
            for n in SHAPES:
                np.testing.assert_allclose(res["grads"][t][n], expected[t][n], rtol=1e-5,
                                           atol=1e-6, err_msg=f"rank {rank} step {t} {n}")
    return results


@pytest.mark.parametrize("name", list(FIXED_CASES))
def test_fixed_rules_match_reference(rule_runs, name):
    results = check_against_reference(name, rule_runs)
    assert sum(sum(r["clipped"]) for r in results) > 0  # the case does exercise clipping


@pytest.mark.parametrize("name", list(ADAPTIVE_CASES))
def test_adaptive_rules_match_reference(rule_runs, name):
    results = check_against_reference(name, rule_runs)
    assert results[1]["clipped"][4] >= 1  # the spike
    warmup = ADAPTIVE_CASES[name]["warmup"]
    assert all(c == 0 for r in results for c in r["clipped"][:warmup])


@pytest.fixture(scope="module", params=REAL_NP, ids=REAL_NP_IDS)
def horovod_runs(request, torch_job):
    """A NaN on one rank, and parity with Horovod: in the shared torch job per rank count."""
    return torch_job(request.module, request.param, "horovod")


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared torch job (tests/conftest.py)."""
    cases = job_group("horovod", call, {
        "nan": (clip_body, dict(max_norm=100.0), 3, {}, (1, 1, "a.weight")),
        "parity": (parity_and_overlap_body, 5)})
    if np_ == 2:
        cases.update(job_group("logic", clip_body, CASES))
    return cases


def test_nan_gradient_on_one_rank_voids_the_step_everywhere(horovod_runs):
    """Rank 1's NaN at step 1: every rank's gradients of that step are NaN after synchronize
    (the step is skipped everywhere: docs/failures.md); the steps around it are untouched."""
    results = horovod_runs["nan"]
    for rank, res in enumerate(results):
        assert all(np.isnan(g).all() for g in res["grads"][1].values()), rank
        assert all(np.isfinite(g).all() for t in (0, 2) for g in res["grads"][t].values())
    assert results[1]["nonfinite"] == [0, 1, 0]  # clip counts the layer on the rank it hit


# -- parity, pipelining, state ------------------------------------------------------------------
def parity_and_overlap_body(steps: int) -> dict:
    import copy

    import horovod.torch as horovod_hvd

    import hvdsync.torch as hvd
    from tests.models import teacher_batches
    hvd.init()
    torch.manual_seed(0)
    deep = [torch.nn.Linear(12, 64)] + [torch.nn.Linear(64, 64) for _ in range(6)] + \
           [torch.nn.Linear(64, 4)]
    ref = torch.nn.Sequential(*[x for layer in deep for x in (layer, torch.nn.Tanh())][:-1])
    clip = dict(max_norm=1e6, ratio=1e6, value=(-1e6, 1e6))
    layer_mb = (64 * 64 + 64) * 4 / 2**20  # one 64x64 layer's gradients
    # the default ready groups (the whole model, one group), a layer alone, two layers; and
    # nothing on, its default groups (on Horovod: every layer alone, as Horovod sends them)
    models = {size: copy.deepcopy(ref) for size in (None, 0.0, 1.5 * layer_mb, "plain")}
    opts = {size: hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        named_parameters=m.named_parameters(), **({} if size == "plain" else dict(clip=clip)),
        **({} if size in (None, "plain") else dict(group_mb=size))) for size, m in models.items()}
    o_ref = horovod_hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9),
                                             named_parameters=ref.named_parameters())
    overlap = {size: [] for size in models}
    for x, y in teacher_batches(hvd.rank(), steps):
        for size, model, opt in [(None, ref, o_ref)] + [(s, models[s], opts[s]) for s in models]:
            x_in = x.clone().requires_grad_(True)
            ends = []
            x_in.register_hook(lambda g: ends.append(time.perf_counter()))  # last grad of backward
            torch.nn.functional.cross_entropy(model(x_in), y).backward()
            opt.step()
            opt.zero_grad()
            if opt is not o_ref:
                started_before_end = sum(t < ends[0] for _, t in opt.send_times)
                overlap[size].append((started_before_end, len(opt.send_times)))
    diff = max((a - b).abs().max().item() for m in models.values()
               for a, b in zip(ref.parameters(), m.parameters()))
    return dict(diff=diff, overlap=list(overlap.values()),
                clipped=sum(o.stats.total.counters.get("clipped", 0) for o in opts.values()),
                groups=[o.stats.last.counters["ready_groups"] for o in opts.values()])


def test_no_clip_needed_equals_horovod_and_sends_overlap_backward(horovod_runs):
    for res in horovod_runs["parity"]:
        assert res["diff"] <= 1e-6 and res["clipped"] == 0
        whole, alone, pairs, plain = res["overlap"]
        for before, total in whole:  # one ready group: clipped and sent after backward
            assert total == 8 and before == 0, whole
        for before, total in alone:
            # 8 layers, each its own group: every layer but the first (whose gradient is
            # computed last) is clipped and its send started while backward was still running
            assert total == 8 and before == 7, alone
        for before, total in pairs:  # groups of 2-3 layers (the first layer alone: backward
            assert total == 8 and before == 7, pairs  # ends with it)
        for before, total in plain:  # nothing on, Horovod: each layer sent as it arrives
            assert total == 8 and before == 7, plain
        assert res["groups"] == [1, 8, 4, 8]


def test_clip_state_saved_and_restored():
    hvd.init()
    m = Known()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                   named_parameters=m.named_parameters(),
                                   clip=dict(ema=(0.9, 2.0), warmup=1))
    named = dict(m.named_parameters())
    for t in range(3):
        g = known_grads(0, t, {})
        sum((named[n] * torch.from_numpy(g[n])).sum() for n in SHAPES).backward()
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    m2 = Known()
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.0),
                                    named_parameters=m2.named_parameters(),
                                    clip=dict(ema=(0.9, 2.0), warmup=1))
    opt2.load_state_dict(state)
    assert opt2.techniques['clip'].policy.state_dict() == opt.techniques['clip'].policy.state_dict()
    assert opt2.techniques['clip'].policy.norm_limit(0) == opt.techniques['clip'].policy.norm_limit(0) < math.inf


@pytest.mark.parametrize("cfg, exc, pattern", [
    (dict(value=(1.0, 1.0)), ValueError, "low < high"),
    (dict(value=(2.0, -2.0)), ValueError, "low < high"),
    (dict(value=(float("nan"), 1.0)), ValueError, "must be finite"),
    (dict(value=3.0), TypeError, "pair of numbers"),
    (dict(max_norm=-1.0), ValueError, "max_norm must be > 0"),
    (dict(max_norm=float("nan")), ValueError, "max_norm must be finite"),
    (dict(max_norm=float("inf")), ValueError, "max_norm must be finite"),
    (dict(ratio=0.0), ValueError, "ratio must be > 0"),
    (dict(ema=(1.0, 2.0)), ValueError, "0 < beta < 1"),
    (dict(ema=(0.9, 0.0)), ValueError, "factor must be > 0"),
    (dict(variance=(0.9, -1.0)), ValueError, "k must be >= 0"),
    (dict(max_norm=1.0, warmup=-1), ValueError, "warmup"),
    (dict(max_norm=1.0, mode="before"), ValueError, "mode must be one of"),
    (dict(max_norm=1.0, nonfinite="zero"), TypeError, "nonfinite"),
    (dict(), ValueError, "at least one rule"),
    (dict(max_nrom=1.0), TypeError, "max_nrom"),
])
def test_bad_clip_config_fails_at_construction(cfg, exc, pattern):
    assert_construction_fails(exc, pattern, clip=cfg)


def test_clip_shorthands():
    assert ClipConfig.coerce(1.5) == ClipConfig(max_norm=1.5)
    assert ClipConfig.coerce({"value": [-1, 1]}).value == (-1.0, 1.0)
    with pytest.raises(TypeError, match="clip must be"):
        ClipConfig.coerce("1.0")
