"""``delay=``'s outer synchronization (DiLoCo, Streaming DiLoCo): every K steps the ranks
average the parameter change since their last synchronization (the *pseudo-gradient*
``anchor - theta``) and apply an outer optimizer -- SGD with momentum, Nesterov by default --
to the last synchronized parameters (the *anchor*, the same on every rank), then merge:
``theta = (1 - mix) * anchor + mix * theta``. Streamed, the model is split into fragments
(runs of layers balanced by bytes) that synchronize at staggered steps, each exchange
overlapping the next ``overlap`` inner steps, compressed (fp16, bf16, int8 with a scale per
chunk) with error feedback. ``lr = 1, mu = 0`` is plain model averaging. Which collectives run
depends only on the step counter and the layer layout (the no-hang rule); a non-finite average
is skipped on every rank (the fragment goes back to its anchor). docs/delay.md has the terms.
"""

from __future__ import annotations

import atexit
import time
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

from hvdsync.core.stats import SyncStats
from hvdsync.core.pending import Pending, finish_dropped
from hvdsync.core.ports import Communicator, Gradients, TensorOps

#: how the pseudo-gradients travel: ``none`` (as they are, allreduce), ``fp16`` (allreduce
#: in half precision), ``bf16`` and ``int8`` (allgather: every rank decodes every rank's
#: contribution and averages them in rank order, so all get the same bits)
CODECS = ("none", "fp16", "bf16", "int8")
#: values per int8 scale (the chunk's largest magnitude maps to 127)
INT8_CHUNK = 1024


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


#: how long a rank's exit waits for the other ranks to start its last exchanges
EXIT_WAIT_S = 60.0


# -- the arithmetic of one fragment's exchange: pure, so each runs as one call where ops are
# dear (TensorOps.fused)
def outgoing(ops: TensorOps, codec: str, feedback: bool, anchors: list, params: list,
             residuals: list) -> tuple[list, list, list]:
    """``(deltas, sent, lost)``: the pseudo-gradients ``anchor - theta`` (plus this rank's
    residual where it has one; ``None``: none), what goes on the wire (``codec``: as they are,
    in half precision, or :meth:`TensorOps.encode`'s parts) and, with error ``feedback``, what
    the encoding lost (the next residuals; else ``[]``). A few multi-tensor ops for the whole
    fragment."""
    deltas = ops.sub_all(anchors, params)
    have = [i for i, r in enumerate(residuals) if r is not None]
    if have:
        for i, x in zip(have, ops.accumulate_all([deltas[i] for i in have],
                                                 [residuals[i] for i in have])):
            deltas[i] = x
    if codec == "none":
        return deltas, deltas, []
    fp16 = codec == "fp16"
    sent = ([ops.cast(d, "float16") for d in deltas] if fp16
            else ops.encode(deltas, codec, INT8_CHUNK))
    if not feedback:  # nothing kept: no decoding
        return deltas, sent, []
    back = ([ops.cast(x, like=d) for x, d in zip(sent, deltas)] if fp16
            else ops.decode(sent, deltas, codec, INT8_CHUNK))
    return deltas, sent, ops.sub_all(deltas, back)


def average_gathered(ops: TensorOps, size: int, codec: str, gathered: list,
                     like: list) -> list:
    """Every rank's decoded contribution, averaged in rank order (the same bits on every
    rank)."""
    return ops.decode_sum(gathered, size, codec, INT8_CHUNK, like)


def outer_step(ops: TensorOps, config: Any, averaged: list, momenta: list, anchors: list,
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


def _finish_at_exit(ref: "weakref.ref[OuterSync]") -> None:
    sync = ref()
    if sync is None or not sync._in_flight:
        return
    deadline = time.monotonic() + EXIT_WAIT_S  # a peer that never starts one (it ran fewer
    try:                                        # steps, or died) bounds the exit's wait
        if all(ex.pending.ready_within(deadline - time.monotonic())
               for ex in sync._in_flight.values()):
            sync.discard()
    except Exception:  # noqa: BLE001 -- a peer is gone or Horovod is down: nothing to keep
        pass


@dataclass
class _Exchange:
    """One fragment's exchange in flight: started after step ``started``, merged after step
    ``due``."""

    fragment: int
    started: int
    due: int
    pending: Pending  # wait() -> {key: averaged pseudo-gradient}


class OuterSync:
    """The outer synchronization of ``delay=`` (see the module docstring): per-fragment
    anchors, outer momentum, error-feedback residuals and exchanges in flight.

    Memory (keyed by :meth:`Gradients.key`): ``anchor`` and ``momentum`` (shared: the same on
    every rank), ``residual`` (each rank's own), and the exchanges in flight -- whose averages
    a checkpoint stores once they arrive, so a resumed run merges them at the same step.
    """

    def __init__(self, config: Any, grads: Gradients, ops: TensorOps, comm: Communicator,
                 layer_names: list[str], stats: SyncStats):
        self.config = config
        self.grads = grads
        self.ops = ops
        self.comm = comm
        self.layer_names = layer_names
        self.stats = stats
        self.offsets = start_offsets(config.average_every, config.fragments)
        self._fragments: Optional[list[list[int]]] = None
        self.anchor: dict[str, Any] = {}
        self.momentum: dict[str, Any] = {}
        self.residual: dict[str, Any] = {}
        self._in_flight: dict[int, _Exchange] = {}  # fragment -> its exchange
        #: fragments merged after the last step's update
        self.last_merged: list[int] = []
        self._outgoing = ops.fused(partial(outgoing, ops, config.compress,
                                           config.error_feedback))
        self._average_gathered = ops.fused(partial(average_gathered, ops))
        self._outer_step = ops.fused(partial(outer_step, ops, config))
        # A script that ends without flush() leaves its last exchange in flight: a rank that
        # exits at once shuts Horovod down under a slower rank that is still starting it
        # ("Horovod has been shut down" there). Before Horovod's own exit hook (registered
        # at init, so run after this one), finish it: every rank started the same ones.
        atexit.register(_finish_at_exit, weakref.ref(self))

    # -- layout -------------------------------------------------------------------------------
    @property
    def fragments(self) -> list[list[int]]:
        """The layers of each fragment (computed from parameter sizes at first use)."""
        if self._fragments is None:
            sizes = [sum(self.ops.nbytes(x) for x in self.grads.replica_tensors(li, False))
                     for li in range(len(self.layer_names))]
            self._fragments = fragment_layers(sizes, self.config.fragments)
        return self._fragments

    def _params(self, f: int) -> list[tuple[str, Any]]:
        """``(key, parameter)`` of fragment ``f`` in a fixed order."""
        out = []
        for li in self.fragments[f]:
            out += zip(self.grads.param_keys(li), self.grads.replica_tensors(li, False))
        return out

    def starting(self, step: int) -> list[int]:
        """Fragments whose exchange starts after step ``step``."""
        k = self.config.average_every
        return [f for f, o in enumerate(self.offsets) if step % k == o]

    # -- the step -----------------------------------------------------------------------------
    @property
    def has_anchors(self) -> bool:
        """Whether the anchors are taken (else the next update is a first one)."""
        return bool(self.anchor)

    def before_first_update(self) -> None:
        """Take the anchors (the parameters every rank starts from) before the first update."""
        if self.has_anchors:
            return
        params = [kp for f in range(len(self.fragments)) for kp in self._params(f)]
        self.anchor.update(zip([key for key, _ in params],
                               self.ops.clone_all([p for _, p in params])))

    def after_update(self, step: int) -> None:
        """After the inner update of step ``step``: merge the exchanges due now, then start
        the ones this step begins (``overlap = 0``: started and merged at once)."""
        self.last_merged = []
        self._merge_due(step)
        tau = self.config.overlap
        for f in self.starting(step):
            self._in_flight[f] = _Exchange(f, step, step + tau, self._send(f))
        if tau == 0:
            self._merge_due(step)

    def _merge_due(self, step: int) -> None:
        for f in sorted(self._in_flight):
            if self._in_flight[f].due <= step:
                self._merge(self._in_flight.pop(f))

    # -- one exchange -------------------------------------------------------------------------
    def _send(self, f: int) -> Pending:
        """Start the exchange of fragment ``f``'s pseudo-gradients (compressed, with this
        rank's residual folded in); the pending gives ``{key: average}``."""
        ops, codec = self.ops, self.config.compress
        params = self._params(f)
        keys = [key for key, _ in params]
        deltas, sent, lost = self._outgoing([self.anchor[k] for k in keys],
                                            [p for _, p in params],
                                            [self.residual.get(k) for k in keys])
        self.residual.update(zip(keys, lost))  # error feedback: joins the next exchange
        name = f"hvdsync.outer.f{f}"
        if codec in ("none", "fp16"):
            pending = self.comm.allreduce(name, sent)
            self.comm.flush(background=True)  # Keras queues eager requests: send it now
            result = pending.then(lambda out: {k: ops.cast(x, like=d)
                                               for k, x, d in zip(keys, out, deltas)})
        else:
            pending = self.comm.allgather_async(name, sent)
            result = pending.then(lambda out: dict(zip(keys, self._average_gathered(
                self.comm.size, codec, out, deltas))))
        self.stats.control(pending.nbytes, pending.collectives)
        self.stats.count("outer_started")
        self.stats.count("outer_bytes", pending.nbytes)
        return result

    def _merge(self, ex: _Exchange) -> None:
        """The outer step on fragment ``ex.fragment``'s anchors, then the merge into the
        parameters; a non-finite average resets the fragment to its anchors on every rank."""
        ops, c = self.ops, self.config
        averaged = ex.pending.wait_idle()  # the other ranks may still be computing
        params = self._params(ex.fragment)
        keys = [key for key, _ in params]
        bad, momenta, anchors, values = self._outer_step(
            [averaged[k] for k in keys], [self.momentum.get(k) for k in keys],
            [self.anchor[k] for k in keys], [p for _, p in params])
        if ops.to_host([bad])[0]:
            self.stats.count("outer_nonfinite")
            for key in keys:
                self.residual.pop(key, None)
            ops.assign_all([p for _, p in params], [self.anchor[k] for k in keys])
            self.last_merged.append(ex.fragment)
            return
        if c.outer_momentum:
            self.momentum.update(zip(keys, momenta))
        self.anchor.update(zip(keys, anchors))
        ops.assign_all([p for _, p in params], values)
        self.stats.count("outer_merged")
        self.last_merged.append(ex.fragment)

    # -- outside the step ---------------------------------------------------------------------
    def synchronize_all(self) -> int:
        """``flush()``: merge every exchange in flight, then make the replicas identical by
        averaging the parameters (as post-local SGD does; the outer momentum is kept), and
        take them as every fragment's new anchor. Returns how many exchanges were in flight."""
        n = len(self._in_flight)
        for f in sorted(self._in_flight):
            self._merge(self._in_flight.pop(f))
        groups, keys = [], []
        for f in range(len(self.fragments)):
            params = self._params(f)
            groups.append((f"hvdsync.outer.flush.f{f}", [p for _, p in params]))
            keys.append(params)
        if self.comm.size > 1:
            self.stats.control(sum(self.ops.nbytes(p) for _, ps in groups for p in ps),
                               len(groups))
            self.comm.average(groups)
        everything = [kp for params in keys for kp in params]
        self.anchor.update(zip([key for key, _ in everything],
                               self.ops.clone_all([p for _, p in everything])))
        for key, _ in everything:
            self.residual.pop(key, None)
        return n

    def discard(self) -> int:
        """Finish and drop every exchange in flight (a checkpoint is being loaded, or the
        technique forgets); returns how many there were."""
        n = len(self._in_flight)
        finish_dropped([ex.pending for ex in self._in_flight.values()],
                       "outer exchanges in flight")
        self._in_flight.clear()
        return n

    def state_dict(self) -> dict:
        """Shared: anchors, outer momentum, and each exchange in flight (waited for here:
        its average, with the steps it started and is merged after). Per rank: residuals, and
        ``local`` -- this rank's parameters and the optimizer state shaped like them, which
        differ between ranks between synchronizations while a checkpoint's model and optimizer
        state are one rank's."""
        g = self.grads
        return {
            "local": rank_values(g, len(self.layer_names)),
            "anchor": {k: g.to_saved(k, v) for k, v in self.anchor.items()},
            "momentum": {k: g.to_saved(k, v) for k, v in self.momentum.items()},
            "residual": {k: g.to_saved(k, v) for k, v in self.residual.items()},
            "in_flight": [{"fragment": ex.fragment, "started": ex.started, "due": ex.due,
                           "average": {k: g.to_saved(k, v)
                                       for k, v in ex.pending.wait().items()}}
                          for _, ex in sorted(self._in_flight.items())],
        }

    def load_state_dict(self, state: dict) -> None:
        g = self.grads
        self.discard()
        self.anchor = {k: g.from_saved(k, v) for k, v in state.get("anchor", {}).items()}
        self.momentum = {k: g.from_saved(k, v) for k, v in state.get("momentum", {}).items()}
        self.residual = {k: g.from_saved(k, v) for k, v in state.get("residual", {}).items()}
        restore_rank_values(g, self.ops, len(self.layer_names), state.get("local", {}))
        for ex in state.get("in_flight", []):
            average = {k: g.from_saved(k, v) for k, v in ex["average"].items()}
            self._in_flight[int(ex["fragment"])] = _Exchange(
                int(ex["fragment"]), int(ex["started"]), int(ex["due"]),
                Pending.resolved(average))

    def forget(self) -> None:
        """Start over from the parameters as they are at the next step."""
        self.discard()
        self.anchor.clear()
        self.momentum.clear()
        self.residual.clear()

    def status(self) -> dict:
        return {"fragments": [list(f) for f in self.fragments],
                "in_flight": sorted(self._in_flight),
                "last_merged": list(self.last_merged)}


def rank_values(g: Gradients, layers: int) -> dict:
    """This rank's parameters and the optimizer state shaped like them, per layer, to save:
    they differ between ranks while a checkpoint's model and optimizer state are one rank's."""
    out = {}
    for li in range(layers):
        key = g.param_keys(li)[0]
        out[key] = [g.to_saved(key, x) for x in g.replica_tensors(li, True)]
    return out


def restore_rank_values(g: Gradients, ops: TensorOps, layers: int, saved: dict) -> None:
    """Put back what :func:`rank_values` saved on this rank, where it was saved."""
    for li in range(layers):
        key = g.param_keys(li)[0]
        values = saved.get(key)
        targets = g.replica_tensors(li, True)
        if values is not None and len(values) == len(targets):
            for x, v in zip(targets, values):
                ops.assign(x, g.from_saved(key, v))
