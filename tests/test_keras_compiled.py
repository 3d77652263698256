"""threshold=, select=, lowrank=, sparse= and delay= compiled into Keras' train function
(hvdsync.keras.graph, with hvdsync.core.kept_layers for deciders) against the same techniques run eagerly through
the step pipeline (``HVDSYNC_KERAS_PIPELINE=1``) and the compiled step run eagerly
(``run_eagerly=True``): the same layers sent at every step and the same weights, on 2 and 3
real ranks with different data per rank (float64)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest

from tests.keras_models import KERAS_NP, KERAS_NP_IDS

MODES = ("compiled", "run_eagerly", "pipeline")
#: the cases that also run the compiled step eagerly (``run_eagerly=True``): one per traced
#: form (a decider of each kind of kept layer, local steps, lowrank=) -- the same Python builds
#: every case's step, so more cases would repeat it at ~1 s of the shared job a fit
RUN_EAGERLY = ("threshold", "select_hypernet", "diloco", "lowrank_bucketed_clip_global",
               "sparse_switch_counts_first_clip", "delay_stale2_clip_nan",
               "delay_stale2_lowrank_nan")

CASES = {
    "threshold": (dict(threshold=dict(threshold=0.6, max_skip=3)), "momentum", 0.05),
    "threshold_relative": (dict(threshold=dict(threshold=0.05, relative=True, max_skip=4)),
                           "adam", 0.01),
    "threshold_global_clip": (dict(threshold=dict(threshold=0.5, scope="global", max_skip=2),
                                   clip=dict(max_norm=0.3)), "sgd", 0.1),
    "select_hypernet": (dict(select=dict(k=1, max_wait=2)), "momentum", 0.05),
    "select_budget": (dict(select=dict(budget=0.4, selector="norm")), "adam", 0.01),
    "select_clip_global": (dict(select=dict(k=2, selector="random"),
                                clip=dict(max_norm=0.2, mode="global")), "sgd", 0.1),
}
#: delay= local steps (nothing sent in a step: the outer synchronization between steps),
#: compiled as a step that checks its gradients and runs the technique's moments on the host
LOCAL_CASES = {
    "diloco": (dict(delay=dict(exchange_gradients=False, average_every=4, outer_lr=0.7,
                               outer_momentum=0.9)), "adam", 0.01),
    "streaming_int8": (dict(delay=dict(exchange_gradients=False, average_every=4, fragments=2,
                                       overlap=1, mix=0.5, compress="int8", outer_lr=0.7,
                                       outer_momentum=0.9)), "momentum", 0.05),
    "local_sgd_clip": (dict(delay=dict(exchange_gradients=False, average_every=3),
                            clip=dict(max_norm=0.3)), "sgd", 0.1),
    # the step inside Keras' accumulation branch: a host call in a tf.cond
    "diloco_two_passes": (dict(delay=dict(exchange_gradients=False, average_every=2,
                                          outer_lr=0.7, outer_momentum=0.9),
                               backward_passes_per_step=2), "momentum", 0.05),
}
#: delay= exchanging every step's gradient, compiled (``fold="due"``, Keras' default): the
#: last step's gradient exchanged beside this step's backward, each correction folded in
#: exactly ``staleness`` steps after its step, drains and parameter averaging every K steps
EXCHANGE_CASES = {
    # a NaN on rank 1 at step 5: zeros in its place on that rank, the step not skipped
    # (staleness 1, without a correction waiting in a variable: test_adapters_agree)
    "delay_stale2_clip_nan": (dict(delay=dict(staleness=2, average_every=5),
                                   clip=dict(max_norm=0.3)), "adam", 0.01, "mlp", 40, 5),
    # lowrank= inside: each exchange compressed (after warm-up) from the Q of the newest one
    # every rank had, its residual joining E when folded in; warm-up ends mid-run, drains
    # fold two exchanges of one step; a NaN on rank 1 at step 7 (compressing)
    "delay_stale2_lowrank_nan": (dict(delay=dict(staleness=2, average_every=5),
                                      lowrank=dict(rank=2, warmup_steps=3, min_compression=0)),
                                 "momentum", 0.05, "mlp", 40, 7),
    "delay_stale1_lowrank_clip": (dict(delay=dict(staleness=1, average_every=4),
                                       lowrank=dict(rank=1, warmup_steps=2, min_compression=0),
                                       clip=dict(max_norm=0.3)), "adam", 0.01),
}
#: lowrank= compiled: its P and Q rounds built into the step (a bucket's layers share them),
#: Q and the error feedback in variables, warm-up a branch on a flag the host writes
LOWRANK_CASES = {
    "lowrank": (dict(lowrank=dict(rank=2, warmup_steps=3, min_compression=0)), "momentum",
                0.05),
    "lowrank_bucketed_clip_global": (
        dict(lowrank=dict(rank=1, warmup_steps=2, min_compression=0, bucket_bytes=1 << 20),
             clip=dict(max_norm=0.2, mode="global")), "sgd", 0.1),
    "lowrank_clip_adam": (dict(lowrank=dict(rank=2, warmup_steps=0), clip=dict(max_norm=0.3)),
                          "adam", 0.01),
    # beside a decider: a layer's rounds in the branch its plan takes, on the gradient plus
    # what the layer held; Q and E written only where it was sent; a NaN on rank 1 at step 7
    "lowrank_threshold_nan": (dict(lowrank=dict(rank=2, warmup_steps=3, min_compression=0),
                                   threshold=dict(threshold=0.6, max_skip=3)), "momentum",
                              0.05, "mlp", 40, 7),
    # buckets beside a decider: the pipeline's bucket takes the members the plan sends, the
    # compiled step gives each layer its own rounds in its branch (the same numbers)
    "lowrank_bucketed_select_clip_global": (
        dict(lowrank=dict(rank=1, warmup_steps=2, min_compression=0, bucket_bytes=1 << 20),
             select=dict(k=2, selector="round_robin"), clip=dict(max_norm=0.2, mode="global")),
        "sgd", 0.1),
}
#: sparse= compiled: the row-sparse embedding's route a branch on a flag the host writes
#: (or, codes first, on the codes gathered in the step), the dense layers per layer as plain
SPARSE_CASES = {
    # the route switches between gather and dense with each step's rows (7 of 12 dense),
    # chosen on the device from the codes gathered first; the local clip merges duplicates
    "sparse_switch_counts_first_clip": (dict(sparse=dict(one_round=False, dense_ratio=0.55),
                                             clip=dict(max_norm=0.3)), "adam", 0.01,
                                        "emb_mlp", 200),
    # one round: each step's route is the one the last step's rows chose (the host's flag);
    # a NaN on rank 1 at step 5 (a sample weight): skipped on every rank, counted alike
    "sparse_switch_one_round_nan": (dict(sparse=dict(dense_ratio=0.55)), "sgd", 0.125,
                                    "emb_mlp", 200, 5),
    # beside a decider: the embedding goes every step (gathered), the dense layers as the
    # plan says
    "sparse_select_clip": (dict(sparse=True, select=dict(k=1, max_wait=2),
                                clip=dict(max_norm=0.5)), "sgd", 0.125, "emb_mlp", 500),
    # beside lowrank=: the embedding by the sparse exchange, the dense matrices by low-rank
    # factors after warm-up (each transport its own layers)
    "sparse_lowrank_clip": (dict(sparse=dict(dense_ratio=0.55),
                                 lowrank=dict(rank=2, warmup_steps=3, min_compression=0),
                                 clip=dict(max_norm=0.3)), "adam", 0.01, "emb_mlp", 200),
}
#: (one route alone, and sparse= beside threshold=, run compiled in test_keras_techniques and
#: test_adapters_agree: against the dense-computed reference and torch, step for step)
SPARSE_COUNTERS = ("sparse_gather", "sparse_dense", "sparse_duplicate_rows",
                   "sparse_gather_equal")
STEPS, BATCH = 12, 16


#: a case's model, vocabulary and NaN step where it does not name them
CASE_DEFAULTS = ("mlp", 40, None)


def compiled_case(options: dict, opt_name: str, lr: float, model_name: str = "mlp",
                  vocab: int = 40, nan_step: Optional[int] = None,
                  modes: tuple = MODES) -> dict:
    """One case in each of ``modes``: per mode, the layers sent per step, the weights after
    every step, whether the graph path ran, the totals (and lowrank='s status). ``model_name``
    ``"emb_mlp"``: an embedding of ``vocab`` rows (row-sparse gradients) and a dense head;
    ``nan_step``: rank 1's loss is NaN at that step (a NaN sample weight)."""
    import os

    import keras
    import hvdsync.keras as hvd
    from tests.keras_models import (Recorder, embedding_model, make_optimizer, mlp,
                                    one_tensorflow_thread, teacher_data, token_data)
    hvd.init()
    one_tensorflow_thread()
    x, y = (teacher_data(hvd.rank(), STEPS * BATCH) if model_name == "mlp"
            else token_data(hvd.rank(), STEPS * BATCH, vocab=vocab))
    out = {}
    for mode in modes:
        os.environ["HVDSYNC_KERAS_PIPELINE"] = "1" if mode == "pipeline" else "0"
        model = (mlp(dtype="float64") if model_name == "mlp"
                 else embedding_model(vocab=vocab, hidden=True, dtype="float64"))
        opt = hvd.DistributedOptimizer(make_optimizer(opt_name, lr), **options)
        model.compile(optimizer=opt, run_eagerly=mode == "run_eagerly",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rec = Recorder.make(True)
        weights = np.ones(len(y))
        if nan_step is not None and hvd.rank() == 1:
            weights[(nan_step - 1) * BATCH] = np.nan
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, sample_weight=weights,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), rec])
        out[mode] = dict(sent=rec.sent, weights=rec.weights, graph=opt._hv.graph_path,
                         total=opt.stats.total.as_dict(),
                         lowrank=opt.techniques["lowrank"].status()
                         if "lowrank" in options else None)
    os.environ.pop("HVDSYNC_KERAS_PIPELINE")
    return out


#: several steps per call of the train function (Keras' ``steps_per_execution``): a decider's
#: plan and the local step's host calls are read and made inside Keras' loop over the steps
EXECUTION_CASES = {"select_hypernet": CASES["select_hypernet"],
                   "threshold": CASES["threshold"], "diloco": LOCAL_CASES["diloco"]}
STEPS_PER_EXECUTION = 3


def execution_case(options: dict, opt_name: str, lr: float) -> dict:
    """The compiled step with ``STEPS_PER_EXECUTION`` steps per call: final weights and
    counters (compared with the same case's eager pipeline, one step per call)."""
    import keras
    import hvdsync.keras as hvd
    from tests.keras_models import key, make_optimizer, mlp, one_tensorflow_thread, teacher_data
    hvd.init()
    one_tensorflow_thread()
    x, y = teacher_data(hvd.rank(), STEPS * BATCH)
    model = mlp(dtype="float64")
    opt = hvd.DistributedOptimizer(make_optimizer(opt_name, lr), **options)
    model.compile(optimizer=opt, steps_per_execution=STEPS_PER_EXECUTION,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return dict(weights={key(v): np.array(v.numpy()) for v in model.trainable_variables},
                graph=opt._hv.graph_path, total=opt.stats.total.as_dict())


def shared_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared rank job (tests/conftest.py)."""
    if np_ not in KERAS_NP:
        return {}
    return {**{name: (compiled_case, *case, *CASE_DEFAULTS[len(case) - 3:],
                      MODES if name in RUN_EAGERLY else ("compiled", "pipeline"))
               for name, case in {**CASES, **LOCAL_CASES, **EXCHANGE_CASES, **LOWRANK_CASES,
                                  **SPARSE_CASES}.items()},
            **{f"{name}_per_execution": (execution_case, *case)
               for name, case in EXECUTION_CASES.items()}}


@pytest.fixture(scope="module", params=KERAS_NP, ids=KERAS_NP_IDS)
def runs(request, shared_job):
    return shared_job(request.module, request.param)


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_deciders_equal_the_step_pipeline(runs, case):
    for r in runs[case]:
        sent = r["pipeline"]["sent"]
        flat = [n for step in sent for n in step]
        assert 0 < len(flat) < len(sent) * 3, "expected a mix of sent and kept layers"
        _equal_to_the_pipeline(r)
    # and every rank took the same decisions
    for other in runs[case][1:]:
        assert other["compiled"]["sent"] == runs[case][0]["compiled"]["sent"]


@pytest.mark.parametrize("case", list(LOCAL_CASES))
def test_compiled_local_steps_equal_the_step_pipeline(runs, case):
    """delay= local steps: nothing is sent in a step, the outer synchronization runs on the
    host between compiled steps -- the same weights and the same outer traffic."""
    for r in runs[case]:
        assert r["pipeline"]["sent"] == [[]] * STEPS
        assert r["pipeline"]["total"]["step"] == STEPS // (2 if "two_passes" in case else 1)
        _equal_to_the_pipeline(r, ("outer_started", "outer_merged", "outer_bytes",
                                   "collectives"))
        assert r["pipeline"]["total"]["outer_merged"] > 0
    first, other = runs[case][0]["compiled"]["weights"][1], runs[case][1]["compiled"]["weights"][1]
    assert any(not np.array_equal(first[k], other[k]) for k in first), \
        "the replicas differ between synchronizations (different data per rank)"


def config_of(case: str) -> dict:
    return EXCHANGE_CASES[case][0]


@pytest.mark.parametrize("case", list(EXCHANGE_CASES))
def test_compiled_delay_exchange_equals_the_step_pipeline(runs, case):
    """delay= exchanging every step, compiled: the same weights after every step, bytes,
    staleness histogram, averaging steps and non-finite count as the step pipeline folding
    when due; the replicas differ between averaging steps and agree after each one."""
    config = config_of(case)["delay"]
    lags = tuple(f"staleness_{k}" for k in range(config["staleness"] + 1))
    for r in runs[case]:
        _equal_to_the_pipeline(r, lags + ("averaged", "nonfinite"))
        total = r["compiled"]["total"]
        assert total[f"staleness_{config['staleness']}"] > 0, total
        assert total["averaged"] == STEPS // config["average_every"], total
    first, other = (runs[case][i]["compiled"]["weights"] for i in (0, 1))
    k = config["average_every"]
    for t in range(STEPS):
        same = all(np.allclose(first[t][name], other[t][name], rtol=0, atol=1e-12)
                   for name in first[t])
        assert same == ((t + 1) % k == 0), f"step {t + 1}: replicas equal: {same}"
    if len(EXCHANGE_CASES[case]) > 5:  # the NaN on rank 1: counted there only
        assert [r["compiled"]["total"].get("nonfinite", 0) > 0 for r in runs[case]] == [
            False, True] + [False] * (len(runs[case]) - 2)
    if "lowrank" in config_of(case):  # compressed after warm-up: fewer bytes, same steps
        for r in runs[case]:
            total = r["compiled"]["total"]
            assert total["bytes_sent"] < 0.7 * total["bytes_dense"], total
            ref = r["pipeline"]["lowrank"]
            for mode in _traced_modes(r):  # (residuals: what exchanges in flight took too)
                assert r[mode]["lowrank"]["step"] == ref["step"] == STEPS
                np.testing.assert_allclose(r[mode]["lowrank"]["residual_norm"],
                                           ref["residual_norm"], rtol=1e-9)
            assert ref["residual_norm"] > 0


@pytest.mark.parametrize("case", list(LOWRANK_CASES))
def test_compiled_lowrank_equals_the_step_pipeline(runs, case):
    """lowrank= compiled: the same weights, layers and bytes as the step pipeline (warm-up
    steps plain, then the factors), the same residuals (their norm) and step count; beside a
    decider, layers kept back (a NaN step skipped everywhere, uncounted by lowrank=)."""
    options, nan = LOWRANK_CASES[case][0], len(LOWRANK_CASES[case]) > 5
    for r in runs[case]:
        _equal_to_the_pipeline(r, ("nonfinite_steps",))
        total, status = r["compiled"]["total"], r["compiled"]["lowrank"]
        assert total["bytes_sent"] < 0.7 * total["bytes_dense"], total  # it compressed
        if options.keys() & {"threshold", "select"}:
            assert total["layers_skipped"] > 0, total
        assert total.get("nonfinite_steps", 0) == nan, total
        for mode in _traced_modes(r):
            got, ref = r[mode]["lowrank"], r["pipeline"]["lowrank"]
            assert got["step"] == ref["step"] == STEPS - nan and got["layers"] == ref["layers"]
            np.testing.assert_allclose(got["residual_norm"], ref["residual_norm"], rtol=1e-9)
        assert status["residual_norm"] > 0


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_compiled_sparse_equals_the_step_pipeline(runs, case):
    """sparse= compiled: the same weights, layers, bytes and routes (counted per step) as the
    step pipeline, duplicates summed locally first; in the switch cases both routes were
    taken, and beside a decider the embedding went every step (gathered: fewer bytes than
    dense) while dense layers were kept back."""
    for r in runs[case]:
        _equal_to_the_pipeline(r, SPARSE_COUNTERS + ("nonfinite_steps",))
        total = r["compiled"]["total"]
        if case.endswith("_nan"):  # skipped on every rank: the weights stood still
            nan_step = SPARSE_CASES[case][5]
            assert total.get("nonfinite_steps") == 1, total
            for k, w in r["compiled"]["weights"][nan_step - 2].items():
                np.testing.assert_array_equal(r["compiled"]["weights"][nan_step - 1][k], w)
        assert total["sparse_duplicate_rows"] > 0, total
        if case.startswith("sparse_switch"):
            assert 0 < total["sparse_gather"] < STEPS and total["sparse_dense"] > 0, total
        elif "lowrank" in case:  # the dense matrices compressed after warm-up (residuals)
            assert 0 < total["sparse_gather"] < STEPS and total["sparse_dense"] > 0, total
            assert r["pipeline"]["lowrank"]["residual_norm"] > 0
            for mode in _traced_modes(r):
                np.testing.assert_allclose(r[mode]["lowrank"]["residual_norm"],
                                           r["pipeline"]["lowrank"]["residual_norm"], rtol=1e-9)
        else:  # beside a decider, which kept some layers back
            assert total["layers_skipped"] > 0 and total["sparse_gather"] == STEPS, total
            assert total["bytes_sent"] < total["bytes_dense"]
            assert all("emb" in step for step in r["compiled"]["sent"])


def _equal_to_the_pipeline(r: dict, counters: tuple = ()) -> None:
    """The compiled step (in a graph and run eagerly) against the step pipeline: the same
    layers sent each step, weights to 1e-9 after every step, the same counters."""
    assert all(r[mode]["graph"] for mode in _traced_modes(r))
    assert not r["pipeline"]["graph"]
    ref = r["pipeline"]
    for mode in _traced_modes(r):
        got = r[mode]
        assert got["sent"] == ref["sent"], mode
        for t, (a, b) in enumerate(zip(got["weights"], ref["weights"])):
            for k in b:
                np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-9,
                                           err_msg=f"{mode} step {t} {k}")
        for k in ("bytes_sent", "bytes_dense", "layers_sent", "layers_skipped") + counters:
            assert got["total"].get(k) == ref["total"].get(k), (mode, k)


@pytest.mark.parametrize("case", list(EXECUTION_CASES))
def test_several_steps_per_execution_equal_one_step_per_call(runs, case):
    """``steps_per_execution=3``: the compiled step reads the plan and makes its host calls
    inside Keras' loop over the steps -- the same weights (1e-9) and counters as the eager
    pipeline stepping once per call."""
    for got, one in zip(runs[f"{case}_per_execution"], runs[case]):
        ref = one["pipeline"]
        assert got["graph"] and not ref["graph"]
        for k, w in ref["weights"][-1].items():
            np.testing.assert_allclose(got["weights"][k], w, rtol=0, atol=1e-9, err_msg=k)
        for k in ("step", "bytes_sent", "layers_sent", "layers_skipped", "outer_merged"):
            assert got["total"].get(k) == ref["total"].get(k), k
        assert ref["total"]["step"] == STEPS


def _traced_modes(r: dict) -> list[str]:
    """The modes of a case that ran the compiled step (:data:`RUN_EAGERLY`: also eagerly)."""
    return [mode for mode in ("compiled", "run_eagerly") if mode in r]


def test_one_case_per_traced_form_runs_eagerly(runs):
    """The run_eagerly cases exist and ran that mode (a rename would silently drop them)."""
    for case in RUN_EAGERLY:
        assert all("run_eagerly" in r for r in runs[case]), case
