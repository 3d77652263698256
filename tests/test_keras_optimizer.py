"""hvdsync.keras with no technique: the same weights as plain averaged-gradient training,
through ``model.fit`` in compiled mode on 2 and 3 real ranks; callbacks; save/load; errors."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from tests.keras_models import fit_body, key, mlp, teacher_data
from tests.models import REAL_NP, REAL_NP_IDS


def _parity_cases():
    import horovod.tensorflow as htf
    f64 = dict(dtype="float64", reference=True, record_weights=False)
    return {
        "sgd": ({}, "sgd", 0.1, 12, 16),
        "momentum": ({}, "momentum", 0.05, 12, 16),
        "adam": ({}, "adam", 0.01, 12, 16),
        "sum": (dict(op=htf.Sum), "sgd", 0.05, 12, 16),
        "predivide": (dict(gradient_predivide_factor=2.0), "momentum", 0.05, 12, 16),
        "groups": (dict(groups=2), "momentum", 0.05, 8, 16),
        "passes": (dict(backward_passes_per_step=2), "sgd", 0.05, 8, 16),
        "passes_avg": (dict(backward_passes_per_step=2, average_aggregated_gradients=True),
                       "momentum", 0.05, 8, 16),
        "fp16": (dict(compression=htf.Compression.fp16), "momentum", 0.05, 12, 16),
    }, f64


def parity_rank(np_: int) -> list:
    cases, common = _parity_cases()
    out = []
    for name, (opts, opt_name, lr, steps, batch) in cases.items():
        kw = dict(common)
        if name == "fp16":
            kw["dtype"] = "float32"
        r = fit_body(opts, opt_name, lr, steps, batch, **kw)
        out.append((name, r["max_diff"], r["stats"]["total"], r["final"]))
    # Horovod's own Keras 3 path (DistributedGradientTape in train_step) gives the same weights
    # as the cases above (the same fits: not run twice)
    for name in ("momentum", "adam"):
        _, opt_name, lr, steps, batch = cases[name]
        mine = next(r for r in out if r[0] == name)
        peer = fit_body({}, opt_name, lr, steps, batch, dtype="float64", horovod_peer=True)
        diff = max(float(np.abs(mine[3][k] - peer["final"][k]).max()) for k in peer["final"])
        out.append((f"horovod_tape_{name}", diff, mine[2], mine[3]))
    for name, opts in (("embedding", {}), ("embedding_dense", dict(sparse_as_dense=True))):
        r = fit_body(opts, "sgd", 0.5, 12, 16, model="emb", reference=True,
                     record_weights=False)
        out.append((name, r["max_diff"], r["stats"]["total"], r["final"]))
    return out


def shared_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared rank job (tests/conftest.py): parity on 2 and
    3 ranks, the callbacks on 3, models saved on 2 (the files in ``directory``)."""
    cases = {"parity": (parity_rank, np_)} if np_ in REAL_NP else {}
    if np_ == 3:
        cases["callbacks"] = (callbacks_rank,)
    if np_ == 2:
        cases.update({f"save/{name}": (save_rank, os.path.join(directory, f"{name}.keras"),
                                       options, 7) for name, options in SAVES.items()})
        cases["save/unconfigured"] = (save_rank, os.path.join(directory, "threshold3.keras"),
                                      dict(threshold=0.5), 3)
        cases["save/example"] = (example_rank, os.path.join(directory, "digits.keras"))
    return cases


@pytest.fixture(scope="module", params=REAL_NP, ids=REAL_NP_IDS)
def parity(request, shared_job):
    return request.param, shared_job(request.module, request.param)["parity"]


def test_no_technique_equals_averaged_gradient_training(parity):
    np_, ranks = parity
    for rank_result in ranks:
        for name, diff, _, _ in rank_result:
            tol = 1e-3 if name == "fp16" else 1e-5
            assert diff <= tol, f"{name} on {np_} ranks: max |w - reference| = {diff:.2e}"


def test_replicas_identical(parity):
    _, ranks = parity
    for i, (name, _, _, final) in enumerate(ranks[0]):
        for other in ranks[1:]:
            for k in final:
                np.testing.assert_array_equal(final[k], other[i][3][k], err_msg=f"{name} {k}")


def test_stats_count_what_horovod_sends(parity):
    np_, ranks = parity
    by_name = {name: total for name, _, total, _ in ranks[0]}
    # mlp float64: fc1 12x16+16, fc2 16x16+16, out 16x4+4 parameters, 8 bytes each
    per_step = (12 * 16 + 16 + 16 * 16 + 16 + 16 * 4 + 4) * 8
    t = by_name["sgd"]
    assert t["step"] == 12 and t["bytes_sent"] == t["bytes_dense"] == 12 * per_step
    assert t["collectives"] == 12 * 3 and t["layers_sent"] == 12 * 3
    assert by_name["groups"]["collectives"] == 8 * 2  # groups=2: two grouped allreduces
    assert by_name["passes"]["step"] == 4  # 8 batches: one exchange per two
    fp16 = by_name["fp16"]  # float32 model, fp16 on the wire
    assert fp16["bytes_sent"] * 2 == fp16["bytes_dense"]
    emb = by_name["embedding"]
    assert emb["bytes_sent"] == emb["bytes_dense"]  # Horovod's sparse path: rows as computed


# -- callbacks -------------------------------------------------------------------------------
def callbacks_rank() -> dict:
    out = {}
    # ranks start from different weights: the broadcast must make them rank 0's
    r = fit_body({}, "sgd", 0.1, 6, 16, seed_by_rank=True,
                 callbacks=("broadcast", "metric_average", "stats"), epochs=2,
                 validation=True)
    out["broadcast"] = dict(first=r["weights"][0], history=r["history"], logs=r["logs"],
                            final=r["final"])
    r = fit_body({}, "sgd", 0.1, 6, 16, seed_by_rank=True, callbacks=(), epochs=1)
    out["no_broadcast"] = r["weights"][0]
    r = fit_body({}, "sgd", 0.1, 6, 16, callbacks=("broadcast",), epochs=3,
                 warmup=dict(initial_lr=0.4, warmup_epochs=2))
    out["warmup"] = r["lr"]
    r = fit_body(dict(clip=dict(max_norm=0.05)), "sgd", 0.1, 4, 16,
                 callbacks=("broadcast", "stats"))
    out["clip_logs"] = r["logs"]
    out["broadcast_variables"] = broadcast_mixed_variables(root_rank=1)
    return out


def broadcast_mixed_variables(root_rank: int) -> list:
    """``hvd.broadcast_variables`` of variables of three dtypes and several shapes (one
    broadcast per dtype, flattened): every rank ends with ``root_rank``'s values, shapes
    kept, the dtypes interleaved in the list."""
    import keras
    import hvdsync.keras as hvd
    r = hvd.rank()
    variables = [keras.Variable(np.full((2, 3), r, "float32")),
                 keras.Variable(np.int64(10 + r)),
                 keras.Variable(np.arange(4, dtype="float64") * (r + 1)),
                 keras.Variable(np.full((3, 2), -r, "float32")),
                 keras.Variable(np.zeros((0, 5), "float32") + r)]
    hvd.broadcast_variables(variables, root_rank=root_rank)
    return [np.array(v.numpy()) for v in variables]


@pytest.fixture(scope="module")
def callbacks_run(request, shared_job):
    return shared_job(request.module, 3)["callbacks"]


def test_broadcast_callback_starts_every_rank_from_rank0(callbacks_run):
    first = [r["broadcast"]["first"] for r in callbacks_run]
    for k in first[0]:
        for other in first[1:]:
            np.testing.assert_array_equal(first[0][k], other[k])
    unsynced = [r["no_broadcast"] for r in callbacks_run]
    assert any(not np.array_equal(unsynced[0][k], unsynced[1][k]) for k in unsynced[0])


def test_broadcast_variables_of_mixed_dtypes_and_shapes(callbacks_run):
    expected = [np.full((2, 3), 1, "float32"), np.int64(11), np.arange(4, dtype="float64") * 2,
                np.full((3, 2), -1, "float32"), np.zeros((0, 5), "float32")]
    for rank, r in enumerate(callbacks_run):
        for got, want in zip(r["broadcast_variables"], expected):
            assert got.dtype == want.dtype and got.shape == want.shape, (rank, got, want)
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}")


def test_metric_average_callback(callbacks_run):
    hist = [r["broadcast"]["history"] for r in callbacks_run]
    for name in ("loss", "accuracy", "val_loss", "val_accuracy"):
        for other in hist[1:]:
            assert other[name] == pytest.approx(hist[0][name], rel=1e-6), name
    # without averaging the ranks' validation losses differ (different data)


def test_sync_stats_callback_puts_stats_in_logs_and_history(callbacks_run):
    logs = callbacks_run[0]["broadcast"]["logs"]
    assert logs, "no batch logs recorded"
    hist = callbacks_run[0]["broadcast"]["history"]
    assert hist["hvd_dense_ratio"] == [pytest.approx(1.0)] * 2
    assert hist["hvd_collectives"] == [pytest.approx(3.0)] * 2
    assert hist["hvd_sent"] == [pytest.approx(3.0)] * 2
    per_step_kib = (12 * 16 + 16 + 16 * 16 + 16 + 16 * 4 + 4) * 4 / 1024
    assert hist["hvd_kib"][0] == pytest.approx(per_step_kib)
    clip_hist = callbacks_run[0]["clip_logs"]
    assert clip_hist  # batch logs exist; clipping counted per batch by the stats callback


def test_learning_rate_warmup_callback(callbacks_run):
    lr = callbacks_run[0]["warmup"]  # 6 batches/epoch, 3 epochs, warmup 2 epochs, 3 ranks
    expected = [0.4 / 3 * ((e + b / 6) * 2 / 2 + 1) if e < 2 else 0.4
                for e in range(3) for b in range(6)]
    assert lr == pytest.approx(expected, rel=1e-5)


# -- saving ----------------------------------------------------------------------------------
def save_rank(path: str, options: dict, steps: int) -> dict:
    return dict(fit_body(options, "adam", 0.01, steps, 16, record_weights=False, save_to=path),
                path=path)


SAVES = {"plain": {}, "threshold": dict(threshold=dict(threshold=0.5, max_skip=3)),
         "select": dict(select=dict(k=1)), "clip": dict(clip=dict(ema=(0.9, 1.0)))}


def example_rank(path: str) -> dict:
    from examples.keras.train_digits import train
    return dict(train(epochs=4, verbose=False, save=path), path=path)


@pytest.fixture(scope="module")
def saved(request, shared_job):
    """Models trained and saved on 2 ranks: per case, the file and every rank's result."""
    runs = shared_job(request.module, 2)
    return {name[len("save/"):]: (ranks[0]["path"], ranks) for name, ranks in runs.items()
            if name.startswith("save/")}


@pytest.mark.parametrize("name", list(SAVES))
def test_save_and_load_round_trip(saved, name):
    import keras
    import hvdsync.keras as hvd
    options = SAVES[name]
    path, ranks = saved[name]
    result = ranks[0]
    hvd.init()
    model = hvd.load_model(path, **options)
    opt = model.optimizer
    assert isinstance(opt, keras.optimizers.Adam) and hasattr(opt, "stats")
    for v in model.trainable_variables:
        np.testing.assert_array_equal(v.numpy(), result["final"][key(v)])
    assert int(opt.iterations.numpy()) == 7
    if options:
        technique = next(iter(options))
        state = opt.technique_state()["techniques"]
        assert technique in state
        if technique == "threshold":  # planned a step ahead: through step 8
            assert state["threshold"]["policy"]["step"] == 8
        if technique == "select":
            assert state["select"]["policy"]["step"] == 7
        if technique == "clip":
            # adaptive clip's norm statistics are each rank's own memory: a checkpoint of
            # 2 ranks does not hand them to a 1-rank job (docs/checkpoints.md)
            assert sum(state["clip"]["policy"]["count"]) == 0
    # training continues from the restored state
    x, y = teacher_data(0, 32)
    model.fit(x, y, batch_size=16, verbose=0)
    assert int(opt.iterations.numpy()) == 9
    # plain Keras loads the model (the optimizer as the class it wraps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = keras.models.load_model(path)
    for v in plain.trainable_variables:
        np.testing.assert_array_equal(v.numpy(), result["final"][key(v)])
    if not options:  # nothing of hvdsync's in the file: the optimizer state loads too
        assert int(plain.optimizer.iterations.numpy()) == 7


def test_load_model_refuses_state_of_an_unconfigured_technique(saved):
    import hvdsync.keras as hvd
    path, _ = saved["unconfigured"]
    hvd.init()
    with pytest.raises(ValueError, match="threshold="):
        hvd.load_model(path)


# -- construction errors -----------------------------------------------------------------------
def _fails(exc, pattern, optimizer=None, **kwargs):
    import keras
    import hvdsync.keras as hvd
    hvd.init()
    with pytest.raises(exc, match=pattern):
        hvd.DistributedOptimizer(optimizer if optimizer is not None
                                 else keras.optimizers.SGD(0.1), **kwargs)


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(clipp=1.0), TypeError, "did you mean 'clip'"),
    (dict(clip=dict(max_norm=-1)), ValueError, "max_norm must be > 0"),
    (dict(threshold=0.5, select=1), ValueError, "pass one of them"),
    (dict(delay=2, sparse=True), ValueError, "pass one of them"),
    (dict(sparse=True, sparse_as_dense=True), ValueError, "sparse_as_dense"),
    (dict(backward_passes_per_step=0), ValueError, "backward_passes_per_step must be >= 1"),
    (dict(device_dense="/gpu:0"), ValueError, "device_dense"),
    (dict(clip=dict(max_norm=1.0, mode="global"), delay=1), ValueError, "clip mode 'local'"),
    (dict(threshold=0.5, select=1, sparse=True), ValueError, "pass one of them"),
    (dict(compression="fp16"), TypeError, "compress"),
    (dict(layers=3, groups=2), ValueError, "either groups"),
])
def test_bad_arguments_fail_at_construction(kwargs, exc, pattern):
    _fails(exc, pattern, **kwargs)


def test_bad_optimizer_and_op():
    import keras
    import horovod.tensorflow as htf
    import hvdsync.keras as hvd
    _fails(TypeError, "keras.optimizers.Optimizer", optimizer=object())
    _fails(ValueError, "needs op=Average", delay=1, op=htf.Sum)
    _fails(ValueError, "Adasum", op=htf.Adasum)
    hvd.init()
    wrapped = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="already wrapped"):
        hvd.DistributedOptimizer(wrapped)


def test_single_process_fit_works_and_counts_nothing_sent():
    """Without horovodrun (one rank) fit trains locally; stats show no bytes sent."""
    import keras
    import hvdsync.keras as hvd
    hvd.init()
    m = mlp()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), clip=1.0)
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = teacher_data(0, 64)
    m.fit(x, y, batch_size=16, verbose=0)
    assert opt.stats.total.step == 4 and opt.stats.total.bytes_sent == 0
    assert [layer.name.split("/")[-1] for layer in opt.layers] == ["fc1", "fc2", "out"]


def test_broadcast_callback_builds_the_optimizer_so_the_step_is_traced_once():
    """Keras builds an optimizer while tracing the train function; TensorFlow then traces a
    second time (variables were created). The broadcast callback builds it first (a built
    model): one trace. An unbuilt model is left to Keras: two traces, training as before."""
    import keras
    import hvdsync.keras as hvd
    hvd.init()
    x, y = teacher_data(0, 64)

    def traces(model, callbacks) -> int:
        count = []
        step = model.train_step
        model.train_step = lambda data: (count.append(1), step(data))[1]
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), threshold=0.1)
        model.compile(optimizer=opt,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, verbose=0, callbacks=callbacks)
        assert opt.stats.total.step == 4
        return len(count)

    assert traces(mlp(), [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]) == 1
    assert traces(mlp(), []) == 2
    unbuilt = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(4)])
    assert traces(unbuilt, [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]) == 2


# -- the example ---------------------------------------------------------------------------------
def test_keras_example_trains_and_saves(saved):
    path, ranks = saved["example"]
    assert ranks[0]["accuracy"] >= 0.9, ranks[0]["accuracy"]
    assert ranks[0]["accuracy"] == ranks[1]["accuracy"]  # identical replicas
    assert os.path.exists(path)
    assert ranks[0]["history"]["hvd_dense_ratio"][-1] == pytest.approx(1.0)
