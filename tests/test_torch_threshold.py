"""``threshold=`` (torch): accumulation thresholds, on 2 and 3 real ranks with different data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hvdsync.torch as hvd
from hvdsync import ThresholdConfig
from tests.models import (LOGIC_IDS, LOGIC_JOBS, MLP, REAL_NP, REAL_NP_IDS,
                          assert_construction_fails, call, job_group, logic_runs,
                          teacher_batches)


def threshold_body(cfg: dict, opt_name: str, steps: int) -> dict:
    """Train with a threshold; per step record which layers were sent and, for those, the
    parameters right after the step (to compare across ranks)."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    m = MLP()
    base = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05),
            "momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=0.01)}[opt_name](m.parameters())
    opt = hvd.DistributedOptimizer(base, named_parameters=m.named_parameters(), threshold=cfg)
    layer_names = [layer.name for layer in opt.layers]
    named = dict(m.named_parameters())
    sent_per_step, synced_params, payload = [], [], []
    before = {n: 0 for n in layer_names}
    for x, y in teacher_batches(hvd.rank(), steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        sent = [n for n in layer_names if opt.stats.layers[n].sent > before[n]]
        before = {n: opt.stats.layers[n].sent for n in layer_names}
        sent_per_step.append(sent)
        synced_params.append({n: named[f"{n}.weight"].detach().numpy().copy() for n in sent})
        payload.append(opt.stats.last.bytes_sent)
    return dict(sent=sent_per_step, params=synced_params, payload=payload,
                stats=opt.stats.as_dict(),
                # one value per layer (two when relative), plus the shared "some rank is
                # non-finite" flag, in the gradients' precision (float32 here)
                control_bytes=4 * (len(layer_names) * (2 if cfg.get("relative") else 1) + 1),
                final={n: p.detach().numpy().copy() for n, p in named.items()})


CASES = {
    # A threshold in the range of the accumulated norms: a mix of sends and skips.
    "sgd": (dict(threshold=1.0, max_skip=4), "sgd", 200),
    "momentum": (dict(threshold=1.0, max_skip=4), "momentum", 200),
    "adam": (dict(threshold=1.0, max_skip=4), "adam", 200),
    "relative": (dict(threshold=0.5, relative=True, max_skip=6), "momentum", 60),
    "global": (dict(threshold=1.5, scope="global", max_skip=4), "momentum", 60),
    # Never reached: only the bound forces syncs (every 4th step).
    "bound": (dict(threshold=1e9, max_skip=3), "momentum", 12),
    "periodic": (dict(threshold=1e9, sync_every=5), "adam", 15),
}


@pytest.fixture(scope="module", params=LOGIC_JOBS, ids=LOGIC_IDS)
def runs(request):
    return logic_runs(request, threshold_body, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_same_decisions_and_synced_layers_equal_on_all_ranks(runs, case):
    results = runs[case]
    for r in results[1:]:
        assert r["sent"] == results[0]["sent"], "ranks disagreed on which layers to send"
    for step, sent in enumerate(results[0]["sent"]):
        for name in sent:
            for rank, r in enumerate(results[1:], start=1):
                diff = np.abs(r["params"][step][name] - results[0]["params"][step][name]).max()
                assert diff <= 1e-6, f"{case} step {step} layer {name} rank {rank}: {diff}"


@pytest.mark.parametrize("case", ["sgd", "momentum", "adam", "relative", "global"])
def test_mixed_sends_and_skips(runs, case):
    s = runs[case][0]["stats"]["total"]
    assert s["layers_sent"] > 0 and s["layers_skipped"] > 0, s
    assert s["bytes_sent"] < s["bytes_dense"]
    if case == "global":  # one decision for the whole model
        assert all(len(sent) in (0, 3) for sent in runs[case][0]["sent"])


def test_large_threshold_sends_nothing_until_the_bound(runs):
    r = runs["bound"][0]
    assert [len(s) for s in r["sent"]] == [0, 0, 0, 3] * 3
    # Skipped steps carry only the control-plane bytes.
    for step, sent in enumerate(r["sent"]):
        if not sent:
            assert r["payload"][step] == r["control_bytes"]
    # After the forced sync the whole model is identical on every rank.
    for other in runs["bound"][1:]:
        for n, v in r["final"].items():
            np.testing.assert_allclose(other["final"][n], v, rtol=0, atol=1e-6)


def test_periodic_sync(runs):
    r = runs["periodic"][0]
    assert [len(s) for s in r["sent"]] == [0, 0, 0, 0, 3] * 3


# -- threshold 0 is Horovod ----------------------------------------------------------------
def parity_body(opt_name: str, steps: int) -> float:
    import copy

    import horovod.torch as horovod_hvd

    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    ref = MLP()
    ours = copy.deepcopy(ref)

    def make(model):
        if opt_name == "adam":
            return torch.optim.Adam(model.parameters(), lr=0.01)
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opts = [(ref, horovod_hvd.DistributedOptimizer(make(ref), named_parameters=ref.named_parameters())),
            (ours, hvd.DistributedOptimizer(make(ours), named_parameters=ours.named_parameters(),
                                            threshold=0.0))]
    for x, y in teacher_batches(hvd.rank(), steps):
        for model, opt in opts:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert opts[1][1].stats.total.layers_skipped == 0
    return max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters()))


SGD_LR, SGD_STEPS = 0.1, 24


@pytest.fixture(scope="module", params=REAL_NP, ids=REAL_NP_IDS)
def exact_runs(request, torch_job):
    """The exact-result cases, in the shared torch job per rank count."""
    return torch_job(request.module, request.param, "exact")


@pytest.mark.parametrize("opt_name", ["momentum", "adam"])
def test_threshold_zero_equals_horovod(exact_runs, opt_name):
    for diff in exact_runs[opt_name]:
        assert diff <= 1e-6


# -- convergence on learnable data ----------------------------------------------------------
def digits_body(threshold: dict | None, epochs: int, seed: int) -> dict:
    from examples.torch.train_digits import train
    return train(epochs=epochs, seed=seed, threshold=threshold, verbose=False)


DIGITS = {"dense": (None, 8, 0), "sparse": (dict(threshold=0.6, max_skip=8), 8, 0)}


def test_converges_on_digits_while_skipping_half_the_sends(request, torch_job):
    runs = torch_job(request.module, 2, "digits")
    dense, sparse = runs["dense"][0], runs["sparse"][0]
    skipped = sparse["stats"]["total"]["layers_skipped"]
    sent = sparse["stats"]["total"]["layers_sent"]
    assert skipped / (skipped + sent) >= 0.5, (skipped, sent)
    assert sparse["accuracy"] >= dense["accuracy"] - 0.01, (sparse["accuracy"], dense["accuracy"])


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared torch job (tests/conftest.py)."""
    cases = job_group("exact", call, {
        "momentum": (parity_body, "momentum", 20), "adam": (parity_body, "adam", 20),
        "sgd": (sgd_exact_body, SGD_STEPS, SGD_LR)})
    if np_ == 2:
        cases.update(job_group("logic", threshold_body, CASES))
        cases.update(job_group("digits", digits_body, DIGITS))
    return cases


# -- validation -----------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, exc, pattern", [
    (-1.0, ValueError, "threshold must be a finite number >= 0"),
    (float("nan"), ValueError, "threshold must be a finite number >= 0"),
    (float("inf"), ValueError, "threshold must be a finite number >= 0"),
    ("big", TypeError, "threshold must be a ThresholdConfig"),
    (dict(threshold=1.0, scope="model"), ValueError, "scope must be one of"),
    (dict(threshold=1.0, max_skip=0), ValueError, "max_skip must be None or an int >= 1"),
    (dict(threshold=1.0, sync_every=2.5), ValueError, "sync_every must be None or an int"),
    (dict(threshold=1.0, relative="yes"), TypeError, "relative must be True or False"),
    (dict(threshhold=1.0), TypeError, "threshhold"),
])
def test_bad_threshold_fails_at_construction(cfg, exc, pattern):
    assert_construction_fails(exc, pattern, threshold=cfg)


def test_threshold_shorthand():
    assert ThresholdConfig.coerce(0.5) == ThresholdConfig(threshold=0.5)


def test_state_dict_keeps_unsent_accumulations_and_sync_points():
    """Checkpointed mid-skip, the accumulations and sync points travel with the checkpoint
    (per rank); a checkpoint without them makes the layers forget theirs."""
    hvd.init()
    m = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=m.named_parameters(),
                                   threshold=dict(threshold=1e9, max_skip=5))
    for x, y in teacher_batches(0, 3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    t = opt.techniques["threshold"]
    assert t.acc and t.anchor
    state = opt.state_dict()
    saved = state["hvdsync"]["techniques"]["threshold"]
    # planned through step 4 (the plan is made a step ahead): skipping, 4 in a row
    assert saved["policy"] == {"skipped_for": [4, 4, 4], "step": 4}
    assert saved["plan"] == [False, False, False]
    assert set(saved["acc"]) == set(saved["anchor"]) == {str(i) for i in range(6)}
    acc = {k: v.clone() for k, v in t.acc.items()}
    opt.load_state_dict(state)
    assert set(t.acc) == set(acc) and all(torch.equal(t.acc[k], v) for k, v in acc.items())
    assert t.policy.skipped_for == [4, 4, 4] and t.plan == [False, False, False]
    del state["hvdsync"]
    opt.load_state_dict(state)
    assert not t.acc and not t.anchor


# -- the exact arithmetic of plain SGD ---------------------------------------------------------
def sgd_exact_body(steps: int, lr: float) -> dict:
    """float64 MLP, plain SGD and a threshold: this rank's local gradients (hooks registered
    before the wrapper's), the layers sent and the parameters after every step."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    m = MLP().double()
    named = dict(m.named_parameters())
    local: dict = {}
    for n, p in named.items():
        p.register_post_accumulate_grad_hook(
            lambda p, n=n: local.__setitem__(n, p.grad.detach().clone().numpy()))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=lr),
                                   named_parameters=m.named_parameters(),
                                   threshold=dict(threshold=0.8, max_skip=3))
    layers = [layer.name for layer in opt.layers]
    before = {n: 0 for n in layers}
    rec = dict(theta0={n: p.detach().numpy().copy() for n, p in named.items()},
               grads=[], sent=[], params=[])
    for x, y in teacher_batches(hvd.rank(), steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x.double()), y).backward()
        opt.step()
        rec["grads"].append(dict(local))
        now = {n: opt.stats.layers[n].sent for n in layers}
        rec["sent"].append([n for n in layers if now[n] > before[n]])
        before = now
        rec["params"].append({n: p.detach().numpy().copy() for n, p in named.items()})
    return rec


def test_plain_sgd_is_exactly_the_documented_arithmetic(exact_runs):
    """After a layer syncs at step t it holds ``theta_0 - lr * sum_{j<=t} mean_r g_j`` (what
    synchronous SGD would hold); between syncs, its last sync value minus ``lr`` times this
    rank's own gradients since (docs/threshold.md)."""
    lr, steps = SGD_LR, SGD_STEPS
    ranks = exact_runs["sgd"]
    sent = ranks[0]["sent"]
    assert 0 < sum(map(len, sent)) < 3 * steps  # a mix of syncs and skips
    for rank, r in enumerate(ranks):
        for name in r["theta0"]:
            layer = name.rsplit(".", 1)[0]
            synced = r["theta0"][name].copy()  # the value at the layer's last sync
            since = np.zeros_like(synced)  # sum over steps since then of the rank-mean gradient
            value = synced.copy()
            for t in range(steps):
                since += np.mean([q["grads"][t][name] for q in ranks], axis=0)
                if layer in sent[t]:
                    synced, since = synced - lr * since, np.zeros_like(synced)
                    value = synced.copy()
                else:
                    value = value - lr * r["grads"][t][name]
                np.testing.assert_allclose(r["params"][t][name], value, rtol=0, atol=1e-10,
                                           err_msg=f"rank {rank} step {t + 1} {name}")
