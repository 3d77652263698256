"""``delay=``'s outer synchronization (DiLoCo, Streaming DiLoCo), a technique of its own that
runs after the wrapped optimizer's update (docs/delay.md): the model in fragments (runs of
layers balanced by bytes, :func:`fragment_layers`) that synchronize at staggered steps of the
K-step cycle (:func:`start_offsets`); each :class:`Fragment` starts its exchange of the
pseudo-gradient (compressed, with error feedback), merges it ``overlap`` steps later through
the outer optimizer (:func:`outer_step`), or goes back to its anchor. :class:`OuterSync` runs
them on the step count of the ``delay=`` transport it is built with, so which collectives run
depends only on it and the layer layout (the no-hang rule); it saves under ``delay``'s
checkpoint entry (:attr:`hvdsync.core.technique.Technique.keyword`). Plain averaging:
:mod:`hvdsync.techniques.outer.averaging`.
"""

from __future__ import annotations

import atexit
import time
import weakref
from dataclasses import dataclass
from collections.abc import Callable
from functools import partial
from typing import Any, Optional

from hvdsync.core.wire import CODECS, Codec, Pending, finish_dropped
from hvdsync.core.ports import Communicator, Gradients, TensorOps
from hvdsync.core.stats import SyncStats
from hvdsync.core.technique import BEFORE_UPDATE, SYNC, Technique
from hvdsync.techniques.outer.averaging import rank_values, restore_rank_values

def fragment_layers(layer_bytes: list[int], fragments: int) -> list[list[int]]:
    """Consecutive layers (in layer order) in ``fragments`` runs of about equal bytes, none
    empty; the same on every rank (from shapes only)."""
    n = len(layer_bytes)
    if not 1 <= fragments <= n:
        raise ValueError(f"delay fragments={fragments} needs 1..{n} (the number of layers)")
    total = sum(layer_bytes) or n
    out: list[list[int]] = [[] for _ in range(fragments)]
    seen, f = 0, 0
    for li, b in enumerate(layer_bytes):
        # move on once this fragment has its share, leaving one layer at least for each of
        # the fragments still to come
        if out[f] and (seen >= total * (f + 1) / fragments or n - li <= fragments - 1 - f):
            f += 1
        out[f].append(li)
        seen += b
    return out


def start_offsets(average_every: int, fragments: int) -> list[int]:
    """Fragment ``f`` starts its exchange at the steps ``t`` with ``t % K == offset[f]``:
    staggered evenly, the last fragment on multiples of K (K-step averaging's schedule)."""
    return [((f + 1) * average_every // fragments) % average_every for f in range(fragments)]


def outgoing(ops: Any, codec: Codec, feedback: bool, anchors: list, params: list,
             residuals: list) -> tuple[list, Any, list]:
    """``(sent, ctx, lost)``: what goes on the wire for the pseudo-gradients ``anchor - theta``
    (plus this rank's residual where it has one; ``None``: none) -- ``codec``'s parts and
    context -- and, with error ``feedback``, what the encoding lost (the next residuals; else
    ``[]``). A few multi-tensor ops for the whole fragment."""
    deltas = ops.sub_all(anchors, params)
    have = [i for i, r in enumerate(residuals) if r is not None]
    if have:
        for i, x in zip(have, ops.accumulate_all([deltas[i] for i in have],
                                                 [residuals[i] for i in have])):
            deltas[i] = x
    sent, ctx = codec.encode(ops, deltas)
    if codec.exact or not feedback:  # nothing lost, or nothing kept: no decoding
        return sent, ctx, []
    return sent, ctx, ops.sub_all(deltas, codec.decode(ops, sent, ctx))


def outer_step(ops: Any, config: Any, averaged: list, momenta: list, anchors: list,
               params: list) -> tuple[Any, list, list, list]:
    """The outer optimizer and the merge on one fragment: ``(bad, momenta, anchors,
    parameters)`` after it -- ``bad`` a device flag (:meth:`TensorOps.bad`) of ``averaged``:
    where set, the caller keeps none of it. Momenta ``None`` without outer momentum (a
    ``None`` momentum starts at the average). Leaves its arguments as they were; a few
    multi-tensor ops for the whole fragment."""
    c = config
    averaged = list(averaged)
    new_m, updates = list(momenta), averaged
    if c.outer_momentum:
        have = [i for i, m in enumerate(momenta) if m is not None]
        # m = d + mu * m (a momentum not there yet starts at d)
        new_m = ops.clone_all(averaged) if len(have) < len(momenta) else [None] * len(momenta)
        if have:
            for i, m in zip(have, ops.add_scaled_all([averaged[i] for i in have],
                                                     [momenta[i] for i in have],
                                                     c.outer_momentum)):
                new_m[i] = m
        updates = ops.add_scaled_all(averaged, new_m, c.outer_momentum) if c.nesterov \
            else new_m
    new_anchors = ops.add_scaled_all(anchors, updates, -c.outer_lr)
    if c.mix:  # theta = anchor + mix * (theta - anchor)
        values = ops.add_scaled_all(new_anchors, ops.sub_all(params, new_anchors), c.mix)
    else:
        values = new_anchors
    return ops.bad(averaged), new_m, new_anchors, values


@dataclass
class Exchange:
    """A fragment's exchange in flight: started after step ``started``, merged after step
    ``due``; ``pending.wait()`` gives ``{key: averaged pseudo-gradient}``."""

    started: int
    due: int
    pending: Pending


class Fragment:
    """One run of layers of the outer synchronization, and its exchange in flight. Its verbs,
    each on the memory its owner keeps by key (``anchor``, ``momentum``, ``residual``:
    :class:`OuterSync`, which takes every fragment's anchor at once): :meth:`params`,
    :meth:`start`, :meth:`merge`, :meth:`back_to_anchor`."""

    def __init__(self, index: int, layers: list[int], owner: Any):
        self.index, self.layers, self.owner = index, layers, owner
        self.exchange: Optional[Exchange] = None

    def params(self) -> list[tuple[str, Any]]:
        """``(key, parameter)`` of the fragment, in a fixed order."""
        g, out = self.owner.grads, []
        for li in self.layers:
            out += zip(g.param_keys(li), g.replica_tensors(li, False))
        return out

    def start(self, step: int, overlap: int) -> None:
        """Start the exchange of the pseudo-gradients (compressed, with this rank's residual
        folded in), merged ``overlap`` steps after ``step``."""
        o = self.owner
        comm = o.comm
        params = self.params()
        keys = [key for key, _ in params]
        sent, ctx, lost = o.outgoing([o.anchor[k] for k in keys], [p for _, p in params],
                                     [o.residual.get(k) for k in keys])
        o.residual.update(zip(keys, lost))  # error feedback: joins the next exchange
        name = f"hvdsync.outer.f{self.index}"
        if o.codec.collective == "allreduce":  # averaged on the wire
            pending = comm.allreduce(name, sent)
            comm.dispatch(background=True)  # Keras queues eager requests: send it now
        else:  # every rank decodes every rank's parts
            pending = comm.allgather_async(name, sent)
        result = pending.then(lambda out: dict(zip(keys, o.average(out, comm.size, ctx))))
        o.stats.control(pending.nbytes, pending.collectives)
        o.stats.count("outer_started")
        o.stats.count("outer_bytes", pending.nbytes)
        self.exchange = Exchange(step, step + overlap, result)

    def merge(self) -> None:
        """Wait for the exchange; the outer step on the anchors, then the merge into the
        parameters. A non-finite average sends the fragment back to its anchors on every
        rank."""
        o, exchange, self.exchange = self.owner, self.exchange, None
        ops = o.ops
        averaged = exchange.pending.wait_idle()  # the other ranks may still be computing
        params = self.params()
        keys = [key for key, _ in params]
        bad, momenta, anchors, values = o.outer_step(
            [averaged[k] for k in keys], [o.momentum.get(k) for k in keys],
            [o.anchor[k] for k in keys], [p for _, p in params])
        if ops.to_host([bad])[0]:
            o.stats.count("outer_nonfinite")
            self.back_to_anchor(keys, params)
            return
        if o.config.outer_momentum:
            o.momentum.update(zip(keys, momenta))
        o.anchor.update(zip(keys, anchors))
        ops.assign_all([p for _, p in params], values)
        o.stats.count("outer_merged")

    def back_to_anchor(self, keys: list[str], params: list[tuple[str, Any]]) -> None:
        """The parameters go back to the anchors; this rank's residuals are dropped."""
        o = self.owner
        for key in keys:
            o.residual.pop(key, None)
        o.ops.assign_all([p for _, p in params], [o.anchor[k] for k in keys])


#: how long a rank's exit waits for the other ranks to start its last exchanges
EXIT_WAIT_S = 60.0


class OuterSync(Technique):
    """The outer synchronization: per-fragment anchors, outer momentum, this rank's
    error-feedback residuals and the exchanges in flight (:class:`Fragment`).

    Memory (keyed by :meth:`Gradients.key`): ``anchor`` and ``momentum`` (shared: the same on
    every rank), ``residual`` (each rank's own), and the exchanges in flight -- whose averages
    a checkpoint stores once they arrive, so a resumed run merges them at the same step.
    ``finished_steps()``: the ``delay=`` transport's count of finished steps."""

    name = "outer"
    keyword = "delay"
    role = SYNC
    traceable = True
    scale_sensitive = False  # it reads parameters, never gradients
    #: this rank's residuals, and its parameters and optimizer state (they differ between
    #: ranks between synchronizations)
    per_rank = ("outer_residual", "outer_local")

    def beside_join(self, by_name: bool) -> Optional[str]:
        return ("the outer synchronization averages every rank's parameters, and a rank in "
                "hvd.join() would enter the average as if it had trained")

    def __init__(self, config: Any, grads: Gradients, ops: TensorOps, comm: Communicator,
                 layer_names: list[str], stats: SyncStats, finished_steps: Callable[[], int]):
        self.config, self.grads, self.ops, self.comm = config, grads, ops, comm
        self.layer_names, self.stats, self.finished_steps = layer_names, stats, finished_steps
        self.offsets = start_offsets(config.average_every, config.fragments)
        self._fragments: Optional[list[Fragment]] = None
        self.anchor: dict[str, Any] = {}
        self.momentum: dict[str, Any] = {}
        self.residual: dict[str, Any] = {}
        self._due = False  # an update is next: synchronize after it
        #: fragments merged after the last step's update
        self.last_merged: list[int] = []
        #: how the pseudo-gradients travel (``compress=``: :data:`hvdsync.core.wire.CODECS`)
        self.codec = CODECS[config.compress]
        self.outgoing = ops.fused(partial(outgoing, ops, self.codec, config.error_feedback))
        self.average = ops.fused(partial(self.codec.average, ops))
        self.outer_step = ops.fused(partial(outer_step, ops, config))
        # A script that ends without flush() leaves its last exchange in flight: a rank that
        # exits at once shuts Horovod down under a slower rank that is still starting it
        # ("Horovod has been shut down" there). Before Horovod's own exit hook (registered
        # at init, so run after this one), finish it: every rank started the same ones.
        atexit.register(_finish_at_exit, weakref.ref(self))

    @property
    def fragments(self) -> list[Fragment]:
        """The fragments, from parameter sizes at first use."""
        if self._fragments is None:
            sizes = [sum(self.ops.nbytes(x) for x in self.grads.replica_tensors(li, False))
                     for li in range(len(self.layer_names))]
            self._fragments = [Fragment(f, layers, self) for f, layers in
                               enumerate(fragment_layers(sizes, self.config.fragments))]
        return self._fragments

    def _in_flight(self) -> list[Fragment]:
        return [f for f in self.fragments if f.exchange is not None]

    # -- the step -----------------------------------------------------------------------------
    def host_flags(self) -> dict[str, bool]:
        """The anchors are taken before the first update only (:data:`BEFORE_UPDATE`)."""
        return {BEFORE_UPDATE: not self.anchor}

    def before_optimizer_step(self) -> None:
        """Before the first update: every fragment takes its anchor (the parameters every rank
        starts from)."""
        if not self.anchor:
            self._take_anchors()
        self._due = True

    def _take_anchors(self) -> None:
        """The parameters as they are now become every fragment's anchor (the same on every
        rank), copied at once."""
        params = [kp for f in self.fragments for kp in f.params()]
        self.anchor.update(zip([key for key, _ in params],
                               self.ops.clone_all([p for _, p in params])))

    def after_optimizer_step(self) -> None:
        """After the update: merge the exchanges due now, then start those this step begins
        (``overlap = 0``: started and merged at once). Not after a step that skipped
        synchronize() (a state init)."""
        if not self._due:
            return
        self._due, self.last_merged = False, []
        step = self.finished_steps()
        self._merge_due(step)
        k = self.config.average_every
        for fragment, offset in zip(self.fragments, self.offsets):
            if step % k == offset:
                fragment.start(step, self.config.overlap)
        if self.config.overlap == 0:
            self._merge_due(step)

    def _merge_due(self, step: int) -> None:
        for fragment in self._in_flight():
            if fragment.exchange.due <= step:
                fragment.merge()
                self.last_merged.append(fragment.index)

    # -- outside the step ---------------------------------------------------------------------
    def flush_replicas(self) -> int:
        """``flush()``: merge every exchange in flight, then make the replicas identical by
        averaging the parameters (as post-local SGD does; the outer momentum is kept), and
        take them as every fragment's new anchor. Returns how many exchanges were in flight."""
        in_flight = self._in_flight()
        for fragment in in_flight:
            fragment.merge()
            self.last_merged.append(fragment.index)
        params = [f.params() for f in self.fragments]
        groups = [(f"hvdsync.outer.flush.f{f.index}", [p for _, p in ps])
                  for f, ps in zip(self.fragments, params)]
        if self.comm.size > 1:
            self.stats.control(sum(self.ops.nbytes(p) for _, ps in groups for p in ps),
                               len(groups))
            self.comm.average(groups)
        self._take_anchors()
        for key, _ in (kp for ps in params for kp in ps):
            self.residual.pop(key, None)
        return len(in_flight)

    def discard(self) -> int:
        """Finish and drop every exchange in flight (a checkpoint is being loaded, or the
        technique forgets); returns how many there were."""
        in_flight = self._in_flight()
        finish_dropped([f.exchange.pending for f in in_flight], "outer exchanges in flight")
        for fragment in in_flight:
            fragment.exchange = None
        return len(in_flight)

    def state_dict(self) -> dict:
        """Shared (``outer``): anchors, outer momentum, and each exchange in flight (waited
        for here: its average, with the steps it started and is merged after). Per rank:
        residuals (``outer_residual``), and ``outer_local`` -- this rank's parameters and the
        optimizer state shaped like them, which differ between ranks between
        synchronizations while a checkpoint's model and optimizer state are one rank's."""
        g = self.grads
        return {
            "outer_residual": {k: g.to_saved(k, v) for k, v in self.residual.items()},
            "outer_local": rank_values(g, len(self.layer_names)),
            "outer": {
                "anchor": {k: g.to_saved(k, v) for k, v in self.anchor.items()},
                "momentum": {k: g.to_saved(k, v) for k, v in self.momentum.items()},
                "in_flight": [{"fragment": f.index, "started": f.exchange.started,
                               "due": f.exchange.due,
                               "average": {k: g.to_saved(k, v)
                                           for k, v in f.exchange.pending.wait().items()}}
                              for f in self._in_flight()]}}

    def load_state_dict(self, state: dict) -> None:
        g, shared = self.grads, state.get("outer", {})
        self.discard()
        self.anchor = {k: g.from_saved(k, v) for k, v in shared.get("anchor", {}).items()}
        self.momentum = {k: g.from_saved(k, v) for k, v in shared.get("momentum", {}).items()}
        self.residual = {k: g.from_saved(k, v)
                         for k, v in state.get("outer_residual", {}).items()}
        restore_rank_values(g, self.ops, len(self.layer_names), state.get("outer_local", {}))
        for ex in shared.get("in_flight", []):
            average = {k: g.from_saved(k, v) for k, v in ex["average"].items()}
            self.fragments[int(ex["fragment"])].exchange = Exchange(
                int(ex["started"]), int(ex["due"]), Pending.resolved(average))

    def forget(self) -> None:
        """Start over from the parameters as they are at the next step."""
        self.discard()
        self.anchor.clear()
        self.momentum.clear()
        self.residual.clear()

    def drop_per_rank(self) -> None:
        """Drop this rank's residuals; the anchors and momentum are shared."""
        self.residual.clear()

    def status(self) -> dict:
        """The ``fragments`` (layer indices), those ``in_flight`` and those the last step
        merged (``last_merged``)."""
        return {"fragments": [list(f.layers) for f in self.fragments],
                "in_flight": [f.index for f in self._in_flight()],
                "last_merged": list(self.last_merged)}


def _finish_at_exit(ref: "weakref.ref[OuterSync]") -> None:
    sync = ref()
    if sync is None or sync._fragments is None or not sync._in_flight():
        return
    deadline = time.monotonic() + EXIT_WAIT_S  # a peer that never starts one (it ran fewer
    try:                                        # steps, or died) bounds the exit's wait
        if all(f.exchange.pending.ready_within(deadline - time.monotonic())
               for f in sync._in_flight()):
            sync.discard()
    except Exception:  # noqa: BLE001 -- a peer is gone or Horovod is down: nothing to keep
        pass

