"""Techniques composed through the one lifecycle (Keras ``fit``), on 2 and 3 real ranks with
different data per rank: ``sparse=`` with a decider (the embedding takes the sparse exchange
every step, the dense layers the decider), ``delay=`` with ``clip=`` and fp16, global-mode
clipping and ``backward_passes_per_step`` with a pipeline technique -- the same combinations
the torch adapter takes."""

from __future__ import annotations

import numpy as np
import pytest

from tests.keras_models import KERAS_NP, KERAS_NP_IDS, fit_body

F64 = dict(dtype="float64")
EMB = dict(model="emb_mlp", vocab=500)
REF = dict(reference=True, record_weights=False)

CASES = {
    "sparse_threshold": (dict(sparse=True, threshold=dict(threshold=0.3, max_skip=3)), "sgd",
                         0.5, 12, 16, EMB),
    "sparse_threshold_zero": (dict(sparse=True, threshold=0.0), "sgd", 0.5, 8, 16,
                              dict(EMB, **REF)),
    "sparse_select": (dict(sparse=True, select=dict(k=1, selector="norm", max_wait=2)), "sgd",
                      0.5, 12, 16, EMB),
    "sparse_select_all": (dict(sparse=True, select=dict(k=1.0)), "sgd", 0.5, 8, 16,
                          dict(EMB, **REF)),
    "clip_fp16": (dict(clip=dict(max_norm=0.05), fp16=True), "momentum", 0.05, 12, 16,
                  dict(record_weights=False)),
    "delay_clip_fp16": (dict(delay=dict(staleness=2, average_every=4), clip=dict(max_norm=0.05),
                             fp16=True), "momentum", 0.05, 12, 16, {}),
    "delay_sync_clip_fp16": (dict(delay=dict(staleness=0), clip=dict(max_norm=0.05),
                                  fp16=True), "momentum", 0.05, 12, 16,
                             dict(record_weights=False)),
    "clip_global_threshold_zero": (dict(clip=dict(max_norm=0.05, mode="global"),
                                        threshold=0.0), "sgd", 0.1, 8, 16, dict(F64, **REF)),
    "threshold_zero_passes": (dict(threshold=0.0, backward_passes_per_step=2), "sgd", 0.05, 8,
                              16, dict(F64, **REF)),
    # rank >= min(n, m) for every kernel: the factors span everything (the plain average)
    "lowrank_full": (dict(lowrank=dict(rank=16, warmup_steps=0, min_compression=0)), "sgd",
                     0.1, 8, 16, dict(F64, **REF)),
    "lowrank_clip_fp16": (dict(lowrank=dict(rank=2, warmup_steps=2), clip=dict(max_norm=0.05),
                               fp16=True), "momentum", 0.05, 12, 16, {}),
    "lowrank_threshold": (dict(lowrank=dict(rank=2, warmup_steps=2),
                               threshold=dict(threshold=0.3, max_skip=3)), "sgd", 0.5, 12, 16,
                          {}),
    # lowrank= inside delay=: synchronous equals lowrank= alone; stale, replicas meet at K
    "lowrank_alone": (dict(lowrank=dict(rank=2, warmup_steps=2)), "momentum", 0.05, 12, 16,
                      dict(F64, record_weights=False)),
    # both compressed layers in one bucket: one P and one Q round per step
    "lowrank_bucketed": (dict(lowrank=dict(rank=2, warmup_steps=2, bucket_bytes=1 << 20)),
                         "momentum", 0.05, 12, 16, dict(F64, record_weights=False)),
    "delay_sync_lowrank": (dict(lowrank=dict(rank=2, warmup_steps=2), delay=dict(staleness=0)),
                           "momentum", 0.05, 12, 16, dict(F64, record_weights=False)),
    "delay_lowrank_fp16": (dict(lowrank=dict(rank=2, warmup_steps=2), fp16=True,
                                delay=dict(staleness=2, average_every=4)), "momentum", 0.05,
                           12, 16, {}),
}


def case_rank(options: dict, opt_name: str, lr: float, steps: int, batch: int,
              kwargs: dict) -> dict:
    import horovod.tensorflow as htf
    options = dict(options)
    if options.pop("fp16", False):
        options["compression"] = htf.Compression.fp16
    return fit_body(options, opt_name, lr, steps, batch, **kwargs)


def shared_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared rank job (tests/conftest.py)."""
    return ({name: (case_rank, *case) for name, case in CASES.items()}
            if np_ in KERAS_NP else {})


@pytest.fixture(scope="module", params=KERAS_NP, ids=KERAS_NP_IDS)
def runs(request, shared_job):
    return request.param, shared_job(request.module, request.param)


def _weights_equal(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in a)


def _layer(name: str) -> str:
    return name.split("/")[-1]


def test_sparse_with_threshold(runs):
    _, r = runs
    ranks = r["sparse_threshold"]
    for other in ranks[1:]:
        assert other["sent"] == ranks[0]["sent"], "ranks decided differently"
    sent = [[_layer(n) for n in s] for s in ranks[0]["sent"]]
    assert all("emb" in s for s in sent), "the embedding must go every step"
    dense = [n for s in sent for n in s if n != "emb"]
    assert 0 < len(dense) < 2 * len(sent), "expected dense layers both sent and skipped"
    for t, s in enumerate(sent):
        for layer in s:  # a layer that synced is identical on every rank
            for k, v in ranks[0]["weights"][t].items():
                if k.startswith(layer + "/"):
                    for other in ranks[1:]:
                        np.testing.assert_array_equal(v, other["weights"][t][k])
    assert list(ranks[0]["routes"].values())[0][0] in ("gather", "dense")


def test_sparse_with_select(runs):
    _, r = runs
    ranks = r["sparse_select"]
    for other in ranks[1:]:
        assert other["sent"] == ranks[0]["sent"]
    sent = [[_layer(n) for n in s] for s in ranks[0]["sent"]]
    assert all("emb" in s for s in sent)
    assert sorted(sent[0]) == ["emb", "fc", "head"]  # step 1 pushes everything
    for s in sent[1:]:
        assert 1 <= len([n for n in s if n != "emb"]) <= 2
    for t in range(len(sent)):  # every update is global: replicas identical at every step
        for other in ranks[1:]:
            assert _weights_equal(ranks[0]["weights"][t], other["weights"][t]), t


@pytest.mark.parametrize("case", ["sparse_threshold_zero", "sparse_select_all",
                                  "clip_global_threshold_zero", "threshold_zero_passes",
                                  "lowrank_full"])
def test_sends_everything_equals_averaged_training(runs, case):
    """Each composition with nothing skipped equals plain averaged-gradient training (global
    clipping and gradient accumulation included) computed in one process."""
    _, r = runs
    for rank in r[case]:
        assert rank["max_diff"] <= 1e-5, f"{case}: max |w - reference| = {rank['max_diff']:.2e}"
        assert rank["stats"]["total"]["layers_skipped"] == 0


def test_delay_with_clip_and_fp16(runs):
    np_, r = runs
    ranks = r["delay_clip_fp16"]
    for rank in ranks:
        c = rank["stats"]["total"]
        lags = {int(k.split("_")[1]): v for k, v in c.items() if k.startswith("staleness_")}
        assert max(lags) <= 2
        assert sum(lags.values()) + len(rank["delay"]["outstanding"]) == 12
        assert c["averaged"] == 3 and c["clipped"] > 0
        per_step = c["bytes_dense"] // 12  # gradients in fp16, the averaging in float32
        assert c["bytes_sent"] == c["bytes_dense"] // 2 + 3 * per_step
    for t in (3, 7, 11):  # right after each averaging step
        for other in ranks[1:]:
            assert _weights_equal(ranks[0]["weights"][t], other["weights"][t]), t
    tol = 1e-6 if np_ == 2 else 1e-3
    for a, b in zip(r["clip_fp16"], r["delay_sync_clip_fp16"]):  # staleness 0: synchronous
        for k, v in a["final"].items():
            np.testing.assert_allclose(b["final"][k], v, rtol=0, atol=tol, err_msg=k)


def test_lowrank_with_clip_and_fp16(runs):
    """Low-rank factors in fp16 after per-layer clipping: after warm-up the compressible
    kernels (fc1 12x16, fc2 16x16 at rank 2) send their factors, everything else goes whole;
    every update is global, so the replicas are identical after every step."""
    _, r = runs
    ranks = r["lowrank_clip_fp16"]
    for t in range(12):
        for other in ranks[1:]:
            assert _weights_equal(ranks[0]["weights"][t], other["weights"][t]), t
    c = ranks[0]["stats"]["total"]
    assert c["clipped"] > 0
    dense = c["bytes_dense"] // 12  # float32 bytes of one step
    factors = 2 * ((12 + 16) + (16 + 16)) * 4  # P and Q of fc1 and fc2, float32
    per_step = dense - (12 * 16 + 16 * 16) * 4 + factors
    assert c["bytes_sent"] == (2 * dense + 10 * per_step) // 2  # fp16 on the wire


def test_lowrank_with_threshold(runs):
    _, r = runs
    ranks = r["lowrank_threshold"]
    for other in ranks[1:]:
        assert other["sent"] == ranks[0]["sent"], "ranks decided differently"
    c = ranks[0]["stats"]["total"]
    assert c["layers_skipped"] > 0 and c["layers_sent"] > 0
    for t, s in enumerate(ranks[0]["sent"]):
        for layer in [_layer(n) for n in s]:  # a layer that synced is identical everywhere
            for k, v in ranks[0]["weights"][t].items():
                if k.startswith(layer + "/"):
                    for other in ranks[1:]:
                        np.testing.assert_array_equal(v, other["weights"][t][k])
    final = [h["loss"][-1] for h in (rank["history"] for rank in ranks)]
    assert all(np.isfinite(final))


def test_lowrank_buckets_change_the_rounds_not_the_result(runs):
    """fc1 and fc2 (compressed, each with its bias riding in its P round) in one bucket: the
    same training and bytes as a round pair per layer, in fewer collectives (the compiled
    step builds a bucket's P and its Q round as one grouped allreduce each)."""
    _, r = runs
    for a, b in zip(r["lowrank_alone"], r["lowrank_bucketed"]):
        for k, v in a["final"].items():
            np.testing.assert_allclose(b["final"][k], v, rtol=0, atol=1e-9, err_msg=k)
        ta, tb = a["stats"]["total"], b["stats"]["total"]
        assert ta["bytes_sent"] == tb["bytes_sent"]
        assert tb["collectives"] < ta["collectives"]


def test_lowrank_inside_delay(runs):
    """Synchronous (staleness 0): the same training as lowrank= alone. Stale, fp16 factors:
    the Q rounds run in the background behind each step's P rounds, every global gradient is
    folded once within the bound, and the replicas are identical after each averaging."""
    _, r = runs
    for a, b in zip(r["lowrank_alone"], r["delay_sync_lowrank"]):
        for k, v in a["final"].items():
            np.testing.assert_allclose(b["final"][k], v, rtol=0, atol=1e-9, err_msg=k)
    ranks = r["delay_lowrank_fp16"]
    for rank in ranks:
        c = rank["stats"]["total"]
        lags = {int(k.split("_")[1]): v for k, v in c.items() if k.startswith("staleness_")}
        assert max(lags) <= 2 and c["averaged"] == 3
        assert sum(lags.values()) + len(rank["delay"]["outstanding"]) == 12
        dense = c["bytes_dense"] // 12  # float32 bytes of one step
        factors = 2 * ((12 + 16) + (16 + 16)) * 4  # P and Q of fc1 and fc2, float32
        compressed = dense - (12 * 16 + 16 * 16) * 4 + factors
        # fp16 on the wire (2 warm-up steps whole), plus 3 float32 parameter averagings
        assert c["bytes_sent"] == (2 * dense + 10 * compressed) // 2 + 3 * dense
    for t in (3, 7, 11):  # right after each averaging step
        for other in ranks[1:]:
            assert _weights_equal(ranks[0]["weights"][t], other["weights"][t]), t
