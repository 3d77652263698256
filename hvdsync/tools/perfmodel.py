"""A performance model of data-parallel training with each technique: time and bytes per step
from the model's sizes, its compute per step, the ranks and the network.

Per step, on every rank::

    step = compute + exposed communication + collectives x overhead + layers x hook cost
           + the technique's own compute (compression, casts, norms)

Collectives cost what the standard ring, tree and hierarchical algorithms cost on the links
given; exchanges started in backward hide behind part of it. :func:`predict` answers for one
technique, :func:`predict_all` for every one, on :class:`ModelSizes` and :class:`Cluster`;
the :class:`Constants` were fitted on the bench bed (``python -m benchmarks.bench_perfmodel``).
Accuracy is not modelled. docs/at-scale.md, "The model", has each term.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Optional


@dataclass(frozen=True)
class LayerSize:
    """One layer as the model sees it: its parameter count, the shapes of its weight matrices
    (what ``lowrank=`` compresses), and for an embedding the rows one rank's batch touches."""
    name: str
    params: int
    matrices: tuple[tuple[int, int], ...] = ()
    #: an embedding: rows touched per step by one rank, and the row width (``sparse=``)
    rows_touched: int = 0
    row_width: int = 0
    tensors: int = 1


#: the adapters the model knows the costs of (:attr:`ModelSizes.adapter`)
ADAPTERS = ("torch", "keras")


@dataclass(frozen=True)
class ModelSizes:
    """The model: its layers, bytes per gradient value, and its compute per step on one rank
    (seconds: forward, backward, optimizer), measured (``advise --measure``) or given."""
    layers: tuple[LayerSize, ...]
    forward_s: float
    backward_s: float
    optimizer_s: float = 0.0
    value_bytes: int = 4
    #: the adapter that trains it: ``"torch"`` or ``"keras"`` (a decider runs on the host in
    #: torch, compiled into the train function in Keras: different costs)
    adapter: str = "torch"

    def __post_init__(self):
        if self.adapter not in ADAPTERS:
            raise ValueError(f"adapter must be one of {ADAPTERS}, got {self.adapter!r}")

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def tensors(self) -> int:
        return sum(layer.tensors for layer in self.layers)


@dataclass(frozen=True)
class Cluster:
    """The ranks and the network. ``bandwidth_gbit``/``latency_us``: each rank's link between
    nodes (one NIC per rank; a node's NIC shared by its ranks: give its bandwidth divided by
    ``ranks_per_node``); ``intra_*``: between ranks of one node (NVLink, PCIe, shared
    memory). ``algorithm``: ``"ring"``, ``"tree"`` or ``"auto"`` (the faster for each
    collective, as NCCL chooses)."""
    ranks: int
    bandwidth_gbit: float
    latency_us: float = 20.0
    ranks_per_node: int = 1
    intra_bandwidth_gbit: float = 600.0
    intra_latency_us: float = 5.0
    algorithm: str = "auto"

    def __post_init__(self):
        if self.ranks < 1 or self.ranks_per_node < 1 or self.ranks % self.ranks_per_node:
            raise ValueError(f"ranks ({self.ranks}) must be a positive multiple of "
                             f"ranks_per_node ({self.ranks_per_node})")
        if self.bandwidth_gbit <= 0 or self.intra_bandwidth_gbit <= 0:
            raise ValueError("bandwidths must be positive")
        if self.algorithm not in ("ring", "tree", "auto"):
            raise ValueError(f"algorithm must be 'ring', 'tree' or 'auto', got "
                             f"{self.algorithm!r}")


@dataclass(frozen=True)
class Constants:
    """What the model cannot derive: fitted on the bench bed (docs/at-scale.md says on which
    cells, and how far off it is on the others). Times in seconds."""
    #: fraction of the nominal link rate a collective achieves, and the fastest a collective
    #: goes whatever the link (Gbit/s; the reduction's own speed: CPU Gloo on the bench bed;
    #: ``None``: the link is the limit)
    link_efficiency: float = 0.85
    max_gbit: Optional[float] = None
    #: fixed cost of one collective (launch, negotiation, the framework's queues)
    collective_s: float = 4.0e-4
    #: Horovod's tensor fusion: gradients ready together go in one collective of up to this
    #: many bytes (``None``: one collective per tensor, as Horovod ran on Gloo here)
    fusion_bytes: Optional[float] = None
    #: fraction of the backward pass an exchange started during it hides behind
    overlap: float = 0.5
    #: hvdsync's per-layer hook and bookkeeping cost per step
    layer_s: float = 1.5e-4
    #: per step: a decider's decisions and control round bookkeeping (threshold=, select=);
    #: delay='s background exchange and local steps; DDP's communication hook
    decider_s: float = 5.0e-4
    #: Keras' compiled decider instead (graph ops, one control allreduce, one host call):
    #: per step, and per parameter (the held tensor added, norms, the memory's selects)
    keras_decider_s: float = 5.0e-4
    keras_keep_s: float = 1.0e-9
    delay_s: float = 5.0e-4
    ddp_s: float = 5.0e-4
    #: per parameter: an fp16 cast there and back; a norm; an accumulation or residual update
    cast_s: float = 1.0e-9
    norm_s: float = 5.0e-10
    accumulate_s: float = 1.0e-9
    #: multiply-adds per second for lowrank='s products and orthogonalization, and a fixed
    #: cost per compressed matrix (its own small operations)
    flops: float = 2.0e9
    matrix_s: float = 2.0e-4
    #: the training loop's own cost per step beyond forward, backward and optimizer (the
    #: batch, the framework's step bookkeeping)
    step_s: float = 1.0e-3
    #: more ranks than cores on one machine (the bench bed: 2 cores): every step slows by
    #: ``1 + (oversubscribed - 1) (ranks / cores - 1)`` (compute and the collectives' own
    #: threads compete); ``cores=None``: one machine per rank (GPUs)
    cores: Optional[int] = None
    oversubscribed: float = 3.0


#: Fitted on the bench bed's committed cells (``python -m benchmarks.bench_perfmodel``,
#: 2026-11-26; docs/at-scale.md names the cells, the held-out ones and the errors): CPU ranks,
#: Gloo, emulated links. What fitted to nothing is 0 (a collective's fixed cost and the
#: per-layer hook vanish beside the rest there; lowrank='s products are negligible beside its
#: per-matrix cost). ``cores`` is the bed's own (2) only while fitting: one machine per rank.
#: Keras' compiled deciders: from the Keras overhead bench at two model widths
#: (``benchmarks.bench_perfmodel.keras_decider_costs``), not from the Keras cells.
CALIBRATED = Constants(link_efficiency=0.95, max_gbit=0.99, collective_s=0.0, overlap=1.0,
                       layer_s=0.0, decider_s=5.4e-3, keras_decider_s=5.9e-4,
                       keras_keep_s=5.3e-9, delay_s=1.8e-3, ddp_s=0.0, cast_s=1.9e-8,
                       norm_s=5e-10, accumulate_s=7.0e-8, flops=1e15, matrix_s=1.8e-3,
                       step_s=1.6e-3, oversubscribed=5.4)


@dataclass
class Prediction:
    """One technique's predicted step."""
    technique: str
    step_s: float
    bytes_per_step: float
    collectives: float
    compute_s: float
    exposed_comm_s: float
    memory_bytes: float
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("technique", "step_s", "bytes_per_step",
                                               "collectives", "compute_s", "exposed_comm_s",
                                               "memory_bytes", "notes")}


# -- collectives ------------------------------------------------------------------------------
def _bytes_per_s(gbit: float, c: Constants) -> float:
    rate = gbit * c.link_efficiency
    if c.max_gbit is not None:
        rate = min(rate, c.max_gbit)
    return rate * 1e9 / 8


def allreduce_s(nbytes: float, cluster: Cluster, c: Constants = CALIBRATED) -> float:
    """Seconds of one allreduce of ``nbytes`` (no fixed overhead)."""
    n, g = cluster.ranks, cluster.ranks_per_node
    if n == 1 or nbytes <= 0:
        return 0.0
    bw, lat = _bytes_per_s(cluster.bandwidth_gbit, c), cluster.latency_us * 1e-6
    ibw, ilat = _bytes_per_s(cluster.intra_bandwidth_gbit, c), cluster.intra_latency_us * 1e-6
    nodes = n // g

    def ring(size: int, b: float, bw_: float, lat_: float) -> float:
        return 0.0 if size == 1 else 2 * (size - 1) * (lat_ + b / size / bw_)

    def tree(size: int, b: float, bw_: float, lat_: float) -> float:
        return 0.0 if size == 1 else 2 * math.ceil(math.log2(size)) * lat_ + 2 * b / bw_

    algos = {"ring": [ring], "tree": [tree], "auto": [ring, tree]}[cluster.algorithm]
    inter = min(a(nodes, nbytes / g, bw, lat) for a in algos)
    if g == 1:
        return inter
    # reduce-scatter and allgather inside the node around one allreduce per local rank
    return ring(g, nbytes, ibw, ilat) + inter


def allgather_s(nbytes_per_rank: float, cluster: Cluster, c: Constants = CALIBRATED) -> float:
    """Seconds of one allgather of ``nbytes_per_rank`` from every rank (ring)."""
    n = cluster.ranks
    if n == 1 or nbytes_per_rank <= 0:
        return 0.0
    bw, lat = _bytes_per_s(cluster.bandwidth_gbit, c), cluster.latency_us * 1e-6
    return (n - 1) * (lat + nbytes_per_rank / bw)


# -- techniques -------------------------------------------------------------------------------
#: technique -> its settings, as the bench bed ran them (advise shows these)
TECHNIQUES: dict[str, dict[str, Any]] = {
    "horovod": {},
    "horovod fp16": {"fp16": True},
    "hvdsync": {"hvdsync": True},
    "hvdsync clip": {"hvdsync": True, "clip": True},
    "hvdsync threshold": {"hvdsync": True, "send_fraction": 0.55},
    "hvdsync select": {"hvdsync": True, "send_fraction": 0.5, "select": True},
    "hvdsync sparse": {"hvdsync": True, "sparse": True},
    "hvdsync lowrank": {"hvdsync": True, "lowrank": 2},
    "hvdsync delay": {"hvdsync": True, "staleness": 4, "average_every": 32},
    "hvdsync streaming": {"hvdsync": True, "outer": dict(average_every=8, fragments=4,
                                                         overlap=1, value_bytes=1)},
    "ddp+powersgd": {"powersgd": 2},
    "ddp post-local sgd": {"local_every": 32},
}


def predict(technique: str, model: ModelSizes, cluster: Cluster,
            c: Constants = CALIBRATED, **settings: Any) -> Prediction:
    """The predicted step of ``technique`` (a key of :data:`TECHNIQUES`; ``settings``
    override its defaults: ``send_fraction``, ``lowrank``, ``staleness``, ``fp16``...;
    ``warmup_share``: the share of a run's steps that went plain before compression or
    local steps began, for a per-step average over that run -- steady state without it)."""
    if technique not in TECHNIQUES:
        raise ValueError(f"unknown technique {technique!r}; known: {', '.join(TECHNIQUES)}")
    s = {**TECHNIQUES[technique], **settings}
    warmup = s.pop("warmup_share", 0.0)
    p = _predict(technique, s, model, cluster, c)
    compressed = ("lowrank", "powersgd", "local_every")
    if warmup and any(s.get(k) for k in compressed):
        # a run's first steps go plain (lowrank='s and PowerSGD's warm-up; post-local SGD's
        # synchronous start): over a run, a share of its steps costs what plain ones cost
        plain = _predict(technique, {k: v for k, v in s.items() if k not in compressed},
                         model, cluster, c)
        p = _blend(p, plain, warmup)
        p.notes.append(f"{warmup:.1%} of the steps plain (warm-up)")
    n = cluster.ranks
    if c.cores is not None and n > c.cores:
        slow = 1 + (c.oversubscribed - 1) * (n / c.cores - 1)
        p.step_s *= slow
        p.notes.append(f"{n} ranks on {c.cores} cores: x{slow:.1f}")
    return p


def _blend(p: Prediction, plain: Prediction, share: float) -> Prediction:
    """``p`` with ``share`` of its steps replaced by ``plain`` ones (averages per step)."""
    def mix(a: float, b: float) -> float:
        return (1 - share) * a + share * b
    return Prediction(p.technique, mix(p.step_s, plain.step_s),
                      mix(p.bytes_per_step, plain.bytes_per_step),
                      mix(p.collectives, plain.collectives), mix(p.compute_s, plain.compute_s),
                      mix(p.exposed_comm_s, plain.exposed_comm_s), p.memory_bytes, p.notes)


@dataclass
class _Step:
    """What one step adds up to while a technique's transports are walked."""
    comm: float = 0.0         # communication that can overlap the backward pass
    extra: float = 0.0        # the technique's own work
    nbytes: float = 0.0
    collectives: float = 0.0
    memory: float = 0.0


def _overheads(s: dict, model: ModelSizes, c: Constants) -> float:
    """The technique's own work per step that does not depend on the transport."""
    extra = c.cast_s * model.params if s.get("fp16") else 0.0
    if s.get("hvdsync"):
        extra += c.layer_s * len(model.layers)
    if "send_fraction" in s:
        extra += (c.keras_decider_s + c.keras_keep_s * model.params if model.adapter == "keras"
                  else c.decider_s + c.accumulate_s * model.params)
    if s.get("staleness") or s.get("outer"):
        extra += c.delay_s
    if s.get("staleness"):
        extra += c.accumulate_s * model.params  # the local contribution kept per step
    if s.get("powersgd") or s.get("local_every"):
        extra += c.ddp_s
    if s.get("clip"):
        extra += c.norm_s * model.params
    return extra


def _sparse_layer(layer: LayerSize, wire: float, vb: int, cluster: Cluster, c: Constants,
                  st: _Step) -> None:
    """Counts first, then the touched rows (values and their indices) from every rank."""
    rows = layer.rows_touched * (layer.row_width * vb * wire + 8)
    st.comm += allgather_s(8, cluster, c) + allgather_s(rows, cluster, c)
    st.nbytes += rows
    st.collectives += 2


def _lowrank_layer(layer: LayerSize, rank: int, wire: float, vb: int, cluster: Cluster,
                   c: Constants, st: _Step, fraction: float = 1.0) -> None:
    """Two rounds: P (with the layer's other parameters), then Q; the products and their
    orthogonalization; error feedback and Q kept. With a decider, the layer goes in
    ``fraction`` of the steps (compressed when it goes; its factors are computed only then,
    the decider keeps the rest: counted by the decider's own costs)."""
    rest = layer.params - sum(m * k for m, k in layer.matrices)
    p_bytes = (sum(rank * m for m, _ in layer.matrices) + rest) * vb * wire
    q_bytes = sum(rank * k for _, k in layer.matrices) * vb * wire
    st.comm += fraction * (allreduce_s(p_bytes, cluster, c) + allreduce_s(q_bytes, cluster, c))
    st.nbytes += fraction * (p_bytes + q_bytes)
    st.collectives += 2 * fraction
    st.extra += fraction * (sum(2 * m * k * rank + m * rank * rank for m, k in layer.matrices)
                            / c.flops + c.matrix_s * len(layer.matrices))
    st.memory += sum(m * k + rank * k for m, k in layer.matrices) * vb


def _dense_layer(layer: LayerSize, s: dict, wire: float, vb: int, cluster: Cluster,
                 c: Constants, st: _Step) -> None:
    """An allreduce (of the share a decider sends); hvdsync groups a layer's tensors into
    one collective, Horovod on Gloo sends one per tensor; a decider keeps what it holds back
    (threshold: accumulation and sync point; select: residual)."""
    fraction = s.get("send_fraction", 1.0)
    lb = layer.params * vb
    st.comm += fraction * allreduce_s(lb * wire, cluster, c)
    st.nbytes += fraction * lb * wire
    st.collectives += fraction * (1 if s.get("hvdsync") else layer.tensors)
    if "send_fraction" in s:
        st.memory += lb * (1 if s.get("select") else 2)


def _outer(technique: str, s: dict, model: ModelSizes, cluster: Cluster, c: Constants,
           compute: float, extra: float) -> Prediction:
    """Local steps; each of ``fragments`` fragments of the parameters is exchanged every
    ``average_every`` steps (``value_bytes`` per value) and has ``overlap`` x (K / fragments)
    steps to finish behind."""
    o = s["outer"]
    k, frags = o["average_every"], o["fragments"]
    frag_bytes = model.params * o["value_bytes"] / frags
    exchanges = frags / k  # per step
    per_exchange = allreduce_s(frag_bytes, cluster, c) + c.collective_s
    exposed = max(0.0, per_exchange - o["overlap"] * (k / frags) * compute) * exchanges
    # pseudo-gradients, quantization, the outer step: a few passes over a fragment
    extra += 3 * c.accumulate_s * model.params * exchanges / frags
    return Prediction(technique, compute + extra + exposed, frag_bytes * exchanges, exchanges,
                      compute, exposed, 3 * model.params * model.value_bytes)


def _predict(technique: str, s: dict, model: ModelSizes, cluster: Cluster,
             c: Constants) -> Prediction:
    vb = model.value_bytes
    dense_bytes = model.params * vb
    compute = model.compute_s + c.step_s
    extra = _overheads(s, model, c)
    if s.get("outer"):
        return _outer(technique, s, model, cluster, c, compute, extra)
    if s.get("local_every"):  # post-local SGD: the model averaged every so many steps
        every = s["local_every"]
        exposed = (allreduce_s(dense_bytes, cluster, c)
                   + c.collective_s * model.tensors) / every
        return Prediction(technique, compute + extra + exposed, dense_bytes / every,
                          model.tensors / every, compute, exposed, 0.0)
    st = _Step(extra=extra)
    wire = 0.5 if s.get("fp16") else 1.0
    rank = s.get("lowrank") or s.get("powersgd")
    for layer in model.layers:
        if s.get("sparse") and layer.rows_touched:
            _sparse_layer(layer, wire, vb, cluster, c, st)
        elif rank and layer.matrices:
            _lowrank_layer(layer, rank, wire, vb, cluster, c, st, s.get("send_fraction", 1.0))
        else:
            _dense_layer(layer, s, wire, vb, cluster, c, st)
    notes = []
    if s.get("powersgd"):
        st.collectives = 3.0  # DDP buckets the factors
    elif c.fusion_bytes and not s.get("hvdsync"):
        st.collectives = math.ceil(st.nbytes / c.fusion_bytes)  # Horovod's fusion buffer
    if "send_fraction" in s:
        st.collectives += 1  # the control round: a value per layer, in the gradients' precision
        st.comm += allreduce_s(max(4, vb) * len(model.layers), cluster, c)
        notes.append(f"sends {s['send_fraction']:.0%} of the layers' bytes (measured share)")
    fixed = st.collectives * c.collective_s
    if s.get("staleness"):
        # delay=: each step's exchange runs behind the next steps, but every step puts one on
        # the link: the link or the compute, whichever is slower, sets the pace (``staleness``
        # only says how far the exchanges may queue, not how many share the link at once);
        # the parameters are averaged every ``average_every`` steps
        every = s.get("average_every", 0)
        averaging = ((allreduce_s(dense_bytes, cluster, c) + c.collective_s * len(model.layers))
                     / every if every else 0.0)
        if every:
            st.nbytes += dense_bytes / every
            st.collectives += len(model.layers) / every
        st.memory += s["staleness"] * dense_bytes
        exposed = max(0.0, st.comm + fixed - (compute + st.extra)) + averaging
    else:
        exposed = max(st.comm - c.overlap * model.backward_s, 0.0) + fixed
    return Prediction(technique, compute + st.extra + exposed, st.nbytes, st.collectives,
                      compute, exposed, st.memory, notes)


def predict_all(model: ModelSizes, cluster: Cluster, c: Constants = CALIBRATED,
                techniques: Optional[list[str]] = None) -> list[Prediction]:
    """Every technique (or those named) that applies to ``model`` (``hvdsync sparse`` only
    with an embedding)."""
    names = techniques or [t for t in TECHNIQUES if t != "hvdsync sparse"
                           or any(layer.rows_touched for layer in model.layers)]
    return [predict(t, model, cluster, c) for t in names]


def with_compute(model: ModelSizes, forward_s: float, backward_s: float,
                 optimizer_s: float = 0.0) -> ModelSizes:
    return replace(model, forward_s=forward_s, backward_s=backward_s, optimizer_s=optimizer_s)


# -- sizes from a model -----------------------------------------------------------------------
def layers_of(model: Any, embedding_rows: Optional[dict[str, int]] = None) -> tuple:
    """The :class:`LayerSize` of each layer of a torch module (parameters grouped by the module
    that owns them, as hvdsync groups them) or a Keras model (by Keras layer).
    ``embedding_rows``: for an embedding layer (by name), the rows one rank's batch touches
    per step (``sparse=``; :func:`touched_rows` counts them from a batch)."""
    rows = embedding_rows or {}
    groups: dict[str, list[tuple[int, ...]]] = {}
    if hasattr(model, "named_parameters"):  # torch
        for name, p in model.named_parameters():
            if p.requires_grad:
                groups.setdefault(name.rsplit(".", 1)[0], []).append(tuple(p.shape))
    else:  # Keras
        for v in model.trainable_variables:
            groups.setdefault(v.path.rsplit("/", 1)[0], []).append(tuple(v.shape))
    out = []
    for name, shapes in groups.items():
        params = sum(math.prod(s) for s in shapes)
        # what PowerSGD and lowrank= compress: 2-d and larger, as (first dim x the rest)
        matrices = tuple((s[0], math.prod(s[1:])) for s in shapes if len(s) >= 2
                         and min(s[0], math.prod(s[1:])) > 1)
        width = shapes[0][1] if name in rows and len(shapes[0]) == 2 else 0
        out.append(LayerSize(name, params, matrices, rows.get(name, 0), width, len(shapes)))
    return tuple(out)


def measure_torch(model: Any, batch: tuple, loss_fn: Any, optimizer: Any,
                  repeats: int = 10, shown: Callable[[Iterable], Iterable] = iter
                  ) -> tuple[float, float, float]:
    """Seconds of one local step of a torch model on ``batch`` = ``(inputs, targets)``:
    forward (with the loss), backward, optimizer step; medians after two warm-up steps
    (``shown``: wraps the steps' range, to show their progress)."""
    import statistics
    import time
    times: list[tuple[float, float, float]] = []
    x, y = batch
    for i in shown(range(repeats + 2)):
        optimizer.zero_grad()
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if i >= 2:
            times.append((t1 - t0, t2 - t1, t3 - t2))
    return tuple(statistics.median(t[k] for t in times) for k in range(3))


def measure_keras(model: Any, x: Any, y: Any, repeats: int = 10, optimizer: Any = None,
                  shown: Callable[[Iterable], Iterable] = iter) -> tuple[float, float, float]:
    """Seconds of one local training step of a Keras model (compiled, as ``fit`` runs it) on
    ``x``, ``y`` with ``optimizer`` (default: SGD): the step's median after two warm-up
    steps, split as forward 1/3, backward 2/3 (a compiled step cannot be timed in parts)."""
    import statistics
    import time

    import keras
    import tensorflow as tf
    opt = optimizer if optimizer is not None else keras.optimizers.SGD(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss
    times = []
    for i in shown(range(repeats + 2)):
        t0 = time.perf_counter()
        step().numpy()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return t / 3, 2 * t / 3, 0.0
