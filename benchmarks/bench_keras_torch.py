"""hvdsync.keras on Keras' torch backend (``KERAS_BACKEND=torch``) against the peers it has
there, through ``model.fit``, on an emulated slow link: time per step, bytes, time to target.

    .venv/bin/python -m benchmarks.bench_keras_torch [--models mlp lm] [--net 100]
        [--seeds 3] [--steps 150]

Keras 3 has no data parallelism of its own on the torch backend (``keras.distribution`` is
JAX's), so the peers are torch's: **DDP** on the same model (a Keras model on the torch backend
is a ``torch.nn.Module``) in a plain torch loop, and **Keras fit with an averaged gradient**
(one ``torch.distributed`` allreduce per variable before Keras' update: the floor of an
exchange inside ``fit``, which ``hvdsync, nothing on`` should match). Models: the Keras
benches' 6-layer MLP on a planted teacher (Adam), and a GPT-style byte LM the size of the
suite's (4 blocks, width 128, context 128; AdamW) on the standard library's sources. Each
rank on one core; every method and seed in one job, from the same weights; 3 seeds; the
slowest rank's training time in one ``fit`` (a callback scores every ``--every`` steps, off
the clock). Time to target: until the mean held-out
score first reaches the weaker final score of the two full exchanges (accuracy less a point,
loss plus 0.02): DDP runs torch's Adam(W), the others Keras' own, which differ slightly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.common import markdown_table, report, shows_progress
from benchmarks.network import IFACE, EmulatedNetwork, namespaces_unavailable, run_ranks_on
from hvdsync.testing import progress

METHODS = {
    "DDP (torch loop, same model)": "ddp",
    "Keras fit, averaged gradient": "averaged",
    "hvdsync, nothing on": {},
    "hvdsync, nothing on, group_mb=1": dict(group_mb=1),  # (every ready group 1 MiB)
    "hvdsync fp16": dict(compression="fp16"),
    "hvdsync delay=\"streaming\"": dict(delay="streaming"),
}
PORT = 29547
TOLERANCE = {"accuracy": 0.01, "loss": 0.02}
CONTEXT, LM_DIM, LM_HEADS, LM_LAYERS = 128, 128, 4, 4


def _mlp():
    from benchmarks.bench_keras import mlp
    return mlp(256, 6)


def _lm():
    """A byte-level GPT-style decoder in Keras: token and position embeddings, pre-norm blocks
    of causal self-attention and an MLP, a head over 256 bytes."""
    import keras
    from keras import layers

    class Positions(layers.Layer):
        def build(self, shape):
            self.table = self.add_weight(shape=(CONTEXT, LM_DIM), initializer="random_normal")

        def call(self, h):
            return h + self.table[None, : h.shape[1]]

    x = keras.Input((CONTEXT,), dtype="int32")
    h = Positions(name="pos")(layers.Embedding(256, LM_DIM, name="tok")(x))
    for i in range(LM_LAYERS):
        a = layers.LayerNormalization(name=f"ln_a{i}")(h)
        h = h + layers.MultiHeadAttention(LM_HEADS, LM_DIM // LM_HEADS, name=f"attn{i}")(
            a, a, use_causal_mask=True)
        m = layers.LayerNormalization(name=f"ln_m{i}")(h)
        m = layers.Dense(4 * LM_DIM, activation="gelu", name=f"up{i}")(m)
        h = h + layers.Dense(LM_DIM, name=f"down{i}")(m)
    out = layers.Dense(256, name="head")(layers.LayerNormalization(name="ln_f")(h))
    return keras.Model(x, out)


def _data(model: str, rank: int, seed: int, n: int):
    """(train x, train y, held-out x, held-out y) for this rank: its own stream."""
    import numpy as np
    if model == "lm":
        from benchmarks.workloads import _corpus
        data = _corpus().numpy()
        train, held = data[: int(len(data) * 0.95)], data[int(len(data) * 0.95):]
        g = np.random.default_rng(seed * 1000 + rank)
        starts = g.integers(0, len(train) - CONTEXT - 1, n)
        w = train[starts[:, None] + np.arange(CONTEXT + 1)]
        hs = np.random.default_rng(10**6).integers(0, len(held) - CONTEXT - 1, 64)
        hw = held[hs[:, None] + np.arange(CONTEXT + 1)]
        return w[:, :-1], w[:, 1:], hw[:, :-1], hw[:, 1:]
    from benchmarks.bench_keras import CLASSES, FEATURES
    teacher = np.random.default_rng(0).standard_normal((FEATURES, CLASSES))
    x = np.random.default_rng(100 + 10 * seed + rank).standard_normal((n, FEATURES))
    xt = np.random.default_rng(99).standard_normal((2048, FEATURES))
    return (x.astype("float32"), np.argmax(x @ teacher, 1), xt.astype("float32"),
            np.argmax(xt @ teacher, 1))


def _optimizer(model: str):
    import keras
    if model == "lm":
        return keras.optimizers.AdamW(1e-3, weight_decay=0.01)
    return keras.optimizers.Adam(1e-3)


def _score(model, kind: str, xt, yt) -> float:
    """Held-out accuracy, or minus the validation loss (higher is better)."""
    import keras
    import numpy as np
    import torch
    with torch.no_grad():
        logits = model(xt, training=False)
        if kind == "lm":
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(yt, logits)
            return -float(loss)
        return float(np.mean(np.argmax(keras.ops.convert_to_numpy(logits), 1) == yt))


def _averaged(model: str):
    """Keras' own optimizer with every gradient averaged over the ranks before its update."""
    import torch.distributed as dist
    base = type(_optimizer(model))

    class Averaged(base):
        def apply(self, grads, trainable_variables=None):
            for g in grads:
                dist.all_reduce(g)
                g.div_(dist.get_world_size())
            return super().apply(grads, trainable_variables)
    return Averaged.from_config(_optimizer(model).get_config())


def _run(kind: str, method: str, seed: int, steps: int, batch: int, every: int) -> dict:
    """One method, one seed on this rank: training seconds, bytes a step, held-out scores."""
    import keras
    import torch

    import hvdsync.keras as hvd
    keras.utils.set_random_seed(seed)
    model = _mlp() if kind == "mlp" else _lm()
    x, y, xt, yt = _data(kind, hvd.rank(), seed, (steps + 5) * batch)
    spec = METHODS[method]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    points, trained = [], 0.0
    if spec == "ddp":
        return _ddp_loop(model, kind, x, y, xt, yt, steps, batch, every)
    opt = (_averaged(kind) if spec == "averaged" else hvd.DistributedOptimizer(
        _optimizer(kind), **{k: (hvd.Compression.fp16 if v == "fp16" else v)
                             for k, v in spec.items()}))
    model.compile(optimizer=opt, loss=loss)
    model.fit(x[:5 * batch], y[:5 * batch], batch_size=batch, verbose=0)  # warm-up
    sent = opt.stats.total.bytes_sent if hasattr(opt, "stats") else 0

    class Clock(keras.callbacks.Callback):
        """The training seconds, and every ``every`` steps a held-out score (not timed)."""

        def on_train_begin(self, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch_, logs=None):
            nonlocal trained
            if (batch_ + 1) % every == 0:
                trained += time.perf_counter() - self.t
                points.append((trained, _score(model, kind, xt, yt)))
                self.t = time.perf_counter()
    # one fit, as a user trains (a fit per score would time its setup each time too)
    model.fit(x[5 * batch:], y[5 * batch:], batch_size=batch, verbose=0, shuffle=False,
              callbacks=[Clock()])
    if hasattr(opt, "flush"):
        opt.flush()
    nbytes = ((opt.stats.total.bytes_sent - sent) / steps if hasattr(opt, "stats")
              else sum(int(torch.numel(v.value)) * 4 for v in model.trainable_variables))
    return dict(step_s=trained / steps, bytes=nbytes, curve=points,
                final=_score(model, kind, xt, yt))


def _ddp_loop(model, kind, x, y, xt, yt, steps: int, batch: int, every: int) -> dict:
    """DDP on the Keras model's torch parameters, torch's Adam(W) with Keras' settings."""
    import keras
    import torch
    from torch import nn
    model.build((None,) + tuple(x.shape[1:]))
    params = [v.value for v in model.trainable_variables]
    opt = (torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01) if kind == "lm"
           else torch.optim.Adam(params, lr=1e-3))
    net = nn.parallel.DistributedDataParallel(model)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    points, trained = [], 0.0

    def step(i: int) -> None:
        opt.zero_grad()
        lo = i * batch
        loss_fn(torch.as_tensor(y[lo:lo + batch]),
                net(torch.as_tensor(x[lo:lo + batch]))).backward()
        opt.step()
    for i in range(5):
        step(i)
    for start in range(0, steps, every):
        progress.step(start, steps, f"{method}, seed {seed}")
        t = time.perf_counter()
        for i in range(start, start + every):
            step(5 + i)
        trained += time.perf_counter() - t
        points.append((trained, _score(model, kind, xt, yt)))
    nbytes = sum(p.numel() * 4 for p in params)
    return dict(step_s=trained / steps, bytes=nbytes, curve=points,
                final=_score(model, kind, xt, yt))


def body(kind: str, methods: list[str], seeds: list[int], steps: int, batch: int, every: int,
         addr: str, iface: str) -> dict:
    """On each rank (one core): torch.distributed on the emulated link, hvdsync's torch
    engine on it, every (seed, method) in turn."""
    os.environ["KERAS_BACKEND"] = "torch"
    os.environ["GLOO_SOCKET_IFNAME"] = iface
    import torch
    import torch.distributed as dist

    import hvdsync.keras as hvd
    rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{PORT}", rank=rank,
                            world_size=size)
    hvd.init(backend="torch")
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    return {m: [_run(kind, m, s, steps, batch, every) for s in seeds] for m in methods}


def time_to_target(curves: list[list[tuple[float, float]]], target: float) -> float | None:
    """The slowest rank's training seconds when the ranks' mean score first reaches
    ``target`` (``None``: never)."""
    for points in zip(*curves):
        if sum(s for _, s in points) / len(points) >= target:
            return max(t for t, _ in points)
    return None


def _cell(per_rank: list[dict], methods: list[str], kind: str) -> dict:
    """Per method: per seed the slowest rank's step time, bytes, final score, time to target:
    the weaker final score of the two full exchanges (DDP, torch's optimizer; Keras fit with
    an averaged gradient, Keras' own) of the same seed, less the tolerance."""
    seeds = len(per_rank[0][methods[0]])
    metric = "loss" if kind == "lm" else "accuracy"
    full = [m for m in methods if not isinstance(METHODS[m], dict)]
    out: dict = {}
    for m in methods:
        runs = []
        for s in range(seeds):
            target = min(statistics.mean(r[f][s]["final"] for r in per_rank) for f in full)
            curves = [r[m][s]["curve"] for r in per_rank]
            runs.append(dict(step_s=max(r[m][s]["step_s"] for r in per_rank),
                             bytes=per_rank[0][m][s]["bytes"],
                             final=statistics.mean(r[m][s]["final"] for r in per_rank),
                             ttt=time_to_target(curves, target - TOLERANCE[metric])))
        out[m] = runs
    return out


def _spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:.2f} ± {statistics.stdev(values):.2f}" if len(values) > 1 else f"{mean:.2f}"


def rows_of(label: str, kind: str, cell: dict, methods: list[str]) -> list[list]:
    base = cell[methods[0]]
    rows = []
    for m in methods:
        runs = cell[m]
        step = [r["step_s"] / b["step_s"] for r, b in zip(runs, base)]
        ttt = [r["ttt"] / b["ttt"] for r, b in zip(runs, base)
               if r["ttt"] is not None and b["ttt"]]
        final = [(-r["final"] if kind == "lm" else 100 * r["final"]) for r in runs]
        rows.append([label, kind, m, f"{1e3 * statistics.mean(r['step_s'] for r in runs):.1f}",
                     _spread(step), f"{runs[0]['bytes'] / base[0]['bytes']:.3f}",
                     _spread(final), _spread(ttt) if len(ttt) == len(runs) else
                     f"{len(ttt)}/{len(runs)} seeds reached"])
    return rows


HEADERS = ["network", "model", "method", "ms/step", "step vs DDP", "bytes vs DDP",
           "final (accuracy % / val. loss)", "time to target, vs DDP"]


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "lm"], choices=["mlp", "lm"])
    ap.add_argument("--net", type=float, default=100.0, help="link rate, Mbit/s")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=15, help="steps between held-out scores")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS),
                    default=[m for m in METHODS if "group_mb" not in m])
    ap.add_argument("--name", default="keras_torch_np2_100mbit")
    args = ap.parse_args(argv)
    if reason := namespaces_unavailable():
        raise SystemExit(f"needs emulated links: {reason}")
    methods = [m for m in METHODS if m in args.methods]
    rows, data = [], {}
    for kind in args.models:
        progress.cell(f"{kind}, 2 ranks, {args.net:g} Mbit/s")
        batch = 4 if kind == "lm" else 128
        with EmulatedNetwork(2, rate_mbit=args.net) as net:
            call = (kind, methods, list(range(args.seeds)), args.steps, batch, args.every,
                    net.addresses[0], IFACE)
            cell = _cell(run_ranks_on(net, body, 2, args=call, timeout=7200), methods, kind)
            label = net.describe()
        data[kind] = cell
        rows += rows_of(label, kind, cell, methods)
        print(markdown_table(HEADERS, rows), flush=True)
    report(args.name, f"hvdsync.keras on Keras' torch backend vs DDP, 2 ranks, {args.steps} "
           f"steps, {args.seeds} seeds", markdown_table(HEADERS, rows),
           dict(steps=args.steps, seeds=args.seeds, cells=data), "benchmarks.bench_keras_torch",
           argv)


if __name__ == "__main__":
    main()
