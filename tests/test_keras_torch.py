"""hvdsync.keras on Keras' torch backend (``KERAS_BACKEND=torch``), on real torchrun ranks with
neither Horovod nor TensorFlow importable: ``fit`` with each technique and every pair the
rulebook allows leaves identical replicas after ``FlushCallback`` and lowers the loss; with
nothing enabled it gives the weights of Keras with a plain averaged gradient, and each
technique those of hvdsync.torch and torch's SGD on the same torch model (1e-6); the same
script runs on horovodrun; a rank that dies ends the job with a message; bad setups are
refused with the fix. One torchrun job per rank count runs every case."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from hvdsync.core.topology import OVERRIDE
from hvdsync.testing import HIDE_ENV, RanksFailed, run_ranks

ENV = {HIDE_ENV: "horovod,tensorflow", "KERAS_BACKEND": "torch"}
TORCHRUN = dict(launcher="torchrun", env=ENV)
STREAMING = "streaming"
CASES = {  # name: (model, keywords)
    "plain": ("mlp", {}),
    "clip": ("mlp", dict(clip=1.0)),
    "clip_global": ("mlp", dict(clip=dict(max_norm=0.5, mode="global"))),
    "threshold": ("mlp", dict(threshold=dict(threshold=0.3, max_skip=3))),
    "select": ("mlp", dict(select=dict(k=1, selector="norm", max_wait=2))),
    "lowrank": ("mlp", dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0))),
    # (fold="due": the same steps fold on every run, so torch's run can be compared)
    "delay": ("mlp", dict(delay=dict(staleness=1, average_every=4, fold="due"))),
    "streaming": ("mlp", dict(delay=STREAMING)),
    "sparse": ("embedding", dict(sparse=True)),
    "clip_threshold": ("mlp", dict(clip=1.0, threshold=dict(threshold=0.3, max_skip=3))),
    "clip_select": ("mlp", dict(clip=1.0, select=dict(k=1, selector="norm", max_wait=2))),
    "clip_lowrank": ("mlp", dict(clip=1.0, lowrank=dict(rank=2, warmup_steps=2,
                                                           min_compression=0))),
    "clip_delay": ("mlp", dict(clip=1.0, delay=dict(staleness=1, average_every=4))),
    "threshold_lowrank": ("mlp", dict(threshold=dict(threshold=0.3, max_skip=3),
                                      lowrank=dict(rank=2, warmup_steps=2, min_compression=0))),
    "select_lowrank": ("mlp", dict(select=dict(k=1, selector="norm", max_wait=2),
                                   lowrank=dict(rank=2, warmup_steps=2, min_compression=0))),
    "lowrank_delay": ("mlp", dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0),
                                  delay=dict(staleness=1, average_every=4))),
    "sparse_clip": ("embedding", dict(sparse=True, clip=1.0)),
    "sparse_threshold": ("embedding", dict(sparse=True, threshold=dict(threshold=0.3,
                                                                         max_skip=3))),
    "sparse_select": ("embedding", dict(sparse=True, select=dict(k=1, selector="norm",
                                                                   max_wait=2))),
    "sparse_lowrank": ("embedding", dict(sparse=True, lowrank=dict(rank=2, warmup_steps=2,
                                                                     min_compression=0))),
}
#: compared with hvdsync.torch and torch's SGD on the same model: the techniques that keep,
#: restore or average the optimizer's state (Keras' slots, seen as torch's state)
AS_TORCH = ("clip", "threshold", "select", "lowrank", "delay", "streaming", "clip_threshold")
ON_3_RANKS = ("plain", "threshold", "lowrank", "streaming", "sparse", "clip_select")


def _data(model: str, rank: int, n: int = 32):
    """A learnable task, a different shard per rank."""
    rng = np.random.default_rng(100 + rank)
    if model == "embedding":
        x = rng.integers(0, 40, (n, 5))
        return x, (x.sum(axis=1) % 3).astype("int64")
    x = rng.standard_normal((n, 8)).astype("float32")
    return x, np.argmax(x[:, :3] + 0.5 * x[:, 3:6], axis=1).astype("int64")


def _model(kind: str):
    import keras
    keras.utils.set_random_seed(0)
    if kind == "embedding":
        return keras.Sequential([keras.Input((5,), dtype="int64"),
                                 keras.layers.Embedding(40, 8, name="emb"),
                                 keras.layers.GlobalAveragePooling1D(),
                                 keras.layers.Dense(3, name="out")])
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu",
                                                                   name="fc1"),
                             keras.layers.Dense(8, activation="relu", name="fc2"),
                             keras.layers.Dense(3, name="out")])


def _weights(model) -> list[float]:
    return np.concatenate([np.asarray(v.numpy()).ravel() for v in model.weights]).tolist()


def _fit(kind: str, optimizer, epochs: int = 3, build_first: bool = False) -> tuple[list, list]:
    """``build_first``: the optimizer a LossScaleOptimizer wraps is built before ``fit``."""
    import keras

    import hvdsync.keras as hvd
    model = _model(kind)
    if build_first:
        optimizer.inner_optimizer.build(model.trainable_variables)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    x, y = _data(kind, hvd.rank())
    history = model.fit(x, y, epochs=epochs, batch_size=8, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback(),
                                   hvd.callbacks.FlushCallback()])
    return _weights(model), history.history["loss"]


def _averaged_sgd(lr: float):
    """Keras' SGD with the gradients averaged over the ranks before each update: the
    reference a plain DistributedOptimizer must equal."""
    import keras
    import torch.distributed as dist

    def average(g, i: int):
        if dist.is_initialized():  # torchrun: torch.distributed itself
            dist.all_reduce(g)
            return g.div_(dist.get_world_size())
        import horovod.torch  # horovodrun: Horovod's own allreduce
        return horovod.torch.allreduce(g, name=f"reference.{i}", op=horovod.torch.Average)

    class AveragedSGD(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            grads = [average(g.clone(), i) for i, g in enumerate(grads)]
            return super().apply(grads, trainable_variables)
    return AveragedSGD(lr)


def _torch_loop(lr: float, momentum: float = 0.0, **keywords) -> list[float]:
    """hvdsync.torch on the same Keras model (a torch module): a plain training loop with
    torch's SGD, flushed where FlushCallback flushes (each epoch's end)."""
    import keras
    import torch

    import hvdsync.torch as hvd
    model = _model("mlp")
    model.build((None, 8))
    # a Keras model's parameters are one torch module's, sorted by name: take them in Keras'
    # order, by path, grouped by Keras layer, as hvdsync.keras does
    variables = model.trainable_variables
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([v.value for v in variables], lr=lr, momentum=momentum),
        named_parameters=[(v.path, v.value) for v in variables],
        layers=lambda path: path.rsplit("/", 1)[0], **keywords)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = _data("mlp", hvd.rank())
    for _ in range(3):
        for i in range(0, len(x), 8):
            opt.zero_grad()
            loss_fn(torch.as_tensor(y[i:i + 8]), model(torch.as_tensor(x[i:i + 8]))).backward()
            opt.step()
        opt.flush()
    return _weights(model)


def keras_torch_cases(names: tuple[str, ...]) -> dict:
    """On each rank: every case's weights after ``fit`` and its averaged losses; the references
    for the plain case; which of TensorFlow and Horovod got imported (neither may)."""
    import keras

    import hvdsync.keras as hvd
    hvd.init()
    out = {}
    for name in names:
        kind, keywords = CASES[name]
        out[name] = _fit(kind, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                        **keywords))
    if "plain" in names:
        out["plain_sgd"] = _fit("mlp", hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)))
        out["reference"] = _fit("mlp", _averaged_sgd(0.05))
        out["hvdsync_torch"] = _torch_loop(0.05)
    for name in [n for n in AS_TORCH if n in names]:  # the same technique on hvdsync.torch
        out[f"{name}_torch"] = _torch_loop(0.1, 0.9, **CASES[name][1])
    out["imported"] = sorted(m for m in ("tensorflow", "horovod") if sys.modules.get(m))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def ranks(request) -> list[dict]:
    names = tuple(CASES) if request.param == 2 else ON_3_RANKS
    return run_ranks(keras_torch_cases, request.param, args=(names,), timeout=420, **TORCHRUN)


def _case_names(ranks: list[dict]) -> list[str]:
    return [n for n in CASES if n in ranks[0]]


def test_on_horovodrun_too():
    """Where Horovod is installed, the same script runs on horovodrun (Horovod's engine)."""
    ranks = run_ranks(keras_torch_cases, 2, args=(("plain", "threshold", "streaming"),),
                      timeout=300, env={"KERAS_BACKEND": "torch"})
    test_every_case_leaves_identical_replicas_and_learns(ranks)
    test_nothing_enabled_equals_an_averaged_gradient_and_hvdsync_torch(ranks)


def test_neither_tensorflow_nor_horovod_is_imported(ranks):
    assert all(r["imported"] == [] for r in ranks)


def test_every_case_leaves_identical_replicas_and_learns(ranks):
    for name in _case_names(ranks):
        weights = [np.asarray(r[name][0]) for r in ranks]
        assert all(np.array_equal(weights[0], w) for w in weights[1:]), name
        losses = ranks[0][name][1]
        assert all(np.isfinite(losses)) and losses[-1] < losses[0], (name, losses)


def test_nothing_enabled_equals_an_averaged_gradient_and_hvdsync_torch(ranks):
    for r in ranks:
        plain = np.asarray(r["plain_sgd"][0])
        np.testing.assert_allclose(plain, r["reference"][0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(plain, r["hvdsync_torch"], rtol=0, atol=1e-6)
    assert ranks[0]["plain_sgd"][1][-1] < ranks[0]["plain_sgd"][1][0]  # it trained


# -- between="nodes": Keras on its torch backend runs hvdsync.torch's two levels -------------
NODE_CASES = ("plain", "threshold", "lowrank", "streaming", "sparse")


def keras_torch_nodes(names: tuple[str, ...]) -> dict:
    """On a rank of 2 nodes x 2: each case two-level (``between="nodes"``), after ``fit``
    and ``FlushCallback``; and the summary's line on the layout."""
    import keras

    import hvdsync.keras as hvd
    hvd.init(process_sets=hvd.node_process_sets())
    out = {}
    for name in names:
        kind, keywords = CASES[name]
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                       between="nodes", **keywords)
        out[name] = _fit(kind, opt)
        out[f"{name} summary"] = opt.stats.summary()
    return out


def test_two_levels_on_nodes_leave_identical_replicas_and_learn():
    """4 torchrun ranks as 2 nodes x 2 (docs/nodes.md): every case leaves identical replicas
    on every rank of every node after FlushCallback, and learns."""
    ranks = run_ranks(keras_torch_nodes, 4, args=(NODE_CASES,), timeout=420,
                      launcher="torchrun", env={**ENV, OVERRIDE: "2"})
    test_every_case_leaves_identical_replicas_and_learns(ranks)
    assert "between='nodes': 2 nodes x 2 ranks" in ranks[0]["threshold summary"]


#: resumed from hvd.save_model in fresh processes, bit for bit (delay= folding when due: by
#: arrival, when a gradient is folded depends on timing)
RESUMED = {"plain": {}, "clip": dict(clip=1.0),
           "threshold": dict(threshold=dict(threshold=1.0, max_skip=3)),
           "select": dict(select=dict(k=1, selector="norm", max_wait=2)),
           "lowrank": dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0)),
           "streaming": dict(delay=STREAMING),
           # (saved right after an averaging step, and between two)
           "delay": dict(delay=dict(staleness=1, average_every=4, fold="due")),
           "delay_unaveraged": dict(delay=dict(staleness=1, average_every=1000, fold="due")),
           # (every rank's memory saved through the LossScaleOptimizer that wraps it)
           "mixed_float16": dict(threshold=dict(threshold=1.0, max_skip=3))}


def save_then_resume(folder: str, resume: bool) -> dict:
    """Each case: 2 epochs, ``hvd.save_model`` (its memory unflushed but for delay=), 2 more;
    or, with ``resume``, ``hvd.load_model`` of that file and the same 2 epochs. The weights at
    the end, and the layers kept back."""
    import keras

    import hvdsync.keras as hvd
    hvd.init()
    x, y = _data("mlp", hvd.rank())
    out = {}
    for name, keywords in RESUMED.items():
        keras.mixed_precision.set_global_policy(name if name == "mixed_float16" else "float32")
        path = os.path.join(folder, f"{name}.keras")
        if resume:
            model = hvd.load_model(path, **keywords)
        else:
            model = _model("mlp")
            model.compile(optimizer=hvd.DistributedOptimizer(
                keras.optimizers.SGD(0.1, momentum=0.9), **keywords),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            # (flushed where delay= needs it; elsewhere the memory is saved as it is)
            model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0,
                      callbacks=[hvd.callbacks.FlushCallback()] if "delay" in name else [])
            hvd.save_model(model, path)
        model.fit(x, y, epochs=4, initial_epoch=2, batch_size=8, shuffle=False, verbose=0)
        opt = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        out[name] = (_weights(model), opt.stats.total.layers_skipped)
    return out


@pytest.mark.parametrize("np_", [2, 3])
def test_a_checkpoint_resumes_bit_for_bit_in_fresh_processes(tmp_path, np_):
    first, again = (run_ranks(save_then_resume, np_, args=(str(tmp_path), resume),
                              timeout=300, **TORCHRUN) for resume in (False, True))
    for a, b in zip(first, again):
        for name in RESUMED:
            np.testing.assert_array_equal(b[name][0], a[name][0], err_msg=name)
    for name in ("threshold", "mixed_float16"):  # kept layers back: memory had to come back
        assert first[0][name][1] > 0, name


#: on both backends in float64, where their arithmetic agrees far below any decision's margin
#: (delay= folds when due: the TensorFlow backend's compiled step does). Plain Keras differs
#: between its two backends by ~3e-8 on this run (its own kernels); checked to 1e-6.
BOTH = {"plain": {}, "clip": dict(clip=1.0),
        "threshold": dict(threshold=dict(threshold=1.0, max_skip=3)),
        "select": dict(select=dict(k=1, selector="norm", max_wait=2)),
        "lowrank": dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0)),
        "delay": dict(delay=dict(staleness=1, average_every=4, fold="due")),
        "streaming": dict(delay=STREAMING),
        "accumulated": dict(backward_passes_per_step=2, clip=1.0)}


def on_this_backend() -> dict:
    """Each case of ``BOTH`` through ``fit`` in float64 on the backend KERAS_BACKEND names."""
    import keras

    import hvdsync.keras as hvd
    hvd.init()
    keras.config.set_floatx("float64")
    x, y = _data("mlp", hvd.rank())
    out = {}
    for name, keywords in BOTH.items():
        model = _model("mlp")
        rng = np.random.default_rng(7)  # (the backends' own initializers draw differently)
        for v in model.weights:
            v.assign(0.4 * rng.standard_normal(tuple(v.shape)))
        # hyper-parameters exact in float32, a float64 loss: Keras rounds them through float32
        # on one backend and not the other
        model.compile(optimizer=hvd.DistributedOptimizer(
            keras.optimizers.SGD(0.125, momentum=0.75), **keywords),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64"))
        model.fit(x.astype("float64"), y, epochs=3, batch_size=8, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.FlushCallback()])
        out[name] = _weights(model)
    return out


def test_the_torch_and_tensorflow_backends_agree_per_technique():
    on_tf = run_ranks(on_this_backend, 2, timeout=400, env={"KERAS_BACKEND": "tensorflow"})
    on_torch = run_ranks(on_this_backend, 2, timeout=300, **TORCHRUN)
    for a, b in zip(on_tf, on_torch):
        for name in BOTH:
            np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-6, err_msg=name)


def nan_on_one_rank(policy: str = "float32") -> dict:
    """Rank 1's third batch holds a NaN (in each of 2 epochs): those steps are skipped on every
    rank (threshold= keeps memory that must not take it in), the replicas stay identical and
    finite. ``policy="mixed_float16"``: compile adds the LossScaleOptimizer."""
    import keras

    import hvdsync.keras as hvd
    hvd.init()
    keras.mixed_precision.set_global_policy(policy)
    x, y = _data("mlp", hvd.rank())
    if hvd.rank() == 1:
        x[16, 0] = np.nan
    model = _model("mlp")
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                   threshold=dict(threshold=0.3, max_skip=3))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.FlushCallback()])
    scale = getattr(model.optimizer, "dynamic_scale", None)
    return dict(weights=_weights(model), skipped=opt.stats.total.counters.get("nonfinite_steps"),
                iterations=int(opt.iterations.numpy()), wrapped=type(model.optimizer).__name__,
                scale=None if scale is None else float(scale.numpy()))


def test_a_nan_on_one_rank_skips_that_step_on_every_rank():
    ranks = run_ranks(nan_on_one_rank, 2, timeout=240, **TORCHRUN)
    a, b = (np.asarray(r["weights"]) for r in ranks)
    assert np.array_equal(a, b) and np.isfinite(a).all()
    assert [r["skipped"] for r in ranks] == [2, 2]
    assert [r["iterations"] for r in ranks] == [6, 6]  # 8 batches, two skipped everywhere


#: loss scaling at 2^16 (float32 compute): the same weights, bit for bit, as without it
SCALED = {"plain": {}, "clip": dict(clip=1.0),
          "threshold": dict(threshold=dict(threshold=0.3, max_skip=3)),
          "select": dict(select=dict(k=1, selector="norm", max_wait=2)),
          "lowrank": dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0)),
          "delay": dict(delay=dict(staleness=1, average_every=4, fold="due")),
          "streaming": dict(delay=STREAMING)}


def loss_scaled() -> dict:
    """Each case of ``SCALED`` without loss scaling and under a LossScaleOptimizer at 2^16,
    in turn handed to hvd.DistributedOptimizer, wrapped around it by hand, or wrapped around
    it by hand after it was built."""
    from keras.optimizers import SGD, LossScaleOptimizer

    import hvdsync.keras as hvd
    hvd.init()
    out = {}
    for i, (name, keywords) in enumerate(SCALED.items()):
        scale = dict(initial_scale=2.0 ** 16, dynamic_growth_steps=10 ** 6)
        scaled = (hvd.DistributedOptimizer(LossScaleOptimizer(SGD(0.1, momentum=0.9), **scale),
                                           **keywords) if i % 3 == 0 else
                  LossScaleOptimizer(hvd.DistributedOptimizer(SGD(0.1, momentum=0.9),
                                                              **keywords), **scale))
        out[name] = (_fit("mlp", hvd.DistributedOptimizer(SGD(0.1, momentum=0.9), **keywords))[0],
                     _fit("mlp", scaled, build_first=i % 3 == 2)[0],
                     float(scaled.dynamic_scale.numpy()))
    return out


def test_loss_scaling_leaves_every_technique_unchanged_bit_for_bit():
    for r in run_ranks(loss_scaled, 2, timeout=300, **TORCHRUN):
        for name, (plain, scaled, scale) in r.items():
            assert scale == 2.0 ** 16, name  # (no overflow: every step applied)
            np.testing.assert_array_equal(scaled, plain, err_msg=name)


def test_mixed_float16_skips_a_nan_on_one_rank_on_every_rank_and_halves_each_scale():
    ranks = run_ranks(nan_on_one_rank, 2, args=("mixed_float16",), timeout=240, **TORCHRUN)
    a, b = (np.asarray(r["weights"]) for r in ranks)
    assert np.array_equal(a, b) and np.isfinite(a).all()
    assert all(r["wrapped"] == "LossScaleOptimizer" for r in ranks)
    assert [r["scale"] for r in ranks] == [2.0 ** 13] * 2  # 2^15 halved twice, on each rank
    assert [r["skipped"] for r in ranks] == [2, 2]
    assert [r["iterations"] for r in ranks] == [6, 6]


#: backward_passes_per_step=2 on batches of 8 against one pass on batches of 16
ACCUMULATED = {"plain": {}, "clip": dict(clip=1.0),
               "threshold": dict(threshold=dict(threshold=0.3, max_skip=3))}


def accumulated() -> dict:
    """Each case: 2 passes of 8 averaged (``average_aggregated_gradients``), 2 passes summed
    (Horovod's default) at half the learning rate, one pass of 16; the weights and iteration
    counts."""
    import keras

    import hvdsync.keras as hvd
    hvd.init()
    x, y = _data("mlp", hvd.rank())
    out = {}
    for name, keywords in ACCUMULATED.items():
        runs = []
        for lr, passes, average, batch in ((0.1, 2, True, 8), (0.05, 2, False, 8),
                                           (0.1, 1, False, 16)):
            model = _model("mlp")
            opt = hvd.DistributedOptimizer(
                keras.optimizers.SGD(lr, momentum=0.9), backward_passes_per_step=passes,
                average_aggregated_gradients=average, **keywords)
            model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
            model.fit(x, y, epochs=3, batch_size=batch, shuffle=False, verbose=0,
                      callbacks=[hvd.callbacks.FlushCallback()])
            runs.append((_weights(model), int(opt.iterations.numpy())))
        out[name] = runs
    return out


def test_backward_passes_per_step_equals_a_batch_that_many_times_larger():
    ranks = run_ranks(accumulated, 2, timeout=300, **TORCHRUN)
    for name in ACCUMULATED:
        assert np.array_equal(ranks[0][name][0][0], ranks[1][name][0][0]), name
        (averaged, n2), (summed, _), (larger, n1) = ranks[0][name]
        assert (n2, n1) == (12, 6), name  # every batch counted, as Keras counts them
        np.testing.assert_allclose(averaged, larger, rtol=0, atol=1e-6, err_msg=name)
        if name == "plain":  # (a sum is twice the mean: clip and threshold see it so)
            np.testing.assert_allclose(summed, larger, rtol=0, atol=1e-6, err_msg=name)


def dies_mid_fit() -> None:
    import keras

    import hvdsync.keras as hvd
    hvd.init()

    class Die(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if hvd.rank() == 1 and batch == 2:
                os._exit(3)
    model = _model("mlp")
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data("mlp", hvd.rank(), n=400)
    model.fit(x, y, epochs=5, batch_size=8, verbose=0, callbacks=[Die()])


def test_each_technique_equals_hvdsync_torch_on_the_same_model(ranks):
    """Keras' SGD with momentum and torch's agree in exact arithmetic; in float32 to ~1e-7."""
    for name in (n for n in AS_TORCH if n in ranks[0]):
        for r in ranks:
            np.testing.assert_allclose(r[name][0], r[f"{name}_torch"], rtol=0, atol=1e-6,
                                       err_msg=name)


def test_a_rank_that_dies_mid_fit_ends_the_job_with_a_message():
    with pytest.raises(RanksFailed) as failed:
        run_ranks(dies_mid_fit, 2, timeout=240, **TORCHRUN)
    text = str(failed.value)  # (torchrun takes the job down; rank 0 may say why first)
    assert "(hang?)" not in text and re.search(r"exitcode\s*:\s*3", text), text[-3000:]


HIDE = "import sys\nfor m in ('horovod', 'tensorflow'):\n    sys.modules[m] = None\n"
TORCH = {"KERAS_BACKEND": "torch"}


@pytest.mark.parametrize("env, code, message", [
    ({"KERAS_BACKEND": "jax"}, "import hvdsync.keras",
     "Set KERAS_BACKEND=torch and launch with torchrun"),
    (TORCH, "import numpy as np, keras, hvdsync.keras as hvd; hvd.init()\n"
            "m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])\n"
            "m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD()), loss='mse',"
            " jit_compile=True)\n"
            "m.fit(np.zeros((4, 4)), np.zeros((4, 2)), verbose=0)",
     "pass jit_compile=False to model.compile()"),
    (TORCH, "import keras, hvdsync.keras as hvd; hvd.init()\n"
            "hvd.DistributedOptimizer(keras.optimizers.SGD(), clip=dict(max_nrm=1))",
     "did you mean 'max_norm'"),
    (TORCH, "import keras, hvdsync.keras as hvd; hvd.init()\n"
            "hvd.DistributedOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2))",
     "use backward_passes_per_step instead"),
    (TORCH, "import keras, hvdsync.keras as hvd; hvd.init()\n"
            "hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()"
            "), backward_passes_per_step=2)",
     "use a larger batch, or the TensorFlow backend"),
    ({**TORCH, "OMPI_COMM_WORLD_SIZE": "2"}, "import hvdsync.keras as hvd; hvd.init()",
     "launch with torchrun"),  # started by mpirun as one of 2, not by torchrun
    (TORCH, "import hvdsync.keras as hvd; hvd.elastic.KerasState",
     "needs Horovod (scripts/install_horovod.sh) and horovodrun; without them, use torchrun"),
], ids=["jax", "jit_compile", "config_typo", "accumulation", "scaled_accumulation",
        "mpirun", "elastic_without_horovod"])
def test_a_bad_setup_is_refused_with_the_fix(env, code, message):
    run = subprocess.run([sys.executable, "-c", HIDE + code], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]
