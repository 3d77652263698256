"""``delay=``'s transport: local steps -- update with the local gradient at once and fold in
the global (averaged) gradient up to ``staleness`` steps later; or, with
``exchange_gradients=False``, send nothing in the step. It replaces the plain exchange of
dense layers; the K-step synchronization of the models after the update is a technique of its
own (:mod:`hvdsync.techniques.outer`).

Step ``t`` starts the allreduce of its local gradient ``g_t`` in backward and updates with
``g_t + sum_j (G_j - g_j)`` over the global gradients ``G_j`` that have arrived (or are due):
each replaces its own step's local contribution, so each is used exactly once. Which have
arrived differs between ranks; it decides only what is added locally, never which
collectives run (docs/design.md, the no-hang rule). docs/delay.md has the whole scheme, its
optimizer-state modes and why replicas stay close; the config and the schedule live in
:class:`DelayPolicy` (the decisions on step ids).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from hvdsync.techniques.delay.carried import Carryable, CarriedCompressor
from hvdsync.techniques.outer.technique import start_offsets
from hvdsync.techniques.delay.config import DelayConfig
from hvdsync.techniques.delay.traced import TracedDelay
from hvdsync.core.stats import SyncStats
from hvdsync.core.wire import Pending, finish_dropped
from hvdsync.core.ports import Communicator, Gradients, TensorOps
from hvdsync.core.technique import Technique, Transport

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


class Delay(Transport):
    """Starts each step's background allreduce and folds arrived global gradients into the
    update, on the shared schedule (which steps drain everything: those the models
    synchronize after).

    Memory: for every step ``j`` whose global gradient has not been folded in yet, each
    layer's local gradients ``g_j`` (kept as backward left them) and the allreduce of a copy
    of them, which becomes ``G_j``. Folding in is local arithmetic on those tensors; the
    collectives (one gradient allreduce per layer per step, one parameter allreduce per layer
    every K steps) are the same on every rank.
    """

    # its step updates locally (hvdsync.core.rules.UPDATES_LOCALLY), and so it checks its own
    # gradients: a non-finite one becomes zeros on its rank (start, flush)
    name = "delay"

    def beside_join(self, by_name: bool) -> Optional[str]:
        return ("delay= averages the ranks' parameters, and a rank in hvd.join() would enter "
                "the average as if it had trained")

    def __init__(self, config: DelayConfig, grads: Gradients, ops: TensorOps,
                 comm: Communicator, layer_names: list[str], stats: SyncStats,
                 compressor: Optional[CarriedCompressor] = None):
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
        self._bad = 0  # this step's layers whose local gradient was non-finite (zeroed)
        self._local: list[tuple[int, list[int], list]] = []  # local steps: this step's layers
        #: exchanging: this ready group's layers, sent together at group_started
        self._queued: list[tuple[int, list[int], Pending, list]] = []
        #: the traced step's memory (:meth:`use_memory`), or None: the step runs eagerly
        self._memory: Optional[dict[str, Any]] = None
        #: its traced form (Keras' compiled train function): what a tracing adapter builds
        #: in place of the eager moments
        self.traced = TracedDelay(self)

    @property
    def traceable(self) -> bool:
        """Local steps (nothing sent but the synchronization, on the host around the
        update), or global gradients folded when due (:meth:`trace_local`). Folding what has
        arrived asks the host mid-step whether an exchange is done: that runs the step
        pipeline (docs/keras.md). ``lowrank=``'s rounds are built in
        (:meth:`hvdsync.techniques.lowrank.in_delay.LowRankInDelay.trace_in_delay`)."""
        c = self.config
        due = c.fold == "due" or c.synchronous  # (synchronous: every step folds its own)
        return not c.exchange_gradients or due

    # -- the traced step's memory and flags (its moments: hvdsync.techniques.delay.traced)
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

    def host_flags(self) -> dict[str, bool]:
        """Exchanging every step's gradient: ``exchange_held`` (the last step's gradient goes
        in this one) and ``drain`` (this step folds in every outstanding global gradient, its
        own included), and with ``lowrank=`` its exchanges' flags
        (:meth:`hvdsync.techniques.lowrank.in_delay.LowRankInDelay.delay_flags`)."""
        flags: dict[str, bool] = {}
        if self.traceable and self.config.exchange_gradients:
            # traced, an outstanding last step's gradient is the held one (not exchanged yet)
            flags["exchange_held"] = self.policy.step in self._in_flight
            flags["drain"] = self.config.synchronous or self.policy.averages_now()
            if self.compressor is not None:
                flags.update(self.compressor.delay_flags())
        return flags

    def finished_steps(self) -> int:
        """How many steps it has finished (the schedule every rank shares)."""
        return self.policy.step

    @property
    def outstanding(self) -> list[int]:
        """Ids (step numbers) of the global gradients not folded in yet."""
        return sorted(self._in_flight)

    def start(self, li: int, ks: list[int], layer: list) -> Optional[Pending]:
        """Queue the layer's local gradient for this step's background allreduce (it starts
        with its ready group's, :meth:`group_started`); the returned pending only carries the
        byte and collective counts (nothing to wait for). Without ``exchange_gradients``
        nothing is sent (``None``)."""
        for k in ks:
            if self.grads.is_row_sparse(li, k):
                raise ValueError("delay= supports dense gradients only; a row-sparse gradient "
                                 "reached it (pass sparse_as_dense=True or no delay)")
        tensors = [layer[k] for k in ks]  # (nothing changes them before they go)
        if not self.config.exchange_gradients:  # local steps: nothing goes until the sync
            self._local.append((li, ks, tensors))  # checked once for the step in flush()
            return None
        counts = Pending()
        self._queued.append((li, list(ks), counts, tensors))
        return counts

    def group_started(self) -> None:
        """Start the ready group's allreduces, one per layer: the group's local gradients
        checked for NaN/Inf at once (one read), copied at once (one multi-tensor op)."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        g, ops = self.grads, self.ops
        step = self.policy.current
        local = [xs for _, _, _, xs in queued]
        # Non-finite on this rank: its steps are not exchanged synchronously, so the step
        # cannot be skipped everywhere; this rank contributes (and applies) zeros instead.
        if not ops.all_finite([x for xs in local for x in xs]):  # (rare: then per layer)
            for (li, ks, _, _), xs in zip(queued, local):
                if not ops.all_finite(xs):
                    xs[:] = ops.zero_if(ops.bad(xs), xs)
                    self._bad += 1
                    for k, x in zip(ks, xs):
                        g.set(li, k, x)
        copies = iter(ops.clone_all([x for xs in local for x in xs]))
        # In-flight ids span at most staleness + 1 consecutive steps, so this slot keeps
        # collective names unique while letting Horovod's response cache reuse them.
        slot = step % (self.config.staleness + 1)
        for (li, ks, counts, _), xs in zip(queued, local):
            name = f"hvdsync.{self.layer_names[li]}.delay{slot}"
            sent = [next(copies) for _ in ks]
            pending = (self.compressor.exchange(li, list(ks), sent, step,
                                                self.config.staleness + 1, name)
                       if self.compressor is not None else self.comm.allreduce(name, sent))
            self._in_flight.setdefault(step, {})[li] = _InFlight(ks, xs, pending)
            counts.nbytes, counts.collectives = pending.nbytes, pending.collectives

    def send_rest(self) -> dict[int, Pending]:
        if self._local:  # local steps: one finiteness check for the step, before the verdict
            layers, self._local = self._local, []
            local = [x for _, _, xs in layers for x in xs]
            if not self.ops.all_finite(local):  # one read; zeroing only when needed
                zeroed, _ = self._zeroed(local)
                self._bad += 1  # (one check for the step)
                it = iter(zeroed)
                self.grads.write([(li, ks, [next(it) for _ in ks]) for li, ks, _ in layers])
        self.comm.dispatch(background=True)  # Keras: the step's allreduce goes to a thread
        return {}

    def _zeroed(self, tensors: list) -> tuple[list, Any]:
        """``tensors``, zeros where any is non-finite, and that device flag."""
        bad = self.ops.bad(tensors)
        return self.ops.zero_if(bad, tensors), bad

    def before_optimizer_step(self) -> None:
        """Set this step's update ``g_t + sum_j (G_j - g_j)`` over the arrived (or due) global
        gradients."""
        if not self.config.exchange_gradients:
            self.policy.finish_step([], None, [], 0)
            return
        t = self.policy.current
        if self._memory is not None:  # traced: the step folded in the graph (trace_local)
            self._in_flight[t] = {}  # its global gradient, held in the trace's memory
            _, fold = self.policy.plan(self.outstanding, set())
            for j in fold:
                del self._in_flight[j]
            self.policy.finish_step(fold, None, [], len(self._in_flight))
            return
        ids = self.outstanding
        ready = {j for j in ids if all(part.pending.ready()
                                       for part in self._in_flight[j].values())}
        wait_for, fold = self.policy.plan(ids, ready)
        start = time.perf_counter()
        parts = [self._in_flight.pop(j) for j in fold]
        # waited for in the order they are folded, on every rank, whatever arrived here: a
        # wait may start a collective (the two-level mode shares an owned result inside the
        # node), and torch.distributed pairs a node's collectives by order
        reduced = [{li: layer.pending.wait_idle()  # (without spinning: peers compute)
                    for li, layer in part.items()} for part in parts]
        waited = time.perf_counter() - start if wait_for else None
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
        self.policy.finish_step(fold, waited, wait_for, len(self._in_flight))

    def end_step(self, ok: bool) -> None:
        bad, self._bad = self._bad, 0
        self._count_nonfinite(bad)

    def _count_nonfinite(self, bad_layers: int) -> None:
        """``bad_layers`` non-finite local gradients (a step's whole check counts once with
        local steps) were replaced by zeros on this rank this step (a loss scaler backs off)."""
        if bad_layers:
            self.stats.count("nonfinite", bad_layers)
            self.grads.kept_nonfinite()

    def flush_replicas(self) -> int:
        """Drop every outstanding global gradient (the synchronization of the models after it
        holds every rank's local contribution of those steps, whose average they are); returns
        how many this rank dropped. A no-op (on every rank alike) when none is outstanding:
        right after a drain, or when synchronous."""
        return self._discard_gradients(finish_newest=not self.config.outer)

    def discard(self) -> int:
        """Finish and drop every outstanding global gradient."""
        return self._discard_gradients()

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
        nothing in the step pipeline; :data:`hvdsync.core.rules.CARRIED`)."""
        carryable: Carryable = other  # type: ignore[assignment] -- carries names it
        self.compressor = carryable.in_delay(self.config.staleness, self.finished_steps)
        return self.compressor  # type: ignore[return-value] -- a technique too

    def forget(self) -> None:
        self.discard()

    def state_dict(self) -> dict:
        """The step counter (the schedule, shared). Outstanding stale global gradients
        (``exchange_gradients``) are not saved: call ``flush()`` before saving
        (docs/checkpoints.md)."""
        return {"policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.discard()
        self.policy.load_state_dict(state["policy"])

    def status(self) -> dict:
        """Finished ``step`` count, ids (step numbers) of the ``outstanding`` global
        gradients, the ids the last step folded in (``last_folded``, newest first), the ids it
        had to wait for (``last_waited``: due by the bound or a drain, not arrived) and the
        ``staleness`` histogram ``{lag in steps: count}``."""
        return {"step": self.policy.step, "outstanding": self.outstanding,
                "last_folded": list(self.policy.last_folded),
                "last_waited": list(self.policy.last_waited),
                "staleness": staleness_histogram(self.stats.total.counters)}
