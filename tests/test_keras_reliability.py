"""Reliability of hvdsync.keras in the setups people run (issue: mixed precision, checkpoints,
bad values, disagreeing ranks, dead ranks), through ``model.fit`` on real ranks with
different data per rank."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest

from hvdsync.testing import run_ranks
from tests.keras_models import KERAS_NP, KERAS_NP_IDS, fit_body


def disagreeing_rank() -> dict:
    """Each case sets one thing up differently on rank 1; every rank must raise the same
    error (at the first step, when the optimizer is built), not hang."""
    import hvdsync.keras as hvd
    hvd.init()
    r = hvd.rank()
    out = {}
    for kind, options in {"select_k": dict(select=dict(k=1 + r)),
                          "technique": dict(threshold=0.5) if r == 0 else dict(select=1),
                          "staleness": dict(delay=dict(staleness=1 + r))}.items():
        try:
            fit_body(options, "sgd", 0.1, 2, 16, record_weights=False)
            out[kind] = "no error"
        except hvd.RanksDisagree as e:
            out[kind] = str(e)
    return out


def shared_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared rank job (tests/conftest.py); the resume and
    3-rank mixed-precision job keep their own (fresh processes; Horovod's fusion off)."""
    cases = ({"disagree": (disagreeing_rank,), "restore_different": (restore_different_points,
                                                                     directory)}
             if np_ in KERAS_NP else {})
    if np_ == 2:
        cases["validate_on_rank0"] = (validate_on_rank_zero_only,)
        cases["amp"] = (amp_rank,)
    return cases


@pytest.mark.parametrize("np_", KERAS_NP)
def test_ranks_that_disagree_all_raise_the_same_error(request, shared_job, np_):
    ranks = shared_job(request.module, np_)["disagree"]
    for kind, field in (("select_k", "select="), ("technique", "select="),
                        ("staleness", "delay=")):
        messages = [r[kind] for r in ranks]
        assert all(m == messages[0] for m in messages), messages
        assert f"-- {field}:" in messages[0], messages[0]


def validate_on_rank_zero_only() -> dict:
    """``fit`` with ``validation_data`` on rank 0 only, delay=, FlushCallback and
    MetricAverageCallback: no hang; the validation sees identical replicas; the metrics every
    rank has are averaged, the validation ones are not."""
    import warnings

    import keras
    import numpy as np

    import hvdsync.keras as hvd
    from tests.keras_models import mlp, teacher_data
    hvd.init()
    model = mlp()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05),
                                   delay=dict(staleness=2, average_every=16))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    x, y = teacher_data(hvd.rank(), 6 * 16)
    seen, epoch_end = [], []

    def flat():
        return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])

    class Spy(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            seen.append(flat())

        def on_epoch_end(self, epoch, logs=None):
            epoch_end.append(flat())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
                         validation_data=(x[:32], y[:32]) if hvd.rank() == 0 else None,
                         callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                    hvd.callbacks.FlushCallback(),
                                    hvd.callbacks.MetricAverageCallback(), Spy()])
    return dict(history=hist.history, seen=seen, epoch_end=epoch_end, final=flat(),
                warned=any("not logged on every rank" in str(w.message) for w in caught))


def test_one_rank_validating_does_not_hang(request, shared_job):
    ranks = shared_job(request.module, 2)["validate_on_rank0"]
    assert len(ranks[0]["seen"]) == 2 and ranks[1]["seen"] == []
    for epoch in range(2):  # rank 0 validated the replicas every rank had (the epoch's flush)
        assert (ranks[0]["seen"][epoch] == ranks[1]["epoch_end"][epoch]).all()
        assert (ranks[0]["epoch_end"][epoch] == ranks[1]["epoch_end"][epoch]).all()
    assert (ranks[0]["final"] == ranks[1]["final"]).all()
    assert ranks[0]["history"]["loss"] == ranks[1]["history"]["loss"]  # averaged
    assert "val_loss" in ranks[0]["history"] and "val_loss" not in ranks[1]["history"]
    assert ranks[0]["warned"] and ranks[1]["warned"]


# -- checkpoint and resume in fresh processes ---------------------------------------------------
RESUME = {
    "plain": {},
    "clip": dict(clip=dict(ema=(0.9, 1.0), warmup=2)),
    "threshold": dict(threshold=dict(threshold=0.3, max_skip=4)),
    "select": dict(select=dict(k=1, max_wait=3)),
    "lowrank": dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0)),
    # compiled lowrank= inside delay= (saved after the drain and averaging of step 8 -- the
    # optimizer state averaged too: a file holds one rank's): Q ring, error feedback
    "delay_lowrank": dict(delay=dict(staleness=1, average_every=4, optimizer_state="average"),
                          lowrank=dict(rank=2, warmup_steps=2, min_compression=0)),
    # local steps, saved with an outer exchange in flight (started after step 8)
    "outer": dict(delay=dict(exchange_gradients=False, average_every=4, fragments=2, overlap=2,
                             mix=0.5, compress="int8", outer_lr=0.7, outer_momentum=0.9)),
    # (every rank's memory saved through the LossScaleOptimizer that wraps the optimizer)
    "mixed_float16": dict(threshold=dict(threshold=1.0, max_skip=4)),
}


def _precision(case: str) -> Optional[str]:
    """Set the case's precision policy; the MLP's dtype (None: the policy's)."""
    import keras
    mixed = case == "mixed_float16"
    keras.mixed_precision.set_global_policy("mixed_float16" if mixed else "float32")
    return None if mixed else "float64"


def _compiled(options: dict, case: str = ""):
    """The MLP in float64, or for case ``mixed_float16`` under that policy."""
    import keras

    import hvdsync.keras as hvd
    from tests.keras_models import mlp
    model = mlp(dtype=_precision(case))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                     **options),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _weights(model) -> list:
    return [v.numpy().copy() for v in model.trainable_variables]


def keras_first_job(directory: str, cases: Optional[dict] = None) -> dict:
    """fit 8 batches, save (hvd.save_model: every rank's memory; and rank 0's model.save),
    fit 8 more: the uninterrupted result (each of ``cases``, default :data:`RESUME`)."""
    import os

    import hvdsync.keras as hvd
    from tests.keras_models import teacher_data
    hvd.init()
    x, y = teacher_data(hvd.rank(), 16 * 16)
    out = {}
    for case, options in (cases or RESUME).items():
        model = _compiled(options, case)
        model.fit(x[:128], y[:128], batch_size=16, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        hvd.save_model(model, os.path.join(directory, f"{case}.keras"))
        if hvd.rank() == 0:
            model.save(os.path.join(directory, f"{case}.rank0.keras"))
        model.fit(x[128:], y[128:], batch_size=16, shuffle=False, verbose=0)
        out[case] = _weights(model)
    return out


def keras_second_job(directory: str, which: str, cases: Optional[dict] = None) -> dict:
    """Fresh processes: hvd.load_model on every rank, fit the same 8 batches."""
    import os
    import warnings

    import hvdsync.keras as hvd
    from tests.keras_models import teacher_data
    hvd.init()
    x, y = teacher_data(hvd.rank(), 16 * 16)
    out = {}
    for case, options in (cases or RESUME).items():
        name = f"{case}.keras" if which == "every_rank" else f"{case}.rank0.keras"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _precision(case)
            model = hvd.load_model(os.path.join(directory, name), **options)
        model.fit(x[128:], y[128:], batch_size=16, shuffle=False, verbose=0)
        out[case] = dict(weights=_weights(model),
                         iterations=int(model.optimizer.iterations.numpy()))
        getattr(model.optimizer, "inner_optimizer", model.optimizer).flush()
        out[case]["flushed"] = _weights(model)
    return out


def keras_second_jobs(directory: str, whichs: tuple[str, ...]) -> dict:
    """:func:`keras_second_job` for each of ``whichs`` in one job: fresh processes (not the
    ones that saved), each with models of its own."""
    return {which: keras_second_job(directory, which) for which in whichs}


@pytest.fixture(scope="module", params=KERAS_NP, ids=KERAS_NP_IDS)
def keras_jobs(request, tmp_path_factory):
    np_ = request.param
    directory = str(tmp_path_factory.mktemp(f"keras_ckpt{np_}"))
    env = {"HOROVOD_FUSION_THRESHOLD": "0"}
    first = run_ranks(keras_first_job, np=np_, args=(directory,), timeout=400, env=env)
    per_rank = run_ranks(keras_second_jobs, np=np_, args=(directory, ("every_rank", "rank0")),
                         timeout=400, env=env)
    return first, {which: [r[which] for r in per_rank] for which in per_rank[0]}


@pytest.mark.parametrize("case", list(RESUME))
def test_keras_fresh_processes_continue_exactly(keras_jobs, case):
    first, second = keras_jobs
    for rank, (a, b) in enumerate(zip(first, second["every_rank"])):
        assert b[case]["iterations"] == 16
        for x, y in zip(a[case], b[case]["weights"]):
            np.testing.assert_array_equal(y, x, err_msg=f"{case} rank {rank}")


def test_keras_one_ranks_file_reuses_no_memory(keras_jobs):
    first, second = keras_jobs
    ranks = second["rank0"]
    for other in ranks[1:]:  # select: global updates from consistent (dropped) memory
        for a, b in zip(ranks[0]["select"]["weights"], other["select"]["weights"]):
            np.testing.assert_array_equal(a, b)
    # rank 0 restored its own memory, the others none: the first step drops rank 0's before
    # anything reads it (threshold's sync points, in the compiled step), so every technique's
    # replicas are identical after flush()
    for case in RESUME:
        for other in ranks[1:]:
            for a, b in zip(ranks[0][case]["flushed"], other[case]["flushed"]):
                np.testing.assert_array_equal(a, b, err_msg=case)
    for a, b in zip(first, ranks):  # nothing per rank: rank 0's file is every rank's
        for x, y in zip(a["plain"], b["plain"]["weights"]):
            np.testing.assert_array_equal(x, y)


def restore_different_points(directory: str) -> dict:
    """Checkpoints of two points of one run (``clip=`` global with adaptive limits: its
    policy is shared), rank 0 loading the first and the others the second: the first step
    after the restore raises the same error on every rank (Keras' compiled clip path runs
    the pipeline's after-restore check, as torch and the deciders' path do)."""
    import os

    import hvdsync.keras as hvd
    from tests.keras_models import teacher_data
    hvd.init()
    x, y = teacher_data(hvd.rank(), 8 * 16)
    options = dict(clip=dict(ema=(0.9, 1.0), warmup=1, mode="global"))
    model = _compiled(options)
    paths = [os.path.join(directory, f"point{i}.keras") for i in range(2)]
    for path in paths:
        model.fit(x[:32], y[:32], batch_size=16, shuffle=False, verbose=0)
        hvd.save_model(model, path)
    hvd.allreduce(np.zeros(1), name="saved")  # every file is written before any is read
    model = hvd.load_model(paths[min(hvd.rank(), 1)], **options)
    try:
        model.fit(x[32:], y[32:], batch_size=16, shuffle=False, verbose=0)
        return {"error": "no error"}
    except Exception as e:  # raised inside the train function: TensorFlow wraps it
        return {"error": str(e)}


@pytest.mark.parametrize("np_", KERAS_NP)
def test_keras_ranks_restoring_different_points_all_raise(request, shared_job, np_):
    ranks = shared_job(request.module, np_)["restore_different"]
    for r in ranks:
        assert "restored different technique state" in r["error"], r["error"][-2000:]


# -- mixed precision and non-finite gradients ---------------------------------------------------
AMP = {
    "plain": ({}, "momentum", {}),
    "clip": (dict(clip=dict(max_norm=0.05)), "momentum", {}),
    "threshold": (dict(threshold=dict(threshold=0.3, max_skip=3)), "momentum", {}),
    "select": (dict(select=dict(k=1, max_wait=2)), "momentum", {}),
    "lowrank": (dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0)), "momentum", {}),
    # staleness 0: what arrives when cannot change the result, so runs compare bit for bit
    "delay": (dict(delay=dict(staleness=0)), "sgd", {}),
    # local steps and the streaming outer synchronization (K 8 in 4 fragments, int8)
    "outer": (dict(delay="streaming"), "sgd", {}),
    "sparse_select": (dict(sparse=True, select=dict(k=1, max_wait=2)), "sgd",
                      dict(model="emb_mlp", vocab=500)),
}


#: one rank's NaN input at the second batch (float32, no loss scaling); plain, clip=,
#: threshold=, select= and the outer synchronization take one in tests/test_adapters_agree.py
#: (float64, step for step against torch, with the checks made here)
NAN = ("lowrank", "delay")


def amp_rank() -> dict:
    out = {}
    for name, (options, opt_name, extra) in AMP.items():
        for scale in (1.0, 2.0 ** 16):  # wrapping a LossScaleOptimizer, float32 compute
            out[f"{name}/{scale:g}"] = fit_body(options, opt_name, 0.05, 8, 16,
                                                loss_scale=scale, **extra)
        if name in NAN:
            out[f"{name}/nan"] = fit_body(options, opt_name, 0.05, 8, 16, nan_rank=1)
    # mixed_float16: Keras wraps the optimizer itself; one rank's NaN overflows the scaler
    for name in ("plain", "select", "outer"):
        out[f"{name}/mixed_nan"] = fit_body(AMP[name][0], "momentum", 0.05, 8, 16, mixed=True,
                                            nan_rank=1, callbacks=("broadcast", "flush"))
    return out


@pytest.fixture(scope="module", params=KERAS_NP, ids=KERAS_NP_IDS)
def amp_runs(request, shared_job):
    if request.param == 2:  # a sum of two is the same in either order: fusion changes no bit
        ranks = shared_job(request.module, 2)["amp"]
    else:  # bit for bit across cases needs Horovod's summation order fixed (fusion timing)
        ranks = run_ranks(amp_rank, np=request.param, timeout=600,
                          env={"HOROVOD_FUSION_THRESHOLD": "0"})
    return {case: [r[case] for r in ranks] for case in ranks[0]}


LOCAL = ("delay", "outer")  # techniques whose steps are not exchanged synchronously


def _equal(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", list(AMP))
def test_keras_loss_scale_does_not_change_the_result(amp_runs, name):
    for one, big in zip(amp_runs[f"{name}/1"], amp_runs[f"{name}/65536"]):
        assert _equal(one["final"], big["final"]), name
        assert big["scale"] == 2.0 ** 16  # no overflow, no growth


@pytest.mark.parametrize("name", NAN)
def test_keras_nan_on_one_rank_is_skipped_everywhere(amp_runs, name):
    ranks = amp_runs[f"{name}/nan"]
    for r in ranks:
        assert all(np.isfinite(w).all() for w in r["final"].values())
        if name not in LOCAL:  # skipped on every rank: one update fewer everywhere
            assert r["iterations"] == 7 and r["stats"]["total"]["nonfinite_steps"] == 1
    if name in LOCAL:  # the bad rank counts its non-finite layers (zeros in their place)
        assert [r["stats"]["total"].get("nonfinite", 0) > 0 for r in ranks] == \
            [rank == 1 for rank in range(len(ranks))]
    else:  # global updates
        for other in ranks[1:]:
            assert _equal(ranks[0]["final"], other["final"])


@pytest.mark.parametrize("name", ["plain", "select", "outer"])
def test_mixed_float16_overflow_on_one_rank_is_skipped_everywhere(amp_runs, name):
    """Keras wraps the hvdsync optimizer in its LossScaleOptimizer; one rank's overflow makes
    every rank skip that step and halve its scale (no hang, no drift between ranks; with
    local steps the outer schedule stays aligned, and FlushCallback leaves equal replicas)."""
    ranks = amp_runs[f"{name}/mixed_nan"]
    for r in ranks:
        assert r["iterations"] == 7 and r["scale"] == 2.0 ** 14
        assert all(np.isfinite(w).all() for w in r["final"].values())
    for other in ranks[1:]:
        assert _equal(ranks[0]["final"], other["final"])
