"""``select=`` (torch): selected layer pushes with error feedback, on 2 and 3 real ranks
with different data per rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hvdsync import SelectConfig
from hvdsync.techniques.select.policy import SelectPolicy
from tests.models import (LOGIC_IDS, LOGIC_JOBS, REAL_NP, REAL_NP_IDS, assert_construction_fails,
                          call, check_pushes, job_group, logic_runs, teacher_batches)

DEPTH = 6  # linear layers in the test model


def deep_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for i in range(DEPTH):
        mods.append(nn.Linear(12 if i == 0 else 16, 4 if i == DEPTH - 1 else 16))
        if i < DEPTH - 1:
            mods.append(nn.Tanh())
    return nn.Sequential(*mods)


def make_opt(model, opt_name: str):
    if opt_name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def select_body(cfg: dict, opt_name: str, steps: int) -> dict:
    """Train with select=cfg. Per step: the layers pushed and the parameters after the step.
    Also the sum of this rank's local gradients (seen by a hook registered before the
    wrapper's), the sum of the averaged gradients received, and the final residuals."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    model = deep_mlp()
    named = dict(model.named_parameters())
    local_sum = {n: torch.zeros_like(p) for n, p in named.items()}
    def remember(p: torch.Tensor, n: str) -> None:  # a hook must return None
        local_sum[n].add_(p.grad)
    for n, p in named.items():
        p.register_post_accumulate_grad_hook(lambda p, n=n: remember(p, n))
    opt = hvd.DistributedOptimizer(make_opt(model, opt_name),
                                   named_parameters=model.named_parameters(), select=cfg)
    layer_names = [layer.name for layer in opt.layers]
    received = {n: torch.zeros_like(p) for n, p in named.items()}
    pushed, params, scores = [], [], []
    for x, y in teacher_batches(hvd.rank(), steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        pushed.append([ln for ln in layer_names if named[f"{ln}.weight"].grad is not None])
        for n, p in named.items():
            if p.grad is not None:
                received[n].add_(p.grad)
        with opt.skip_synchronize():
            opt.step()
        params.append({n: p.detach().numpy().copy() for n, p in named.items()})
        scores.append(opt.selection["scores"])
    memory = opt.techniques["select"].residual  # keyed by position in layer order
    key = {n: str(i) for i, n in enumerate(n for layer in opt.layers for n in layer.param_names)}
    residual = {n: memory[key[n]].numpy().copy() if key[n] in memory
                else np.zeros(tuple(p.shape), dtype=np.float32) for n, p in named.items()}
    return dict(pushed=pushed, params=params, scores=scores, layer_names=layer_names,
                local_sum={n: t.numpy() for n, t in local_sum.items()},
                received={n: t.numpy() for n, t in received.items()}, residual=residual,
                stats=opt.stats.as_dict())


CASES = {
    "hypernet": (dict(k=2, max_wait=3), "momentum", 40),
    "hypernet_adam": (dict(k=0.25, max_wait=4), "adam", 40),
    "norm": (dict(k=2, selector="norm", max_wait=3), "momentum", 40),
    "random": (dict(k=1, selector="random", max_wait=None), "momentum", 40),
    "forced": (dict(k=1, max_wait=1), "momentum", 20),  # bound forces more than k
    "seed_hypernet": (dict(k=2, max_wait=3, objective="first_order", inputs="embedding"),
                      "momentum", 40),
    "round_robin": (dict(k=2, selector="round_robin", max_wait=None), "momentum", 40),
    # a byte budget: 0.3 of the model's bytes per step, a bit more than one hidden layer
    "budget": (dict(budget=0.3, max_wait=None), "adam", 40),
    "budget_norm": (dict(budget=0.3, selector="norm", max_wait=6), "momentum", 40),
}


def layer_bytes() -> dict[str, int]:
    """Each layer's dense gradient bytes in the test model (weight + bias, float32)."""
    out: dict[str, int] = {}
    for n, p in deep_mlp().named_parameters():
        layer = n.rsplit(".", 1)[0]
        out[layer] = out.get(layer, 0) + p.numel() * 4
    return out


@pytest.fixture(scope="module", params=LOGIC_JOBS, ids=LOGIC_IDS)
def runs(request):
    return logic_runs(request, select_body, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_same_layers_pushed_on_all_ranks_and_replicas_identical(runs, case):
    results = runs[case]
    for r in results[1:]:
        assert r["pushed"] == results[0]["pushed"], "ranks pushed different layers"
    for step in range(len(results[0]["params"])):
        for r in results[1:]:
            for n, v in results[0]["params"][step].items():
                np.testing.assert_allclose(r["params"][step][n], v, rtol=0, atol=1e-6,
                                           err_msg=f"{case} step {step} {n}")


@pytest.mark.parametrize("case", list(CASES))
def test_residuals_are_exact(runs, case):
    """mean over ranks of all local gradients == what arrived + mean of the residuals."""
    results = runs[case]
    for n in results[0]["local_sum"]:
        local = np.mean([r["local_sum"][n] for r in results], axis=0)
        residual = np.mean([r["residual"][n] for r in results], axis=0)
        np.testing.assert_allclose(results[0]["received"][n] + residual, local, rtol=0,
                                   atol=1e-5, err_msg=f"{case} {n}")
    assert any(np.abs(r).max() > 0 for r in results[0]["residual"].values())


@pytest.mark.parametrize("case", list(CASES))
def test_k_layers_per_step_and_wait_bound(runs, case):
    cfg = CASES[case][0]
    r = runs[case][0]
    if "budget" in cfg:
        check_budget(r["pushed"], cfg["budget"], cfg.get("max_wait"))
        return
    k = SelectConfig(**cfg).layers_per_step(DEPTH)
    check_pushes(r["pushed"], r["layer_names"], k, cfg.get("max_wait"))
    counts = [len(s) for s in r["pushed"][1:]]
    if case == "forced":  # max_wait=1: the 5 layers not chosen are forced in the next step
        assert counts[0::2] == [1] * len(counts[0::2]), counts
        assert counts[1::2] == [DEPTH - 1] * len(counts[1::2]), counts
    assert r["stats"]["total"]["layers_skipped"] > 0


def check_budget(pushed: list[list[str]], budget: float, bound) -> None:
    """The bytes pushed after step 1 stay within one budget plus the largest layer of
    ``budget`` x steps (the credit rule), every step sends something or saves up for the
    next layer, and no layer waits more than ``bound`` steps."""
    sizes = layer_bytes()
    per_step = budget * sum(sizes.values())
    assert sorted(pushed[0]) == sorted(sizes), pushed[0]  # step 1: everything
    sent = 0
    waited = {n: 0 for n in sizes}
    for t, names in enumerate(pushed[1:], start=1):
        sent += sum(sizes[n] for n in names)
        waited = {n: 0 if n in names else w + 1 for n, w in waited.items()}
        assert bound is None or max(waited.values()) <= bound, (t, waited)
        if bound is None:  # nothing forced: the credit never overdraws
            assert sent <= per_step * t + 1e-6, (t, sent, per_step * t)
        assert sent >= per_step * t - per_step - max(sizes.values()), (t, sent, per_step * t)
    # more layers than k would have sent (at 0.3 of the bytes: 1 to 3 layers per step)
    counts = {len(names) for names in pushed[1:]}
    assert len(counts) > 1, counts


def test_round_robin_takes_turns(runs):
    """k = 2 of 6 layers: each layer goes every third step, in layer order."""
    r = runs["round_robin"][0]
    names = r["layer_names"]
    for t, sent in enumerate(r["pushed"][1:]):
        start = (2 * t) % DEPTH
        assert sent == [names[start], names[start + 1]], (t, sent)


def test_hypernet_scores_are_shared_and_move(runs):
    r = runs["hypernet"]
    for other in r[1:]:
        np.testing.assert_allclose(other["scores"], r[0]["scores"], rtol=0, atol=1e-12)
    assert np.ptp(np.array(r[0]["scores"][-1])) > 0  # layers are ranked apart
    for case in ("seed_hypernet", "budget"):  # the seed's objective and inputs; a budget
        for other in runs[case][1:]:
            np.testing.assert_allclose(other["scores"], runs[case][0]["scores"], rtol=0,
                                       atol=1e-12)


# -- k = all layers is Horovod ------------------------------------------------------------
def parity_body(opt_name: str, steps: int) -> float:
    import copy

    import horovod.torch as horovod_hvd

    import hvdsync.torch as hvd
    hvd.init()
    ref = deep_mlp()
    ours = copy.deepcopy(ref)
    opts = [(ref, horovod_hvd.DistributedOptimizer(make_opt(ref, opt_name),
                                                   named_parameters=ref.named_parameters())),
            (ours, hvd.DistributedOptimizer(make_opt(ours, opt_name),
                                            named_parameters=ours.named_parameters(),
                                            select=dict(k=1.0)))]
    for x, y in teacher_batches(hvd.rank(), steps):
        for model, opt in opts:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert opts[1][1].stats.total.layers_skipped == 0
    return max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters()))


@pytest.fixture(scope="module", params=REAL_NP, ids=REAL_NP_IDS)
def exact_runs(request, torch_job):
    """The exact-result cases, in the shared torch job per rank count: parity with Horovod,
    resuming. The job runs without tensor fusion: on 3 ranks Horovod's ring sums depend on
    where a tensor sits in its fusion buffer, a matter of timing, so two runs of the same
    steps could differ in the last bit."""
    return torch_job(request.module, request.param, "exact")


@pytest.mark.parametrize("opt_name", ["momentum", "adam"])
def test_all_layers_equals_horovod(exact_runs, opt_name):
    for diff in exact_runs[opt_name]:
        assert diff <= 1e-6


# -- save / restore -----------------------------------------------------------------------
def resume_body(selector: str) -> float:
    """Train 10 steps, checkpoint, train 10 more; a fresh model+optimizer restored from the
    checkpoint must train the same 10 steps to the same parameters."""
    import copy

    import hvdsync.torch as hvd
    hvd.init()
    batches = teacher_batches(hvd.rank(), 20)
    cfg = dict(k=2, max_wait=3, selector=selector)

    def run(model, opt, part):
        for x, y in part:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    model = deep_mlp()
    opt = hvd.DistributedOptimizer(make_opt(model, "adam"),
                                   named_parameters=model.named_parameters(), select=cfg)
    run(model, opt, batches[:10])
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    assert saved_opt["hvdsync"]["techniques"]["select"]["residual"], "no residual to save"
    run(model, opt, batches[10:])

    model2 = deep_mlp()
    opt2 = hvd.DistributedOptimizer(make_opt(model2, "adam"),
                                    named_parameters=model2.named_parameters(), select=cfg)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    run(model2, opt2, batches[10:])
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(),
                                                          model2.parameters()))


@pytest.mark.parametrize("selector", ["hypernet", "norm"])
def test_save_restore_resumes_identically(exact_runs, selector):
    for diff in exact_runs[selector]:
        assert diff == 0.0


# -- converges --------------------------------------------------------------------------------
def digits_body(select: dict | None) -> float:
    from examples.torch.train_digits import train
    return train(epochs=8, select=select, verbose=False)["accuracy"]


def test_converges_on_digits_pushing_one_layer_in_three(request, torch_job):
    acc = torch_job(request.module, 2, "digits")["one_in_three"][0]
    assert acc >= 0.9, acc


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared torch job (tests/conftest.py)."""
    cases = job_group("exact", call, {
        "momentum": (parity_body, "momentum", 20), "adam": (parity_body, "adam", 20),
        "hypernet": (resume_body, "hypernet"), "norm": (resume_body, "norm")})
    if np_ == 2:
        cases.update(job_group("logic", select_body, CASES))
        cases.update(job_group("digits", digits_body, {"one_in_three": (dict(k=1, max_wait=4),)}))
    return cases


# -- the selector alone -------------------------------------------------------------------
def test_choose_topk_with_forced_layers():
    sel = SelectPolicy(SelectConfig(k=2, selector="norm", max_wait=2), 5)
    sel.pushed([True] * 5)
    assert sel.choose([0.1, 0.5, 0.3, 0.9, 0.0]) == [False, True, False, True, False]
    sel.pushed(sel.selected)
    sel.choose([0.1, 0.5, 0.3, 0.9, 0.0])
    sel.pushed(sel.selected)
    # layers 0, 2, 4 have waited 2 steps: all forced in although k = 2
    assert sel.choose([0.1, 0.5, 0.3, 0.9, 0.0]) == [True, False, True, False, True]


@pytest.mark.parametrize("objective", ["first_order", "second_order"])
def test_hypernet_descends_its_objective(objective):
    """The hypernet's alpha moves against dL/dalpha."""
    sel = SelectPolicy(SelectConfig(k=1, lr=0.05, objective=objective), 3)
    a0 = sel.hypernet.alpha()
    for _ in range(50):
        sel.scores([1.0, -1.0, 0.0], [1.0, 2.0, 3.0],
                   [0.0] * 3 if objective == "second_order" else None)
    a1 = sel.hypernet.alpha()
    assert a1[0] < a0[0] and a1[1] > a0[1]


def test_second_order_objective_settles_at_its_minimum():
    """With curvature h the quadratic model's minimum is alpha = 1 - dots / h: a layer whose
    loss falls when it is scaled down (dots > 0) settles below 1, at that point."""
    sel = SelectPolicy(SelectConfig(k=1, lr=0.05, inputs="embedding"), 2)
    for _ in range(3000):
        sel.scores([0.5, -0.5], [0.0, 0.0], [2.0, 2.0])
    np.testing.assert_allclose(sel.hypernet.alpha(), [0.75, 1.0], atol=0.02)


def test_budget_choice_saves_up_for_the_best_layer():
    """Layers of 100, 10, 10 bytes, budget 40 bytes a step: the 100-byte layer ranked first
    is not starved by the small ones -- nothing goes until it fits, then it does."""
    sel = SelectPolicy(SelectConfig(budget=40, selector="norm", max_wait=None), 3)
    sizes = [100, 10, 10]
    picks = []
    for _ in range(6):
        sel.pushed(sel.selected)
        picks.append(sel.choose([3.0, 2.0, 1.0], None, sizes))
    # 120 bytes of credit at step 3: the first-ranked layer, then the small ones in the rest
    assert picks[:3] == [[False] * 3, [False] * 3, [True] * 3], picks
    assert sel.credit == 0.0
    sel2 = SelectPolicy(SelectConfig(budget=40, selector="norm", max_wait=None), 3)
    sel2.pushed(sel2.selected)
    assert sel2.choose([1.0, 3.0, 2.0], None, sizes) == [False, True, True]  # 20 of 40 used
    frac = SelectPolicy(SelectConfig(budget=0.25, selector="norm", max_wait=1), 3)
    frac.pushed([True] * 3)
    frac.choose([3.0, 2.0, 1.0], None, sizes)  # 30 bytes of credit: layer 0 does not fit
    frac.pushed(frac.selected)
    assert frac.choose([3.0, 2.0, 1.0], None, sizes) == [True, True, True]  # all forced
    assert frac.credit == 60.0 - 120.0  # overdrawn by the forced layers: repaid later


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(select=0), ValueError, "k must be >= 1"),
    (dict(select=1.5), ValueError, r"fraction must be in \(0, 1\]"),
    (dict(select=dict(k=2, selector="best")), ValueError, "selector must be one of"),
    (dict(select=dict(k=2, max_wait=-1)), ValueError, "max_wait"),
    (dict(select=dict(k=2, ema=1.0)), ValueError, "ema must be in"),
    (dict(select=dict(k=2, lr=0)), ValueError, "lr must be"),
    (dict(select=dict(k=2, budget=0.5)), ValueError, "not both"),
    (dict(select=dict(budget=0)), ValueError, "budget must be >= 1 bytes"),
    (dict(select=dict(budget=2.0)), ValueError, r"budget as a fraction must be in \(0, 1\]"),
    (dict(select=dict(k=2, objective="exact")), ValueError, "objective must be one of"),
    (dict(select=dict(k=2, inputs="loss")), ValueError, "inputs must be one of"),
    (dict(select="top2"), TypeError, "select must be a SelectConfig"),
    (dict(select=2, threshold=1.0), ValueError, "pass one of them"),
])
def test_bad_config_fails_at_construction(kwargs, exc, pattern):
    assert_construction_fails(exc, pattern, **kwargs)
