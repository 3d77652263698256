"""The five techniques in Keras, through ``model.fit`` (compiled) on 2 and 3 real ranks with
different data per rank: each one's core property, as in its torch tests, and convergence."""

from __future__ import annotations

import numpy as np
import pytest

from tests.keras_models import KERAS_NP, KERAS_NP_IDS, fit_body
from tests.models import check_pushes

F64 = dict(dtype="float64")

CASES = {
    # clip= per-layer clipping before the send (local) / of the average (global)
    "clip_norm": (dict(clip=dict(max_norm=0.05)), "sgd", 0.1, 10, 16,
                  dict(reference=True, record_weights=False, **F64)),
    "clip_value": (dict(clip=dict(value=(-0.01, 0.01))), "momentum", 0.1, 10, 16,
                   dict(reference=True, record_weights=False, **F64)),
    "clip_global": (dict(clip=dict(max_norm=0.05, mode="global")), "sgd", 0.1, 10, 16,
                    dict(reference=True, record_weights=False, **F64)),
    "clip_ema": (dict(clip=dict(ema=(0.9, 0.8), warmup=2)), "adam", 0.01, 12, 16,
                 dict(record_weights=False)),
    "clip_nonfinite": (dict(clip=dict(max_norm=10.0)), "sgd", 0.1, 6, 16,
                       dict(record_weights=False, nan_rank=1)),
    # threshold= accumulation thresholds
    "threshold": (dict(threshold=dict(threshold=0.6, max_skip=3)), "momentum", 0.05, 20, 16,
                  dict(F64)),
    "threshold_adam": (dict(threshold=dict(threshold=0.6, max_skip=3)), "adam", 0.01, 20, 16,
                       F64),
    "threshold_zero": (dict(threshold=0.0), "momentum", 0.05, 10, 16,
                       dict(reference=True, record_weights=False, **F64)),
    # select= hypernet-selected layer pushes
    "select_hypernet": (dict(select=dict(k=1, max_wait=2)), "momentum", 0.05, 16, 16, F64),
    "select_norm": (dict(select=dict(k=2, selector="norm", max_wait=3)), "adam", 0.01, 12, 16,
                    F64),
    "select_budget": (dict(select=dict(budget=0.4, max_wait=None)), "adam", 0.01, 12, 16, F64),
    # sparse= sparse grouped allgather (embedding gradients)
    "sparse_gather": (dict(sparse=True), "sgd", 0.5, 10, 8,
                      dict(model="emb", vocab=500, reference=True, record_weights=False)),
    "sparse_equal": (dict(sparse=True), "sgd", 0.5, 6, 8,
                     dict(model="emb", vocab=500, reference=True, record_weights=False,
                          data_rank=0)),
    "sparse_gather_counts_first": (dict(sparse=dict(one_round=False)), "sgd", 0.5, 10, 8,
                                   dict(model="emb", vocab=500, reference=True,
                                        record_weights=False)),
    "sparse_dense_switch": (dict(sparse=True), "sgd", 0.5, 10, 16,
                            dict(model="emb", vocab=40, reference=True, record_weights=False)),
    "sparse_always_gather": (dict(sparse=dict(dense_ratio=float("inf"))), "sgd", 0.5, 6, 16,
                             dict(model="emb", vocab=40, reference=True,
                                  record_weights=False)),
    # delay= local step + stale global gradient, K-step averaging (compiled: folded when due;
    # "delay": folded as it arrives, the pipeline path, a slow rank the other waits for)
    "delay_sync": (dict(delay=dict(staleness=0)), "momentum", 0.05, 10, 16,
                   dict(reference=True, record_weights=False, **F64)),
    "delay": (dict(delay=dict(staleness=2, average_every=4, fold="arrived")), "momentum", 0.05,
              12, 16, dict(slow_rank=1, **F64)),
    "delay_avg_state": (dict(delay=dict(staleness=1, average_every=3, optimizer_state="average")),
                        "momentum", 0.05, 9, 16, F64),
    "delay_flush": (dict(delay=dict(staleness=2, average_every=4)), "sgd", 0.05, 10, 16,
                    dict(callbacks=("broadcast", "flush"), **F64)),
    # threshold='s provisional local steps, synchronized by FlushCallback at the end of fit
    # (a threshold never reached: every layer syncs at steps 5 and 10 only, skips at 11)
    "threshold_flush": (dict(threshold=dict(threshold=50.0, max_skip=4)), "momentum", 0.05, 11,
                        16, dict(callbacks=("broadcast", "flush"), **F64)),
    "threshold_flush_adam_passes": (dict(threshold=dict(threshold=50.0, max_skip=4),
                                         backward_passes_per_step=2), "adam", 0.01, 22, 16,
                                    dict(callbacks=("broadcast", "flush"), **F64)),
}


def fit_case(options, opt_name, lr, steps, batch, kwargs):
    return fit_body(options, opt_name, lr, steps, batch, **kwargs)


def shared_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared rank job (tests/conftest.py)."""
    cases = {name: (fit_case, *case) for name, case in CASES.items()} if np_ in KERAS_NP else {}
    if np_ == 2:
        cases["convergence"] = (convergence_rank,)
    return cases


@pytest.fixture(scope="module", params=KERAS_NP, ids=KERAS_NP_IDS)
def runs(request, shared_job):
    return shared_job(request.module, request.param)


def _same_everywhere(ranks, key):
    for other in ranks[1:]:
        assert other[key] == ranks[0][key], key


def _weights_equal(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in a)


# -- clip= ----------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["clip_norm", "clip_value", "clip_global"])
def test_clip_equals_clipped_averaged_training(runs, case):
    for r in runs[case]:
        assert r["max_diff"] <= 1e-5, f"{case}: max |w - reference| = {r['max_diff']:.2e}"
    assert runs[case][0]["stats"]["total"]["clipped"] > 0


def test_adaptive_clip_clips_and_keeps_replicas_identical(runs):
    ranks = runs["clip_ema"]
    assert all(r["stats"]["total"]["clipped"] > 0 for r in ranks)
    for other in ranks[1:]:
        assert _weights_equal(ranks[0]["final"], other["final"])


def test_nonfinite_gradient_skips_the_step_everywhere(runs):
    ranks = runs["clip_nonfinite"]
    for r in ranks:
        assert all(np.isfinite(w).all() for w in r["final"].values())
        assert r["stats"]["total"]["nonfinite_steps"] == 1  # skipped on every rank
        assert r["iterations"] == 6 - 1  # the NaN step does not count as an update
    for other in ranks[1:]:
        assert _weights_equal(ranks[0]["final"], other["final"])


# -- threshold= ----------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["threshold", "threshold_adam"])
def test_threshold_decisions_shared_and_synced_layers_identical(runs, case):
    ranks = runs[case]
    _same_everywhere(ranks, "sent")
    sent = ranks[0]["sent"]
    flat = [n for step in sent for n in step]
    assert 0 < len(flat) < len(sent) * 3, "expected a mix of sent and skipped layers"
    # no layer skips more than max_skip=3 steps in a row
    for layer in ranks[0]["layers"]:
        run = 0
        for step in sent:
            run = 0 if any(n.endswith(layer) for n in step) else run + 1
            assert run <= 3, layer
    # after a step that synced a layer its weights are the same on every rank
    for t, step in enumerate(sent):
        for name in step:
            layer = name.split("/")[-1]
            for k in ranks[0]["weights"][t]:
                if k.startswith(layer + "/"):
                    for other in ranks[1:]:
                        np.testing.assert_array_equal(ranks[0]["weights"][t][k],
                                                      other["weights"][t][k])
    t = ranks[0]["stats"]["total"]
    assert t["bytes_sent"] < t["bytes_dense"]
    assert t["layers_skipped"] > 0
    # a step that sends no layer sends the control vector alone: one value per layer and the
    # non-finite flag, in the gradients' precision (float64 here; float32: test_keras_flush)
    quiet = [s["bytes_sent"] for s, step in zip(ranks[0]["steps"], sent) if not step]
    assert quiet and set(quiet) == {8 * (len(ranks[0]["layers"]) + 1)}, quiet


def test_threshold_zero_is_plain_training(runs):
    for r in runs["threshold_zero"]:
        assert r["max_diff"] <= 1e-5


# -- select= ----------------------------------------------------------------------------
@pytest.mark.parametrize("case,k,bound", [("select_hypernet", 1, 2), ("select_norm", 2, 3),
                                          ("select_budget", None, None)])
def test_select_pushes_k_layers_chosen_alike_and_leaves_others_untouched(runs, case, k, bound):
    ranks = runs[case]
    _same_everywhere(ranks, "sent")
    sent = ranks[0]["sent"]
    if k is not None:
        check_pushes(sent, list(ranks[0]["stats"]["layers"]), k, bound)
    else:  # 0.4 of the bytes per step after step 1 (all layers), within the credit's slack
        total = ranks[0]["stats"]["total"]  # its bytes_sent includes the control round's
        dense = total["bytes_dense"] / total["step"]
        after_first = sum(v["bytes_sent"] for v in ranks[0]["stats"]["layers"].values()) - dense
        granted = 0.4 * dense * (total["step"] - 1)
        assert granted - 1.4 * dense <= after_first <= granted, (after_first, granted)
        assert len({len(step) for step in sent[1:]}) > 1  # bytes decide, not a layer count
    for r in ranks:
        w = r["weights"]
        for t in range(1, len(w)):
            pushed = {n.split("/")[-1] for n in sent[t]}
            for key in w[t]:
                moved = not np.array_equal(w[t][key], w[t - 1][key])
                assert moved == (key.split("/")[0] in pushed), (t, key)
    for t in range(len(sent)):  # every update is global: replicas identical at every step
        for other in ranks[1:]:
            assert _weights_equal(ranks[0]["weights"][t], other["weights"][t])
    total = ranks[0]["stats"]["total"]
    assert total["bytes_sent"] < total["bytes_dense"]
    assert ranks[0]["selection"]["next"]


# -- sparse= ----------------------------------------------------------------------------
@pytest.mark.parametrize("case,route", [("sparse_gather", "gather"), ("sparse_equal", "gather"),
                                        ("sparse_dense_switch", "dense"),
                                        ("sparse_always_gather", "gather")])
def test_sparse_rows_summed_and_routes_shared(runs, case, route):
    ranks = runs[case]
    for r in ranks:
        assert r["max_diff"] <= 1e-5, f"{case}: max |w - reference| = {r['max_diff']:.2e}"
    _same_everywhere(ranks, "routes")
    routes = ranks[0]["routes"]
    assert [v[0] for v in routes.values()] == [route]
    (_, counts, rows), = routes.values()
    assert len(counts) == len(ranks) and max(counts) <= rows <= sum(counts)
    if case == "sparse_equal":  # identical rows on every rank: summed into one copy each
        assert rows == counts[0]
    counters = ranks[0]["stats"]["total"]
    assert counters[f"sparse_{route}"] == ranks[0]["stats"]["total"]["step"]
    assert counters["sparse_duplicate_rows"] > 0  # duplicates summed locally first
    equal = counters.get("sparse_gather_equal", 0)
    if case == "sparse_equal":  # the same data on every rank: equal counts every step
        assert equal == counters["step"]
    elif route == "gather":
        assert equal < counters["step"]
    if case == "sparse_gather":
        assert counters["bytes_sent"] < counters["bytes_dense"]
    for other in ranks[1:]:
        assert _weights_equal(ranks[0]["final"], other["final"])


def test_sparse_one_round_saves_a_collective_per_step(runs):
    """The codes travel with the rows (one round) from step 2 on, as in torch; counts first
    costs an allgather more per step; the two give the same result (same routes)."""
    for one, first in zip(runs["sparse_gather"], runs["sparse_gather_counts_first"]):
        assert one["routes"] == first["routes"]
        for name, w in one["final"].items():
            np.testing.assert_array_equal(w, first["final"][name])
        per_step = [(a["collectives"], b["collectives"])
                    for a, b in zip(one["steps"], first["steps"])]
        assert per_step[0][0] == per_step[0][1]  # step 1: no history, the codes go first
        assert all(a == b - 1 for a, b in per_step[1:]), per_step


# -- delay= ----------------------------------------------------------------------------
def test_delay_staleness_zero_is_plain_training(runs):
    for r in runs["delay_sync"]:
        assert r["max_diff"] <= 1e-5


def test_delay_folds_each_global_gradient_once_within_the_bound(runs):
    ranks = runs["delay"]
    for r in ranks:
        c = r["stats"]["total"]
        lags = {int(k.split("_")[1]): v for k, v in c.items() if k.startswith("staleness_")}
        assert max(lags) <= 2
        outstanding_now = len(r["delay"]["outstanding"])
        assert sum(lags.values()) + outstanding_now == 12  # each step's gradient, once
        assert c["averaged"] == 3
    # the fast rank waits for the slow one at the bound
    assert ranks[0]["stats"]["total"].get("waited", 0) > 0
    for t in range(len(ranks[0]["weights"])):
        same = all(_weights_equal(ranks[0]["weights"][t], o["weights"][t]) for o in ranks[1:])
        if (t + 1) % 4 == 0:
            assert same, f"replicas differ right after averaging step {t + 1}"


def test_delay_optimizer_state_average(runs):
    ranks = runs["delay_avg_state"]  # 9 steps, K=3: the last step averaged
    for other in ranks[1:]:
        assert _weights_equal(ranks[0]["final"], other["final"])
        for k, v in ranks[0]["opt_vars"].items():
            np.testing.assert_array_equal(v, other["opt_vars"][k], err_msg=k)


def test_flush_callback_makes_replicas_identical(runs):
    ranks = runs["delay_flush"]  # 10 steps, K=4: the last steps' corrections outstanding
    assert any(not _weights_equal(ranks[0]["weights"][-1], o["weights"][-1]) for o in ranks[1:])
    for other in ranks[1:]:
        assert _weights_equal(ranks[0]["final"], other["final"])
    assert all(r["delay"]["outstanding"] == [] for r in ranks)


@pytest.mark.parametrize("case", ["threshold_flush", "threshold_flush_adam_passes"])
def test_flush_callback_synchronizes_threshold_layers(runs, case):
    """Layers that were skipping at the end of fit (provisional local steps, so the replicas
    differ) are synchronized as a due sync would: identical replicas, nothing pending."""
    ranks = runs[case]
    assert any(not _weights_equal(ranks[0]["weights"][-1], o["weights"][-1]) for o in ranks[1:])
    for r in ranks:
        assert all(np.isfinite(w).all() for w in r["final"].values())
    for other in ranks[1:]:
        assert _weights_equal(ranks[0]["final"], other["final"])
        for k, v in ranks[0]["opt_vars"].items():
            np.testing.assert_array_equal(v, other["opt_vars"][k], err_msg=k)


# -- convergence ----------------------------------------------------------------------------
CONVERGENCE = {
    "plain": {},
    "clip": dict(clip=dict(max_norm=1.0)),
    "threshold": dict(threshold=dict(threshold=0.3, max_skip=4)),
    "select": dict(select=dict(k=1)),
    "delay": dict(delay=dict(staleness=2, average_every=8)),
}


def convergence_rank() -> dict:
    out = {}
    for name, opts in CONVERGENCE.items():
        r = fit_body(opts, "adam", 0.01, 40, 32, epochs=3, record_weights=False,
                     callbacks=("broadcast", "flush"), evaluate=True)
        out[name] = r["test_accuracy"]
    r = fit_body(dict(sparse=True), "adam", 0.02, 40, 32, epochs=3, model="emb", vocab=500,
                 record_weights=False, evaluate=True)
    out["sparse_embedding"] = r["test_accuracy"]
    return out


def test_every_technique_still_learns(request, shared_job):
    ranks = shared_job(request.module, 2)["convergence"]
    acc = ranks[0]
    assert acc["plain"] >= 0.85, acc
    for name in CONVERGENCE:
        assert acc[name] >= acc["plain"] - 0.05, (name, acc)
    assert acc["sparse_embedding"] >= 0.85, acc
