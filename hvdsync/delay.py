"""``delay=``: local steps -- update with the local gradient at once, fold in the global
(averaged) gradient when it arrives, and synchronize the models every K steps, by plain
averaging or by an outer optimizer on the pseudo-gradient, streamed in fragments
(:mod:`hvdsync.outer`; with ``exchange_gradients=False`` a step sends nothing but that
synchronization: DiLoCo). A transport: it replaces the plain exchange of dense layers.

Step ``t`` of every rank:

1. backward starts the allreduce of the local gradient ``g_t`` layer by layer, in the
   background (the same collectives on every rank, whatever each one's timing);
2. the update does not wait for it. It uses ``d_t = g_t + sum_j (G_j - g_j)`` over the global
   gradients ``G_j`` (``j <= t``) that have arrived on this rank and were not used yet,
   newest first: each arrived global gradient *replaces* its step's local contribution, so
   every global gradient is used exactly once. If ``G_t`` itself has arrived, ``d_t = G_t +
   ...``: a step whose own reduction is back in time is a synchronous step;
3. a global gradient may lag the step that folds it in by at most ``staleness`` steps: a step
   waits for the ones that would exceed the bound (``staleness=0``: every step waits for its
   own, i.e. synchronous training, equal to Horovod);
4. every ``average_every``-th step (K) waits for every outstanding global gradient, folds them
   in, steps, and then averages the parameters across ranks with one allreduce per layer.

Which global gradients have arrived differs between ranks; it only decides what is *added
locally*, never which collectives run (the no-hang rule of docs/design.md): the gradient allreduce runs every
step and the parameter averaging on the step counter, identically on every rank.

Why replicas stay close: for plain SGD every rank's parameters are ``theta_0 - lr * (sum of
folded G_j + sum of its own unfolded g_j)``, so after a drain (step 4) they are identical even
before averaging; momentum and Adam apply the corrections at a later step than a synchronous
run would, which is the drift the periodic averaging removes. ``average_every=1`` drains every
step, so like ``staleness=0`` it is synchronous training (and needs no parameter averaging).

Optimizer state (momentum buffers, Adam moments): ``optimizer_state="local"`` (default) keeps
each rank's own -- it is built from the same global gradients, only folded in at different
steps, and averaging it would cost one more model-sized allreduce per moment every K steps;
``"average"`` averages every floating-point state tensor shaped like its parameter together
with the parameters, so after an averaging step the replicas are identical, state included.
Scalar state (Adam's step count) is the same on every rank either way.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from hvdsync.carried import Carryable, CarriedCompressor
from hvdsync.config import coerce_config
from hvdsync.outer import CODECS, OuterSync, start_offsets
from hvdsync.stats import SyncStats
from hvdsync.pending import Pending, finish_dropped
from hvdsync.ports import Communicator, Gradients, TensorOps
from hvdsync.technique import Technique, Transport

STATE_MODES = ("local", "average")
#: when a global gradient is folded in (:attr:`DelayConfig.fold`)
FOLD_RULES = ("arrived", "due")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"delay {name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class DelayConfig:
    """Local updates with stale global gradients and/or an outer synchronization every K
    steps; see the module docstring and :mod:`hvdsync.outer`.

    Args:
        staleness: the most steps a global gradient may lag the step that folds it in
            (``0``: synchronous). Only with ``exchange_gradients``.
        average_every: K -- synchronize the parameters across ranks every this many steps
            (per fragment; ``1`` with ``exchange_gradients``: synchronous). DiLoCo's H.
        optimizer_state: ``"local"`` (each rank keeps its own momentum / moments) or
            ``"average"`` (averaged with the parameters; plain K-step averaging only).
        exchange_gradients: send every step's gradient and fold the stale global gradient in
            (the seed's scheme). ``False``: a step sends nothing but the outer
            synchronization (local SGD, DiLoCo).
        outer_lr, outer_momentum, nesterov: the outer optimizer on the pseudo-gradient
            (``1, 0``: plain model averaging; DiLoCo: ``0.7, 0.9, True``).
        fragments: the model in this many runs of layers (balanced by bytes), synchronized at
            staggered steps (Streaming DiLoCo); at most one per layer (a model with fewer
            layers gets one fragment per layer).
        overlap: tau -- a fragment's exchange is merged this many steps after it starts; the
            inner steps go on meanwhile (``0``: the step waits for it).
        mix: Streaming DiLoCo's alpha: after the outer update a fragment's parameters become
            ``(1 - mix) * synchronized + mix * local`` (``0``: the synchronized ones).
        compress: the outer exchange's encoding: ``"none"``, ``"fp16"``, ``"bf16"`` or
            ``"int8"`` (a scale per 1024 values).
        error_feedback: what compression lost joins the rank's next pseudo-gradient.
        fold: when a global gradient is folded in (only with ``exchange_gradients``):
            ``"arrived"`` -- as soon as it has arrived on this rank, at the latest when the
            bound makes it due (the fewest stale steps; which step folds it differs between
            ranks and runs); ``"due"`` -- exactly when the bound makes it due, ``staleness``
            steps after its own (the same steps on every rank and every run: what a traced
            step can build, Keras' compiled train function); ``"auto"`` -- ``"due"`` in an
            adapter that traces its step (Keras), else ``"arrived"`` (torch).
    """

    staleness: int = 2
    average_every: int = 8
    optimizer_state: str = "local"
    exchange_gradients: bool = True
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = True
    fragments: int = 1
    overlap: int = 0
    mix: float = 0.0
    compress: str = "none"
    error_feedback: bool = True
    fold: str = "auto"

    def __post_init__(self) -> None:
        _int_at_least("staleness", self.staleness, 0)
        _int_at_least("average_every", self.average_every, 1)
        _int_at_least("fragments", self.fragments, 1)
        _int_at_least("overlap", self.overlap, 0)
        if self.optimizer_state not in STATE_MODES:
            raise ValueError(f"delay optimizer_state must be one of {STATE_MODES}, got "
                             f"{self.optimizer_state!r}")
        for name in ("exchange_gradients", "nesterov", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"delay {name} must be True or False, got "
                                f"{getattr(self, name)!r}")
        _number_in("outer_lr", self.outer_lr, 0.0, None, low_open=True)
        _number_in("outer_momentum", self.outer_momentum, 0.0, 1.0, high_open=True)
        _number_in("mix", self.mix, 0.0, 1.0)
        if self.fold not in ("auto",) + FOLD_RULES:
            raise ValueError(f"delay fold must be one of {('auto',) + FOLD_RULES}, got "
                             f"{self.fold!r}")
        if self.compress not in CODECS:
            raise ValueError(f"delay compress must be one of {CODECS}, got {self.compress!r}")
        if self.fragments > self.average_every:
            raise ValueError(f"delay fragments={self.fragments} needs average_every >= "
                             f"fragments (each fragment synchronizes at its own step of the "
                             f"K={self.average_every} cycle)")
        if self.overlap >= self.average_every:
            raise ValueError(f"delay overlap={self.overlap} must be < average_every="
                             f"{self.average_every} (a fragment's exchange is merged before "
                             "its next one starts)")
        if self.outer and self.optimizer_state == "average":
            raise ValueError("delay optimizer_state='average' is for plain K-step averaging; "
                             "the outer synchronization keeps each rank's optimizer state "
                             "(as DiLoCo does)")

    @property
    def outer(self) -> bool:
        """Whether the K-step synchronization runs the outer synchronization
        (:mod:`hvdsync.outer`) rather than plain parameter averaging."""
        return (not self.exchange_gradients or self.outer_lr != 1.0 or self.outer_momentum != 0
                or self.fragments > 1 or self.overlap > 0 or self.compress != "none")

    @property
    def synchronous(self) -> bool:
        """Every step uses its own global gradient: the replicas never diverge."""
        return self.exchange_gradients and (self.staleness == 0 or self.average_every == 1)

    def for_adapter(self, traces: bool) -> "DelayConfig":
        """This config with ``fold="auto"`` resolved for an adapter that traces its step
        (``traces``) or not."""
        if self.fold != "auto":
            return self
        return dataclasses.replace(self, fold="due" if traces else "arrived")

    @classmethod
    def diloco(cls, **overrides: Any) -> "DelayConfig":
        """DiLoCo's recipe: local steps only, Nesterov outer SGD (lr 0.7, momentum 0.9)."""
        base = dict(exchange_gradients=False, average_every=32, outer_lr=0.7,
                    outer_momentum=0.9, nesterov=True)
        return cls(**{**base, **overrides})

    @classmethod
    def streaming(cls, **overrides: Any) -> "DelayConfig":
        """hvdsync's recommended local-step preset (docs/delay.md, measured in
        docs/benchmarks.md): DiLoCo streamed in fragments, each exchange overlapping the next
        inner steps, int8 with error feedback."""
        return cls.diloco(**{**STREAMING, **overrides})

    @classmethod
    def coerce(cls, value: Any) -> Optional["DelayConfig"]:
        """``None``, a :class:`DelayConfig`, a dict of its fields, ``True`` (defaults), a
        number meaning ``staleness``, or a preset name: ``"diloco"``, ``"streaming"``."""
        if value is True:
            return cls()
        if value is False:
            return None
        if isinstance(value, str):
            presets = {"diloco": cls.diloco, "streaming": cls.streaming}
            if value not in presets:
                raise ValueError(f"delay preset must be one of {sorted(presets)}, got {value!r}")
            return presets[value]()
        return coerce_config(cls, value, "delay", "staleness")


#: the fields :meth:`DelayConfig.streaming` sets on top of DiLoCo's
STREAMING = dict(average_every=8, fragments=4, overlap=1, mix=0.5, compress="int8")


def _number_in(name: str, value: Any, low: float, high: Optional[float],
               low_open: bool = False, high_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"delay {name} must be a number, got {value!r}")
    bad = value < low or (low_open and value == low) or (
        high is not None and (value > high or (high_open and value == high)))
    if bad:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"delay {name} must be in {lo}{low:g}, "
                         f"{'inf' if high is None else f'{high:g}'}{hi}, got {value!r}")


class DelayPolicy:
    """Which outstanding global gradients a step must wait for, which it folds in, and when
    the parameters are averaged. Global gradients are named by the step that produced them
    (1, 2, ...), so ids and the schedule are identical on every rank; only ``ready`` differs.
    """

    def __init__(self, config: DelayConfig, stats: SyncStats):
        self.config = config
        self.stats = stats
        self.step = 0  # finished steps
        self._offsets = set(start_offsets(config.average_every, config.fragments))
        #: ids folded in by the last step (newest first), for logging and tests
        self.last_folded: list[int] = []
        #: ids the last step had to wait for (not arrived, but due: bound or drain)
        self.last_waited: list[int] = []

    @property
    def current(self) -> int:
        """Id of the step in progress (its gradient's allreduce is started under this id)."""
        return self.step + 1

    def averages_now(self) -> bool:
        """Whether the step in progress drains and then synchronizes the parameters (of a
        fragment, with ``fragments > 1``)."""
        c = self.config
        return not c.synchronous and self.current % c.average_every in self._offsets

    def plan(self, outstanding: list[int], ready: set[int]) -> tuple[list[int], list[int]]:
        """For the step in progress: ``(wait_for, fold)`` -- the outstanding ids that are not
        ready but must be waited for (the staleness bound, or a drain), and every id to fold
        in, newest first."""
        t = self.current
        drain = self.config.synchronous or self.averages_now()
        must = {j for j in outstanding if drain or t - j >= self.config.staleness}
        wait_for = sorted(j for j in must if j not in ready)
        arrived = set() if self.config.fold == "due" else set(outstanding) & ready
        fold = sorted(must | arrived, reverse=True)
        return wait_for, fold

    def finish_step(self, folded: list[int], waited_s: Optional[float],
                    waited_for: list[int],
                    still_outstanding: int) -> None:
        """Record the step: the staleness of each folded gradient, whether (and how long) it
        waited, and how many global gradients remain in flight."""
        t = self.current
        for j in folded:
            self.stats.count(f"staleness_{t - j}")
        if waited_s is not None:
            self.stats.count("waited")
            self.stats.count("wait_s", waited_s)
        self.stats.count("outstanding", still_outstanding)
        self.last_folded = list(folded)
        self.last_waited = list(waited_for)
        self.step += 1

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def staleness_histogram(counters: dict[str, float]) -> dict[int, int]:
    """``{lag in steps: global gradients folded with that lag}`` from a stats counter dict
    (e.g. ``opt.stats.total.counters``)."""
    hist = {int(k[len("staleness_"):]): int(v) for k, v in counters.items()
            if k.startswith("staleness_")}
    return dict(sorted(hist.items()))


@dataclass
class _InFlight:
    """One layer's part of one step's global gradient."""

    ks: list[int]
    local: list  # g_j, as the update of step j used it
    pending: Pending  # its wait() gives G_j


class DelayedGradients(Transport):
    """Starts each step's background allreduce, folds arrived global gradients into the
    update, and averages the parameters on the shared schedule.

    Memory: for every step ``j`` whose global gradient has not been folded in yet, each
    layer's local gradients ``g_j`` (kept as backward left them) and the allreduce of a copy
    of them, which becomes ``G_j``. Folding in is local arithmetic on those tensors; the
    collectives (one gradient allreduce per layer per step, one parameter allreduce per layer
    every K steps) are the same on every rank.
    """

    name = "delay"
    checks_own = True  # a non-finite local gradient becomes zeros on its rank (start, flush)
    updates_locally = True
    carries = ("lowrank",)  # with lowrank=, each step's exchange is the compressed one
    #: each rank's own memory: the outer exchange's error-feedback residuals, and its
    #: parameters and optimizer state (they differ between ranks between synchronizations)
    per_rank = ("outer_residual", "outer_local")

    def __init__(self, config: DelayConfig, grads: Gradients, ops: TensorOps,
                 comm: Communicator, layer_names: list[str], stats: SyncStats,
                 compressor: Optional[CarriedCompressor] = None, traces: bool = False):
        config = config.for_adapter(traces)
        if config.fragments > len(layer_names):  # a fragment is one layer at least
            config = dataclasses.replace(config, fragments=len(layer_names))
        self.config = config
        self.policy = DelayPolicy(config, stats)
        self.grads = grads
        self.ops = ops
        self.comm = comm
        self.layer_names = layer_names
        self.stats = stats
        #: ``lowrank=``'s compression, reached through :class:`CarriedCompressor` only; or
        #: None: plain exchanges
        self.compressor: Optional[CarriedCompressor] = compressor
        self._in_flight: dict[int, dict[int, _InFlight]] = {}  # step id -> layer -> part
        self._average_after_step = False
        self._outer_due = False  # the outer synchronization's turn after this step's update
        self._bad = 0  # this step's layers whose local gradient was non-finite (zeroed)
        self._local: list[tuple[int, list[int]]] = []  # local steps: this step's layers
        #: exchanging: this ready group's layers, sent together at group_started
        self._queued: list[tuple[int, list[int], Pending]] = []
        #: whether the last step replaced a non-finite local gradient by zeros
        self.local_nonfinite = False
        #: the outer synchronization (DiLoCo class), or None: plain K-step averaging
        self.outer = (OuterSync(config, grads, ops, comm, layer_names, stats)
                      if config.outer else None)
        self.sends_in_step = config.exchange_gradients
        #: the traced step's memory (:meth:`use_memory`), or None: the step runs eagerly
        self._memory: Optional[dict[str, Any]] = None

    @property
    def traceable(self) -> bool:
        """Local steps (nothing sent but the synchronization, on the host around the
        update), or global gradients folded when due (:meth:`trace_local`). Folding what has
        arrived asks the host mid-step whether an exchange is done: that runs the step
        pipeline (docs/keras.md). ``lowrank=``'s rounds are built in
        (:meth:`hvdsync.lowrank_delay.DelayedLowRank.trace_in_delay`)."""
        c = self.config
        due = c.fold == "due" or c.synchronous  # (synchronous: every step folds its own)
        return not c.exchange_gradients or due

    @property
    def outstanding(self) -> list[int]:
        """Ids (step numbers) of the global gradients not folded in yet."""
        return sorted(self._in_flight)

    def start(self, li: int, ks: list[int]) -> Optional[Pending]:
        """Queue the layer's local gradient for this step's background allreduce (it starts
        with its ready group's, :meth:`group_started`); the returned pending only carries the
        byte and collective counts (nothing to wait for). Without ``exchange_gradients``
        nothing is sent (``None``)."""
        for k in ks:
            if self.grads.is_row_sparse(li, k):
                raise ValueError("delay= supports dense gradients only; a row-sparse gradient "
                                 "reached it (pass sparse_as_dense=True or no delay)")
        if not self.config.exchange_gradients:  # local steps: nothing goes until the sync
            self._local.append((li, ks))  # checked once for the whole step in flush()
            return None
        counts = Pending()
        self._queued.append((li, list(ks), counts))
        return counts

    def group_started(self) -> None:
        """Start the ready group's allreduces, one per layer: the group's local gradients
        checked for NaN/Inf at once (one read), copied at once (one multi-tensor op)."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        g, ops = self.grads, self.ops
        step = self.policy.current
        local = [[g.get(li, k) for k in ks] for li, ks, _ in queued]
        # Non-finite on this rank: its steps are not exchanged synchronously, so the step
        # cannot be skipped everywhere; this rank contributes (and applies) zeros instead.
        if not ops.all_finite([x for xs in local for x in xs]):  # (rare: then per layer)
            for (li, ks, _), xs in zip(queued, local):
                if not ops.all_finite(xs):
                    xs[:] = ops.zero_if(ops.bad(xs), xs)
                    self._bad += 1
                    for k, x in zip(ks, xs):
                        g.set(li, k, x)
        copies = iter(ops.clone_all([x for xs in local for x in xs]))
        # In-flight ids span at most staleness + 1 consecutive steps, so this slot keeps
        # collective names unique while letting Horovod's response cache reuse them.
        slot = step % (self.config.staleness + 1)
        for (li, ks, counts), xs in zip(queued, local):
            name = f"hvdsync.{self.layer_names[li]}.delay{slot}"
            sent = [next(copies) for _ in ks]
            pending = (self.compressor.exchange(li, list(ks), sent, step,
                                                self.config.staleness + 1, name)
                       if self.compressor is not None else self.comm.allreduce(name, sent))
            self._in_flight.setdefault(step, {})[li] = _InFlight(ks, xs, pending)
            counts.nbytes, counts.collectives = pending.nbytes, pending.collectives

    def flush(self) -> dict[int, Pending]:
        if self._local:  # local steps: one finiteness check for the step, before the verdict
            layers, self._local = self._local, []
            local = [self.grads.get(li, k) for li, ks in layers for k in ks]
            if not self.ops.all_finite(local):  # one read; zeroing only when needed
                zeroed, _ = self._zeroed(local)
                self._bad += 1  # (one check for the step)
                it = iter(zeroed)
                for li, ks in layers:
                    for k in ks:
                        self.grads.set(li, k, next(it))
        self.comm.flush(background=True)  # Keras: the step's allreduce goes to a thread
        return {}

    def _zeroed(self, tensors: list) -> tuple[list, Any]:
        """``tensors``, zeros where any is non-finite, and that device flag."""
        bad = self.ops.bad(tensors)
        return self.ops.zero_if(bad, tensors), bad

    # -- the traced step (Keras' compiled train function) -----------------------------------
    def memory_to_trace(self, params: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Exchanging every step's gradient, folded when due: ``held``, the last step's local
        gradient (exchanged in this step, while backward runs), and ``due1`` ..
        ``due{staleness-1}``, the corrections ``G_j - g_j`` already exchanged, due that many
        steps from now. Synchronous: none (each step its own), but the mapping is asked for,
        which tells this technique that its steps are traced."""
        c = self.config
        if not (c.exchange_gradients and self.traceable):
            return {}
        if c.synchronous:
            return {"held": {}}
        zeros = {key: np.zeros_like(p) for key, p in params.items()}
        return {"held": zeros, **{f"due{i}": zeros for i in range(1, c.staleness)}}

    def use_memory(self, memory: dict[str, Any]) -> None:
        self._memory = memory

    def trace_local(self, layers: list[tuple[int, list[int], list]],
                    reduce: Callable[[int, str, list], list], flags: dict[str, Any]
                    ) -> tuple[list[list], Any]:
        """A traced step (the eager step's arithmetic, in the order a graph can run it):
        each layer's gradients to apply, and a device count of the non-finite local
        gradients replaced by zeros (per layer exchanging, else one check for the step: the
        eager step's count). Local steps: this rank's gradients. Exchanging: step ``t``
        exchanges ``g_{t-1}`` (kept from the last step: the collective needs nothing of this
        step, so it runs beside its backward) into the correction ``G_{t-1} - g_{t-1}``,
        due ``staleness`` steps after ``t-1``; the update is ``g_t`` plus the correction due
        now -- on a drain ``G_t`` (exchanged in the step) plus every correction held.
        ``reduce(li, name, tensors)`` gives their average over ranks (layer ``li``'s)."""
        ops = self.ops
        if not self.config.exchange_gradients:
            flat = [x for _, _, xs in layers for x in xs]
            zeroed, bad = self._zeroed(flat)
            it = iter(zeroed)
            return [[next(it) for _ in xs] for _, _, xs in layers], bad
        if not layers:
            return [], ops.zero()
        bads = [ops.bad(xs) for _, _, xs in layers]  # per layer, as the eager step counts
        bad = sum(bads[1:], bads[0])
        # one branch for the step: a non-finite layer is rare, its zeros cost the others nothing
        checked = ops.cond(bad > 0, lambda: [ops.zero_if(b, xs) for b, (_, _, xs)
                                             in zip(bads, layers)],
                           lambda: [list(xs) for _, _, xs in layers])
        layers = [(li, ks, xs) for (li, ks, _), xs in zip(layers, checked)]
        return self._fold_traced(layers, reduce, flags), bad

    def _fold_traced(self, layers: list[tuple[int, list[int], list]],
                     reduce: Callable[[int, str, list], list], flags: dict[str, Any]
                     ) -> list[list]:
        ops = self.ops
        keys = [[self.grads.key(li, k) for k in ks] for li, ks, _ in layers]
        memory = self._memory
        held = (None if self.config.synchronous
                else [[memory["held"].read(key) for key in ks] for ks in keys])
        exchanges = (self._exchanges_traced if self.compressor is None
                     else self.compressor.trace_in_delay)
        late, own = exchanges([(li, ks) for li, ks, _ in layers], held,
                              [xs for _, _, xs in layers], reduce, flags)
        if held is None:  # synchronous: each step folds its own
            return own
        # per layer, due[i]: the correction due i steps from now (just exchanged: staleness-1)
        due = [[[memory[f"due{i}"].read(key) for key in ks]
                for i in range(1, self.config.staleness)] + [new]
               for ks, new in zip(keys, late)]

        def drain() -> tuple[list, list]:
            totals, emptied = [], []
            for (li, _, xs), total, corrections in zip(layers, own, due):
                for correction in corrections:
                    total = [ops.add(a, b) for a, b in zip(total, correction)]
                totals.append(total)
                emptied.append([[ops.zeros_like(x) for x in xs] for _ in corrections[1:]])
            return totals, emptied

        def step() -> tuple[list, list]:
            return ([[ops.add(x, c) for x, c in zip(xs, corrections[0])]
                     for (_, _, xs), corrections in zip(layers, due)],
                    [corrections[1:] for corrections in due])
        updates, later = ops.cond(flags["drain"], drain, step)
        for ks, (_, _, xs), rest in zip(keys, layers, later):
            for key, x in zip(ks, xs):  # (read after a drain only where this step was none)
                memory["held"].write(key, x, True)
            for i, corrections in enumerate(rest, start=1):
                for key, x in zip(ks, corrections):
                    memory[f"due{i}"].write(key, x, True)
        return updates

    def _exchanges_traced(self, layers: list[tuple[int, list[int]]],
                          held: Optional[list[list]], own: list[list],
                          reduce: Callable[[int, str, list], list], flags: dict[str, Any]
                          ) -> tuple[list[list], list[list]]:
        """A traced step's exchanges (plain; ``lowrank=``'s are
        :meth:`hvdsync.lowrank_delay.DelayedLowRank.trace_in_delay`): per layer the correction
        ``G - g`` of the ``held`` gradients (the last step's: zeros unless
        ``flags["exchange_held"]``; ``None``: synchronous, none) and the average of ``own``
        (this step's: zeros unless ``flags["drain"]``; synchronous: always). One branch for
        every layer, not one per layer: a branch costs the step its own dispatch, and these
        run at the step's start (the exchange) or after backward."""
        ops = self.ops
        names = [f"hvdsync.{self.layer_names[li]}.delay" for li, _ in layers]

        def averages(which: str, tensors: list[list]) -> list[list]:
            return [reduce(li, f"{name}.{which}", xs)
                    for (li, _), name, xs in zip(layers, names, tensors)]

        def zeros(tensors: list[list]) -> list[list]:
            return [[ops.zeros_like(x) for x in xs] for xs in tensors]
        if held is None:
            return [], averages("own", own)
        late = ops.cond(flags["exchange_held"], lambda: [
            [ops.accumulate(G, h, sign=-1) for G, h in zip(avg, hs)]
            for avg, hs in zip(averages("held", held), held)], lambda: zeros(held))
        return late, ops.cond(flags["drain"], lambda: averages("own", own), lambda: zeros(own))

    def traced_traffic(self, li: int, tensors: list, wire_bytes: Callable[[Any], int],
                       flags: dict[str, Any]) -> Optional[tuple[Any, Any]]:
        """Counted at the gradient's step, as the eager step counts it: ``lowrank=``'s
        figures, or ``None`` (the plain exchange's)."""
        if self.compressor is None:
            return None
        return self.compressor.delay_traffic(li, tensors, wire_bytes, flags["own_compressed"])

    def host_flags(self) -> dict[str, bool]:
        """``before_update`` (:meth:`host_before_update`); exchanging every step's gradient,
        ``exchange_held`` (the last step's gradient goes in this one) and ``drain`` (this
        step folds in every outstanding global gradient, its own included), and with
        ``lowrank=`` its exchanges' flags
        (:meth:`hvdsync.lowrank_delay.DelayedLowRank.delay_flags`)."""
        if not self.traceable:
            return {}
        flags = {"before_update": self.host_before_update()}
        if self.config.exchange_gradients:
            # traced, an outstanding last step's gradient is the held one (not exchanged yet)
            flags["exchange_held"] = self.policy.step in self._in_flight
            flags["drain"] = self.config.synchronous or self.policy.averages_now()
            if self.compressor is not None:
                flags.update(self.compressor.delay_flags())
        return flags

    def host_before_update(self) -> bool:
        # the outer synchronization's anchors are taken before the first update only
        return self.outer is not None and not self.outer.has_anchors

    def end_local_step(self, bad: int) -> None:
        self._bad = 0
        self._count_nonfinite(int(bad))
        if self.compressor is not None:  # (it closes its step as in the eager one)
            self.compressor.end_step(True)

    def before_optimizer_step(self) -> None:
        """Set this step's update ``g_t + sum_j (G_j - g_j)`` over the arrived (or due) global
        gradients."""
        if self.outer is not None:
            self.outer.before_first_update()
            self._outer_due = True
        if not self.config.exchange_gradients:
            self.policy.finish_step([], None, [], 0)
            return
        t = self.policy.current
        if self._memory is not None:  # traced: the step folded in the graph (trace_local)
            self._in_flight[t] = {}  # its global gradient, held in the trace's memory
            _, fold = self.policy.plan(self.outstanding, set())
            for j in fold:
                del self._in_flight[j]
            self._average_after(fold, None, [])
            return
        ids = self.outstanding
        ready = {j for j in ids if all(part.pending.ready()
                                       for part in self._in_flight[j].values())}
        wait_for, fold = self.policy.plan(ids, ready)
        waited: Optional[float] = None
        if wait_for:
            start = time.perf_counter()
            for j in wait_for:
                for part in self._in_flight[j].values():
                    part.pending.wait_idle()  # without spinning: the peers are computing
            waited = time.perf_counter() - start
        parts = [self._in_flight.pop(j) for j in fold]
        reduced = [{li: layer.pending.wait() for li, layer in part.items()} for part in parts]
        for part in parts:  # lowrank=: the residuals of what is folded in join its memory
            for layer in part.values():
                layer.pending.used()
        own = bool(fold) and fold[0] == t  # this step's global gradient is back: use it
        current = parts[0] if own else self._in_flight[t]
        corrections = list(zip(parts[1:], reduced[1:])) if own else list(zip(parts, reduced))
        ops = self.ops
        # every layer's update at once (a few multi-tensor ops per correction)
        order = [(li, i, k) for li, layer in current.items() for i, k in enumerate(layer.ks)]
        updates = ([reduced[0][li][i] for li, i, _ in order] if own
                   else ops.clone_all([current[li].local[i] for li, i, _ in order]))
        for part, red in corrections:  # (update + G_j) - g_j, for the layers step j sent
            at = [n for n, (li, _, _) in enumerate(order) if li in part]
            if not at:
                continue
            targets = ops.accumulate_all([updates[n] for n in at],
                                         [red[order[n][0]][order[n][1]] for n in at])
            targets = ops.accumulate_all(targets, [part[order[n][0]].local[order[n][1]]
                                                   for n in at], sign=-1)
            for n, x in zip(at, targets):
                updates[n] = x
        for (li, _, k), update in zip(order, updates):
            self.grads.set(li, k, update)
        self._average_after(fold, waited, wait_for)

    def _average_after(self, fold: list[int], waited: Optional[float],
                       wait_for: list[int]) -> None:
        """Close the step's schedule: whether the parameters are averaged after its update,
        and what it folded and waited for."""
        self._average_after_step = self.policy.averages_now() and self.outer is None
        if self._average_after_step:
            self.stats.count("averaged")
            self.stats.control(*self._averaging_size())
        self.policy.finish_step(fold, waited, wait_for, len(self._in_flight))

    def end_step(self, ok: bool) -> None:
        bad, self._bad = self._bad, 0
        self._count_nonfinite(bad)

    def _count_nonfinite(self, bad_layers: int) -> None:
        """``bad_layers`` non-finite local gradients (a step's whole check counts once with
        local steps) were replaced by zeros on this rank this step."""
        self.local_nonfinite = bad_layers > 0
        if bad_layers:
            self.stats.count("nonfinite", bad_layers)

    def after_optimizer_step(self) -> None:
        """Average the parameters (and, if configured, the optimizer state) when this step
        was an averaging step."""
        if self._outer_due:  # not after a step that skipped synchronize() (a state init)
            self._outer_due = False
            self.outer.after_update(self.policy.step)
        elif self._average_after_step:
            self._average_after_step = False
            self.comm.average(self._averaged())

    def flush_replicas(self) -> int:
        """Wait for every outstanding global gradient and average the replicas; returns how
        many outstanding global gradients this rank discarded. A no-op (on every rank alike)
        right after an averaging step or when synchronous."""
        c = self.config
        if self.outer is not None:
            return self._discard_gradients() + self.outer.synchronize_all()
        if c.synchronous or self.policy.step % c.average_every == 0:
            return 0
        dropped = self._discard_gradients(finish_newest=True)
        self.stats.control(*self._averaging_size())
        self.comm.average(self._averaged())
        return dropped

    def discard(self) -> int:
        """Finish and drop every outstanding global gradient and outer exchange."""
        return self._discard_gradients() + (self.outer.discard() if self.outer else 0)

    def _discard_gradients(self, finish_newest: bool = False) -> int:
        """Drop the outstanding global gradients. ``finish_newest`` (a flush, every rank
        here): a traced step leaves the newest step's exchange to the next one; with
        ``lowrank=`` it runs now, as the eager step ran it (its Q is used later). Not on a
        restore or when the world changes: no new collective then."""
        self._local = []
        self._queued = []
        n = len(self._in_flight)
        newest_held = finish_newest and self.policy.step in self._in_flight
        layers = [layer for part in self._in_flight.values() for layer in part.values()]
        for pending in finish_dropped([layer.pending for layer in layers],
                                      "outstanding global gradients"):
            pending.discard()  # lowrank=: the error feedback comes back
        self._in_flight.clear()
        self._average_after_step = False
        if self._memory is not None and n:  # (host writes: when needed)
            if self.compressor is not None:  # what the exchanges in flight took comes back
                held = self._memory.get("held")
                self.compressor.discard_in_delay(
                    {key: held.read(key) for li in range(len(self.layer_names))
                     for key in self.grads.param_keys(li)}
                    if newest_held and not self.config.synchronous else None)
            for memory in self._memory.values():
                memory.clear()
        if n:
            self.stats.count("discarded", n)
        return n

    def carry(self, other: Technique) -> Technique:
        """``lowrank=``: each step's exchange is its compressed one (its carried form owns
        nothing in the step pipeline)."""
        carryable: Carryable = other  # type: ignore[assignment] -- carries names it
        self.compressor = carryable.in_delay(self.config.staleness, lambda: self.policy.step)
        return self.compressor  # type: ignore[return-value] -- a technique too

    def forget(self) -> None:
        self.discard()
        if self.outer is not None:
            self.outer.forget()

    def drop_per_rank(self) -> None:
        """Drop this rank's residuals; the anchors, momentum and schedule are shared."""
        if self.outer is not None:
            self.outer.residual.clear()

    def state_dict(self) -> dict:
        """Shared: the step counter (the schedule) and the outer synchronization's anchors,
        momentum and exchanges in flight; per rank: its residuals. Outstanding stale global
        gradients (``exchange_gradients``) are not saved: call ``flush()`` before saving
        (docs/checkpoints.md)."""
        state = {"policy": self.policy.state_dict()}
        if self.outer is not None:
            outer = self.outer.state_dict()
            state["outer_residual"] = outer.pop("residual")
            state["outer_local"] = outer.pop("local")
            state["outer"] = outer
        return state

    def load_state_dict(self, state: dict) -> None:
        self.discard()
        self.policy.load_state_dict(state["policy"])
        if self.outer is not None:
            self.outer.load_state_dict({**state.get("outer", {}),
                                        "residual": state.get("outer_residual", {}),
                                        "local": state.get("outer_local", {})})

    def status(self) -> dict:
        """Finished ``step`` count, ids (step numbers) of the ``outstanding`` global
        gradients, the ids the last step folded in (``last_folded``, newest first), the ids it
        had to wait for (``last_waited``: due by the bound or a drain, not arrived), the
        ``staleness`` histogram ``{lag in steps: count}``, and with the outer synchronization
        ``outer`` (:meth:`hvdsync.outer.OuterSync.status`)."""
        status = {"step": self.policy.step, "outstanding": self.outstanding,
                  "last_folded": list(self.policy.last_folded),
                  "last_waited": list(self.policy.last_waited),
                  "staleness": staleness_histogram(self.stats.total.counters)}
        if self.outer is not None:
            status["outer"] = self.outer.status()
        return status

    # -- parameter averaging ------------------------------------------------------------------
    def _averaged(self) -> list[tuple[str, list]]:
        """Per layer and dtype, what is averaged: the parameters, then (``"average"``) their
        optimizer state shaped like them, in a fixed order."""
        groups = []
        with_state = self.config.optimizer_state == "average"
        for li, name in enumerate(self.layer_names):
            by_dtype: dict[str, list] = {}
            for x in self.grads.replica_tensors(li, with_state):
                by_dtype.setdefault(self.ops.dtype_key(x), []).append(x)
            groups += [(f"hvdsync.average.{name}.{d}", xs) for d, xs in by_dtype.items()]
        return groups

    def _averaging_size(self) -> tuple[int, int]:
        """Bytes and collectives of one averaging."""
        if self.comm.size == 1:
            return 0, 0
        groups = self._averaged()
        return sum(self.ops.nbytes(x) for _, xs in groups for x in xs), len(groups)
