"""Shared pieces of the Keras tests: a small model on planted-teacher data (different data on
every rank), a rank body that trains through ``model.fit`` and records what the tests check."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

#: rank counts of the Keras adapter's matrices: real ranks are the only way to run Keras, and a
#: 3-rank job of TensorFlow processes on this 2-core machine costs minutes. 3 ranks stay where
#: the rank count is the point -- the flush matrix (every technique and pair), Horovod parity,
#: the callbacks -- and the core's 3-rank logic runs on simulated ranks (docs/testing.md)
KERAS_NP = [2]
KERAS_NP_IDS = [f"np{n}" for n in KERAS_NP]

IN, HIDDEN, CLASSES = 12, 16, 4


def key(v) -> str:
    """A variable's name without the model's auto-numbered prefix (``fc1/kernel``)."""
    return "/".join(v.path.split("/")[-2:])


def one_tensorflow_thread() -> None:
    """On a rank, before TensorFlow runs anything: one intra-op thread (ranks share the
    cores; and TensorFlow refuses a change once it has started)."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)


def one_thread() -> None:
    """On a rank, before the Keras backend runs anything: one intra-op thread."""
    import keras
    if keras.backend.backend() == "torch":
        import torch
        torch.set_num_threads(1)
    else:
        one_tensorflow_thread()


def teacher_data(rank: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` samples labelled by a fixed random linear teacher; rank-specific inputs."""
    teacher = np.random.default_rng(seed).standard_normal((IN, CLASSES))
    x = np.random.default_rng(1000 + rank).standard_normal((n, IN)).astype("float32")
    return x, np.argmax(x @ teacher, axis=1).astype("int32")


def token_data(rank: int, n: int, vocab: int = 40, length: int = 6):
    """Bags of token ids (a Zipf-ish skew) labelled by whether a planted token set appears."""
    rng = np.random.default_rng(2000 + rank)
    p = 1.0 / np.arange(1, vocab + 1)
    ids = rng.choice(vocab, size=(n, length), p=p / p.sum()).astype("int32")
    y = (np.isin(ids, [3, 7, 11, 19]).sum(axis=1) >= 1).astype("int32")
    return ids, y


def mlp(seed: int = 0, dtype: "str | None" = "float32"):
    """Three named Dense layers (fc1, fc2, out); the same initial weights for the same seed."""
    import keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((IN,), dtype=dtype),
        keras.layers.Dense(HIDDEN, activation="tanh", name="fc1", dtype=dtype),
        keras.layers.Dense(HIDDEN, activation="tanh", name="fc2", dtype=dtype),
        keras.layers.Dense(CLASSES, name="out", dtype=dtype),
    ])


def embedding_model(seed: int = 0, vocab: int = 40, hidden: bool = False,
                    dtype: str = "float32"):
    """An Embedding (IndexedSlices gradient) averaged over the bag, then a Dense head (with
    ``hidden``: a Dense ``fc`` layer before it, so a decider has two dense layers)."""
    import keras
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6,), dtype="int32")
    e = keras.layers.Embedding(vocab, 8, name="emb", dtype=dtype)(inp)
    x = keras.layers.GlobalAveragePooling1D(dtype=dtype)(e)
    if hidden:
        x = keras.layers.Dense(8, activation="tanh", name="fc", dtype=dtype)(x)
    out = keras.layers.Dense(2, name="head", dtype=dtype)(x)
    return keras.Model(inp, out)


def make_optimizer(name: str, lr: float):
    import keras
    return {"sgd": lambda: keras.optimizers.SGD(lr),
            "momentum": lambda: keras.optimizers.SGD(lr, momentum=0.9),
            # exact in float32, the precision Keras casts a momentum through
            "momentum_exact": lambda: keras.optimizers.SGD(lr, momentum=0.875),
            "adam": lambda: keras.optimizers.Adam(lr)}[name]()


class Recorder:
    """A Keras callback (built lazily: keras is imported in the rank) recording, per batch,
    the model's weights and the optimizer's last step stats."""

    @staticmethod
    def make(record_weights: bool = True):
        import keras

        class _Recorder(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.weights, self.steps, self.logs, self.sent, self.lr = [], [], [], [], []
                self._sent_before = {}

            def on_train_batch_end(self, batch, logs=None):
                opt = _hvdsync(self.model.optimizer)
                self.lr.append(float(keras.ops.convert_to_numpy(opt.learning_rate)))
                now = {n: c.sent for n, c in opt.stats.layers.items()}
                self.sent.append([n for n in now if now[n] > self._sent_before.get(n, 0)])
                self._sent_before = now
                if record_weights:
                    self.weights.append({key(v): np.array(v.numpy()) for v in
                                         self.model.trainable_variables})
                self.steps.append(opt.stats.last.as_dict())
                self.logs.append(dict(logs or {}))
        return _Recorder()


def build_for_fit(model, x, y) -> None:
    """Build the compiled loss and metrics on one batch, eagerly, before ``fit``: Keras builds
    them (as it does an unbuilt optimizer) while it traces the train function, and TensorFlow
    traces a function that created variables a second time. ``fit`` resets metric state at
    every epoch, so the results are the same; each fit traces once (a Keras job's main cost)."""
    y_pred = model(x)
    model.compute_loss(x, y, y_pred)
    model.compute_metrics(x, y, y_pred, sample_weight=None)


def _leaves_the_policy_as_found(body: Callable[..., Any]) -> Callable[..., Any]:
    """Restore Keras' global dtype policy after ``body``: the shared rank job
    (tests/conftest.py) runs many bodies in one process, and a mixed-precision case must not
    change the models of the cases after it."""
    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> Any:
        import keras
        before = keras.mixed_precision.global_policy()
        try:
            return body(*args, **kwargs)
        finally:
            keras.mixed_precision.set_global_policy(before)
    return run


@_leaves_the_policy_as_found
def fit_body(options: dict, opt_name: str = "sgd", lr: float = 0.1, steps: int = 10,
             batch: int = 16, model: str = "mlp", dtype: str = "float32",
             record_weights: bool = True, callbacks: tuple = ("broadcast",),
             epochs: int = 1, validation: bool = False, save_to: Optional[str] = None,
             vocab: int = 40, seed_by_rank: bool = False, warmup: Optional[dict] = None,
             reference: bool = False, data_rank: Optional[int] = None,
             slow_rank: Optional[int] = None, evaluate: bool = False,
             horovod_peer: bool = False, nan_rank: Optional[int] = None,
             loss_scale: Optional[float] = None, mixed: bool = False) -> dict[str, Any]:
    """Train on this rank's data through ``model.fit`` with hvdsync's optimizer."""
    import keras
    import hvdsync.keras as hvd
    hvd.init()
    one_tensorflow_thread()
    # mixed: a mixed_float16 model (Keras wraps the optimizer in its LossScaleOptimizer)
    keras.mixed_precision.set_global_policy("mixed_float16" if mixed else "float32")
    if model == "mlp":
        m = mlp(seed=hvd.rank() if seed_by_rank else 0, dtype=dtype)
        x, y = teacher_data(hvd.rank() if data_rank is None else data_rank, steps * batch)
    else:
        m = embedding_model(vocab=vocab, hidden=model == "emb_mlp", dtype=dtype)
        x, y = token_data(hvd.rank() if data_rank is None else data_rank, steps * batch,
                          vocab=vocab)
    if nan_rank is not None and hvd.rank() == nan_rank:
        x = x.copy()
        x[batch + 1, 0] = np.nan  # the second batch's gradient on this rank is NaN
    if horovod_peer:  # Horovod's own path: DistributedGradientTape, plain optimizer
        from benchmarks.keras_peers import horovod_tape_model
        m = horovod_tape_model(m)
        opt = make_optimizer(opt_name, lr)
    else:
        base = make_optimizer(opt_name, lr)
        if loss_scale is not None:  # wrapping a LossScaleOptimizer (never grows here)
            base = keras.optimizers.LossScaleOptimizer(base, initial_scale=loss_scale,
                                                       dynamic_growth_steps=10 ** 6)
        opt = hvd.DistributedOptimizer(base, **options)
    # the loss in the model's dtype (Keras computes a loss in float32 unless told)
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, dtype=dtype), metrics=["accuracy"])
    rec = Recorder.make(record_weights and not horovod_peer)
    cbs = [rec]
    if "broadcast" in callbacks:
        cbs.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))
    if "metric_average" in callbacks:
        cbs.append(hvd.callbacks.MetricAverageCallback())
    if "stats" in callbacks:
        cbs.append(hvd.callbacks.SyncStatsCallback())
    if "flush" in callbacks:
        cbs.append(hvd.callbacks.FlushCallback())
    if slow_rank is not None and hvd.rank() == slow_rank:
        cbs.append(keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda *_, **__: __import__("time").sleep(0.03)))
    if warmup is not None:
        cbs.append(hvd.callbacks.LearningRateWarmupCallback(**warmup))
    build_for_fit(m, x[:batch], y[:batch])
    init = {key(v): np.array(v.numpy()) for v in m.trainable_variables}
    if horovod_peer:
        cbs = [c for c in cbs if c is not rec]
    hist = m.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=cbs,
                 validation_data=(x[:64], y[:64]) if validation else None)
    if horovod_peer:
        return dict(final={key(v): np.array(v.numpy()) for v in m.trainable_variables})
    out = dict(weights=rec.weights, steps=rec.steps, logs=rec.logs, history=hist.history,
               stats=_hvdsync(opt).stats.as_dict(),
               iterations=int(m.optimizer.iterations.numpy()),
               scale=(float(m.optimizer.dynamic_scale.numpy())
                      if hasattr(m.optimizer, "dynamic_scale") else None),
               layers=[layer.name.split("/")[-1] for layer in _hvdsync(opt).layers],
               final={key(v): np.array(v.numpy()) for v in m.trainable_variables},
               rank=hvd.rank(), size=hvd.size(), selection=_hvdsync(opt).selection,
               delay=_hvdsync(opt).delay_status, routes=_hvdsync(opt).sparse_routes,
               # weights after the broadcast = the common start
               start=init, sent=rec.sent, lr=rec.lr,
               opt_vars={v.name: np.array(v.numpy()) for v in opt.variables
                         if v.name not in ("iteration", "learning_rate")})
    if evaluate:
        xt, yt = (teacher_data(99, 1024) if model == "mlp" else token_data(99, 1024, vocab=vocab))
        out["test_accuracy"] = float(m.evaluate(xt, yt, verbose=0, return_dict=True)["accuracy"])
    if save_to is not None and hvd.rank() == 0:
        m.save(save_to)
    if reference:
        passes = options.get("backward_passes_per_step", 1)
        ref = emulate(hvd.size(), opt_name, lr, steps * epochs // passes, batch, model=model,
                      dtype=dtype,
                      vocab=vocab, clip=options.get("clip"), op=options.get("op"),
                      data_rank=data_rank,
                      passes=passes,
                      average_passes=options.get("average_aggregated_gradients", False))
        out["reference"] = ref
        out["max_diff"] = max(float(np.abs(out["final"][k] - ref[k]).max()) for k in ref)
    return out


def _hvdsync(opt):
    """The hvdsync optimizer, also inside a LossScaleOptimizer."""
    return getattr(opt, "inner_optimizer", opt)


def emulate(size: int, opt_name: str, lr: float, steps: int, batch: int, model: str = "mlp",
            dtype: str = "float32", vocab: int = 40, clip: Optional[dict] = None,
            op: Any = None, passes: int = 1, average_passes: bool = False,
            data_rank: Optional[int] = None) -> dict:
    """Plain averaged-gradient training in one process, with a plain Keras optimizer: every
    rank's batch gradient computed at the same weights (clipped per layer first with ``clip``
    ``max_norm``/``value``), averaged (summed with ``op=Sum``), applied -- the reference the
    distributed runs must equal."""
    import keras
    import tensorflow as tf
    import horovod.tensorflow as htf
    m = (mlp(dtype=dtype) if model == "mlp"
         else embedding_model(vocab=vocab, hidden=model == "emb_mlp", dtype=dtype))
    opt = make_optimizer(opt_name, lr)
    n = steps * batch * passes
    data = [teacher_data(r, n) if model == "mlp" else token_data(r, n, vocab=vocab)
            for r in (range(size) if data_rank is None else [data_rank] * size)]
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype=dtype)
    variables = m.trainable_variables
    layer_of = [v.path.rsplit("/", 1)[0] for v in variables]
    for s in range(steps):
        total = None
        for r in range(size):
            local = None
            for k in range(passes):
                lo = (s * passes + k) * batch
                x, y = data[r][0][lo:lo + batch], data[r][1][lo:lo + batch]
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, m(x))
                g = [tf.convert_to_tensor(t) for t in tape.gradient(loss, variables)]
                local = g if local is None else [a + b for a, b in zip(local, g)]
            if passes > 1 and average_passes:
                local = [t / passes for t in local]
            if clip and clip.get("mode", "local") == "local":
                local = _clip_layers(local, layer_of, clip)
            total = local if total is None else [a + b for a, b in zip(total, local)]
        if op is not htf.Sum:
            total = [t / size for t in total]
        if clip and clip.get("mode") == "global":
            total = _clip_layers(total, layer_of, clip)
        opt.apply(total, variables)
    return {key(v): np.array(v.numpy()) for v in variables}


def _clip_layers(grads: list, layer_of: list, clip: dict) -> list:
    import tensorflow as tf
    if "value" in clip:
        grads = [tf.clip_by_value(g, *clip["value"]) for g in grads]
    if "max_norm" in clip:
        for layer in dict.fromkeys(layer_of):
            idx = [i for i, n in enumerate(layer_of) if n == layer]
            norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(grads[i])) for i in idx]))
            scale = tf.minimum(tf.cast(clip["max_norm"], norm.dtype) / norm, 1.0)
            for i in idx:
                grads[i] = grads[i] * scale
    return grads
