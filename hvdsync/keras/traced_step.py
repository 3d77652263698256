"""The graph path's step (:func:`hvdsync.keras.graph.graph_step`): :class:`TracedStep` builds
one step of Keras' compiled train function as the step pipeline's moments in traced form --
Horovod's ops in the train function, one grouped allreduce per layer fed only by that
layer's gradient, so a layer is clipped and sent as soon as backward produced it; the
step's statistics reach the host once, through one ``tf.numpy_function``. What the host
decides between steps reaches the graph in :class:`hvdsync.keras.flags.HostFlags`; what a
transport's rounds sent, counted on the device, in :class:`hvdsync.keras.flags.Traffic`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import tensorflow as tf
from horovod.tensorflow import mpi_ops
from horovod.tensorflow.mpi_ops import Average

from hvdsync.keras.comm import KerasCommunicator, payload_bytes
from hvdsync.keras.flags import HostFlags, Traffic
from hvdsync.core.kept_layers import KeptLayers
from hvdsync.core.pipeline import StepPipeline
from hvdsync.core.rules import decided
from hvdsync.core.technique import Technique
from hvdsync.core.traced import TracedRounds


class TracedStep:
    """One step of the graph path, built as the step pipeline's moments in traced form:
    :meth:`begin` (the transports' traced groups, a decider's plan, the host flags);
    :meth:`layer_ready` per layer in a fixed order (the transforms on the local gradient,
    then its exchange -- plain, a decider's branch, or left for its transport's rounds or
    the local step); :meth:`exchange_groups` (the transports' rounds); :meth:`commit` (the
    verdict and the update, only where the step is finite on every rank); and :meth:`end`,
    one host call that records the step and closes it on the host."""

    def __init__(self, comm: KerasCommunicator, pipeline: StepPipeline,
                 layers: list[tuple[int, list[int]]], grads: list, variables: list,
                 apply: Callable[[list, list], None], flags: HostFlags, traffic: Traffic,
                 kept: Optional[KeptLayers]):
        self.comm, self.pipeline, self.layers, self.variables = comm, pipeline, layers, variables
        self.apply, self.flags, self.traffic, self.kept = apply, flags, traffic, kept
        self.grads = list(grads)
        # the transforms' traced forms (clip=: hvdsync.techniques.clip.traced.TracedClip)
        traced = [(ti, t.traced) for ti, t in enumerate(pipeline.transforms) if t.traced]
        self.on_send = [(ti, t) for ti, t in traced if t.applies(arrived=False)]
        self.on_average = [(ti, t) for ti, t in traced if t.applies(arrived=True)]
        self.local = pipeline.local_step  # its step updates with this rank's gradient (delay=)
        #: the transforms' records, by (transform, layer, whether after the average arrived)
        self.records: dict[tuple[int, int, bool], tf.Tensor] = {}
        self.sent: dict[int, Any] = {}
        self.collectives: dict[int, Any] = {}
        self.dense: list = []
        self.plan = None
        self.held_norms, self.bads, self.steps = [], [], []  # (steps: a decider's layers)
        self.params_of: dict[int, list] = {}
        self.local_layers: list[tuple[int, list[int], list]] = []
        # set by begin(): the transports' groups, the layers in them, the layers a decider's
        # plan sends by a transport's rounds (lowrank= beside threshold=), who exchanges
        self.groups: list[tuple[Technique, list[int]]] = []
        self.grouped: set[int] = set()
        self.decided: dict[int, Technique] = {}
        self.exchangers: list[Technique] = []

    def build(self) -> tf.Tensor:
        """The whole step, moment by moment; whether the update was applied (the same on
        every rank)."""
        self.begin()
        for li, positions in self.layers:
            self.layer_ready(li, positions)
        self.exchange_groups()
        self.end(*self.commit())
        return self.ok

    def begin(self) -> None:
        """The step's gradients as the techniques see them, the transports' groups, the
        decider's plan and every technique's host flags."""
        pipeline, kept = self.pipeline, self.kept
        pipeline.grads.begin_step(self.variables, self.grads)  # as techniques see them
        groups = [(t, group) for t in pipeline.transports if isinstance(t, TracedRounds)
                  for group in t.traced_groups(one_layer_each=kept is not None and decided(t))]
        if len({li for _, group in groups for li in group}) < sum(len(g) for _, g in groups):
            raise NotImplementedError(
                "hvdsync: a layer both of these transports exchange in the compiled step ("
                f"{', '.join(sorted({t.name for t, _ in groups}))}: a layer with a row-sparse "
                "gradient and a compressible matrix): set HVDSYNC_KERAS_PIPELINE=1 to run it "
                "through the step pipeline")
        # beside a decider, a decided transport's layers (lowrank=) go where the plan says,
        # one layer's rounds in the branch that sends it; the others' groups (sparse=) every step
        if kept is not None:
            self.decided = {li: t for t, group in groups if decided(t) for li in group}
            if len(self.decided) < sum(len(g) for t, g in groups if decided(t)):
                raise NotImplementedError("hvdsync: beside a decider, a transport's rounds in "
                                          "the compiled step take one layer each")
            groups = [(t, group) for t, group in groups if not decided(t)]
        self.groups = groups
        self.grouped = {li for _, group in groups for li in group}
        self.exchangers = list({t.name: t for t in [*(t for t, _ in groups),
                                                    *self.decided.values()]}.values())
        if kept is not None:  # it governs the layers no transport of its own takes
            self.decider = kept.decider.name
            kept.begin([(li, list(range(len(positions))))
                        for li, positions in self.layers if li not in self.grouped])
        with tf.init_scope():  # a flag may depend on what the trace saw (eagerly, now)
            self.flags.refresh()
        if kept is not None:
            self.plan = self.flags.of(kept.decider)["plan"]
            # one op for every layer's flag (indexing the vector: a strided slice and three
            # constants per use)
            self.plan_of = tf.unstack(self.plan)
        self.flags_of = {t.name: self.flags.of(t) for t in self.exchangers}

    def after_arrival(self, li: int, reduced: list, params: list) -> tuple[list, list]:
        """The transforms that apply to an average (global-mode clip); their records."""
        extras = []
        for _, t in self.on_average:
            reduced, record = t.trace_layer(li, reduced, params, True, _host_scalar)
            extras += [tf.reshape(record, [t.record_size])]
        return reduced, extras

    def record_average(self, li: int, extras: list) -> None:
        for (ti, _), record in zip(self.on_average, extras):
            self.records[(ti, li, True)] = record

    def layer_ready(self, li: int, positions: list[int]) -> None:
        """Layer ``li``'s local gradient: the transforms on it, then its exchange (or left for
        its transport's rounds, or the local step)."""
        comm, local = self.comm, self.local
        layer = [self.grads[p] for p in positions]
        if local is not None:
            layer = [_dense(g, comm, local.name) for g in layer]
        params = self.params_of[li] = [self.variables[p].value for p in positions]
        self.dense.append(tf.add_n([_bytes(comm, g, wire=False) for g in layer]))
        for ti, t in self.on_send:
            layer, record = t.trace_layer(li, layer, params, False, _host_scalar)
            if record is not None:
                self.records[(ti, li, False)] = tf.reshape(record, [t.record_size])
        if li in self.grouped:  # its transport's rounds: exchange_groups
            for k, g in enumerate(layer):
                self.pipeline.grads.set(li, k, g)
        elif local is not None:  # its transport's step: commit
            self.local_layers.append((li, list(range(len(layer))), layer))
            if local.traced.sends_in_step:  # each step's gradient goes once (as the eager step counts)
                own = local.traced.traced_traffic(li, layer, comm.wire_bytes,
                                                  self.flags.of(local))
                self.sent[li] = (tf.add_n([_bytes(comm, g, wire=True) for g in layer])
                                 if own is None else tf.cast(own[0], tf.int64))
                self.collectives[li] = (0 if comm.size == 1 else comm.collectives(layer)
                                        if own is None else own[1])
        else:
            self.exchange_layer(li, positions, layer, params)

    def exchange_layer(self, li: int, positions: list[int], layer: list, params: list) -> None:
        """Layer ``li``'s exchange: plain, or its transport's rounds; beside a decider, in
        the branch of the step's plan that sends it."""
        kept, transport = self.kept, self.decided.get(li)
        one = [(li, list(range(len(layer))))]
        if kept is None:
            reduced, extras = self._send(li, params, transport, one, layer)
        else:
            layer = [_dense(g, self.comm, self.decider) for g in layer]
            n_after = len(self.on_average)
            reduced, held, bad, extras = kept.exchange(
                li, one[0][1], layer, self.plan_of[li],
                lambda xs: self._send(li, params, transport, one, xs),
                lambda: [tf.zeros([t.record_size]) for _, t in self.on_average] + (
                    transport.staged(one, built=False) if transport is not None else []))
            # a decided transport's staged memory leaves the branch (its staged/restage, as
            # TracedRounds' docstring says: lowrank's), written after the step where the plan
            # sent it
            if transport is not None:
                transport.restage(one, extras[n_after:], self.plan_of[li])
                extras = extras[:n_after]
                for k, g in enumerate(layer):  # (the local gradients again, outside)
                    self.pipeline.grads.set(li, k, g)
            self.held_norms.append(held)
            self.bads.append(bad)
            self.steps.append((li, one[0][1], layer))
        self.record_average(li, extras)
        for p, r in zip(positions, reduced):
            self.grads[p] = r
        if transport is None:  # (else counted where its rounds ran: traffic)
            self.sent[li] = tf.add_n([_bytes(self.comm, g, wire=True) for g in layer])
            self.collectives[li] = self.comm.collectives(layer) if self.comm.size > 1 else 0

    def _send(self, li: int, params: list, t: Optional[Technique], one: list,
              xs: list) -> tuple[list, list]:
        comm, traffic, names = self.comm, self.traffic, self.pipeline.layer_names
        if t is None:
            reduced = comm.reduce(xs, name=None if self.kept is None else f"hvdsync.{names[li]}")
        else:  # its rounds, on what the layer holds and its gradient
            for k, x in enumerate(xs):
                self.pipeline.grads.set(li, k, x)
            reduced = t.trace_exchange(one, _counted(comm, traffic, li),
                                       _plain(comm, traffic, names), self.flags_of[t.name],
                                       _count(comm, traffic))[li]
        if self.kept is not None:  # (a branch's outputs keep the shapes both branches give)
            for r, x in zip(reduced, xs):
                r.set_shape(x.shape)
        reduced, extras = self.after_arrival(li, reduced, params)
        return reduced, extras + (t.staged(one, built=True) if t is not None else [])

    def exchange_groups(self) -> None:
        """The transports' traced rounds over their groups of layers."""
        comm, traffic = self.comm, self.traffic
        positions_of = dict(self.layers)
        for t, group in self.groups:
            delivered = t.trace_exchange(
                [(li, list(range(len(positions_of[li])))) for li in group],
                _counted(comm, traffic, group[0]), _plain(comm, traffic,
                                                          self.pipeline.layer_names),
                self.flags.of(t), _count(comm, traffic))
            for li in group:
                reduced, extras = self.after_arrival(li, delivered[li], self.params_of[li])
                self.record_average(li, extras)
                for p, r in zip(positions_of[li], reduced):
                    self.grads[p] = r

    def commit(self) -> tuple[list, list]:
        """The step's verdict and the update; returns what the host call must wait for (the
        transports' reads, the variables after a local update)."""
        grads, variables, apply, kept, local = (self.grads, self.variables, self.apply,
                                                self.kept, self.local)
        self.local_bad, self.before, done = tf.constant(0.0), tf.constant(False), []
        if kept is None:  # (else the decider's control round gives them)
            self.shared = self.own = tf.zeros([0], tf.float64)
        if local is not None:
            positions_of = dict(self.layers)
            applied, self.local_bad = local.traced.trace_local(
                self.local_layers, lambda li, name, xs: self.comm.reduce(xs, name=name),
                self.flags.of(local))
            for (li, _, _), xs in zip(self.local_layers, applied):
                for p, x in zip(positions_of[li], xs):
                    grads[p] = x
            self.ok = tf.constant(True)
            self.before = tf.cond(self.flags.before_update(),
                                  lambda: on_host(self.pipeline.before_local_update),
                                  lambda: tf.constant(False))
            with tf.control_dependencies([self.before]):
                apply(grads, variables)
            # the host's moments after the update read and assign the variables: after it
            done = [tf.convert_to_tensor(v.value) for v in variables]
        elif kept is None:
            # finite on every rank: the exchanged gradients carry any rank's NaN/Inf everywhere
            self.ok = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(
                g.values if isinstance(g, tf.IndexedSlices) else g)) for g in grads]))
            apply_if(self.ok, apply, grads, variables)
        else:
            self.shared, self.own, self.ok = kept.control(
                self.steps, self.held_norms, self.bads, grads, _control_round(self.comm))
        host_reads: list = []  # what the transports' host calls read after the step
        for t in self.exchangers:  # what the rounds staged, if ok
            host_reads += t.trace_commit(self.ok) or []
        if kept is not None:  # (the transports' groups beside it went every step: sparse=)
            put_back = kept.commit(self.steps, self.plan_of, self.ok)
            apply_if(self.ok, apply, grads, variables)
            put_back()
        return host_reads, done

    def end(self, host_reads: list, done: list) -> None:
        """One host call after the update: the step's bytes, records and verdict reach the
        host, which closes the step there and returns the next step's flags."""
        records = self.records
        self.recorded = sorted(records)
        record = (tf.concat([records[key] for key in self.recorded], 0) if records
                  else tf.zeros([0], tf.float32))
        self.order = [li for li, _ in self.layers]
        sends = (self.plan if self.plan is not None
                 else tf.ones([len(self.pipeline.layer_names)], tf.bool))
        sent = tf.stack([self.sent.get(li, tf.constant(0, tf.int64)) for li in self.order])
        # (a device value where a transport's step decides: lowrank= inside delay=)
        calls = tf.stack([tf.cast(self.collectives.get(li, 0), tf.int64) for li in self.order])
        counted = (self.traffic.variable.read_value() if self.exchangers
                   else tf.zeros([0, 2], tf.int64))
        with tf.control_dependencies(done + host_reads):
            # numpy in and out, not py_function's eager tensors: 0.1-0.25 ms less a step (the
            # plain path 2.5-3.5 % of a small MLP's step: benchmarks/results/keras_lab_notes.md,
            # "The step's host call")
            _, *following = tf.numpy_function(
                self.on_host_end, [sent, calls, tf.stack(self.dense), record, self.ok, sends,
                                   self.shared, self.own, self.local_bad, self.before, counted],
                [tf.int32] + [tf.bool] * len(self.flags.variables), stateful=True)
        self.flags.assign_in_graph(following)

    def on_host_end(self, sent, calls, dense, record, ok, sends, shared, own, local_bad, before,
                    counted) -> list:
        """On the host, numpy arrays in: the step's statistics, the transforms' records, the
        techniques' ends of a traced step; the next step's flags out."""
        comm, stats, kept, local, pipeline = (self.comm, self.pipeline.stats, self.kept,
                                              self.local, self.pipeline)
        sends = sends.tolist()
        if self.exchangers:
            counted = self.traffic.since_last(counted)
        for li in self.grouped:  # (they go every step, whatever a decider planned)
            sends[li] = True
        names = pipeline.layer_names
        for li, nbytes, n, d in zip(self.order, sent.tolist(), calls.tolist(), dense.tolist()):
            stats.dense(int(d))
            if li in self.grouped:
                if comm.size > 1:
                    stats.sent(names[li], int(counted[li][0]), int(counted[li][1]))
            elif not sends[li]:
                stats.skipped(names[li])
            elif li in self.decided:
                stats.sent(names[li], int(counted[li][0]), int(counted[li][1]))
            elif li in self.sent and (comm.size > 1 or kept is not None):
                stats.sent(names[li], int(nbytes) if comm.size > 1 else 0, int(n))
        if kept is not None and comm.size > 1:
            stats.control(shared.nbytes)
        _record_transforms(pipeline.transforms, self.recorded, record, sends, bool(ok))
        if kept is not None:
            kept.settle(bool(ok), shared.tolist(), own.tolist())
        for t in self.exchangers:
            t.end_traced_step(bool(ok))
        if local is not None:
            if not before:  # the transport did not need it before the update
                pipeline.before_local_update()
            local.traced.end_local_step(int(round(float(local_bad))))
        if not ok:
            pipeline.note_nonfinite()
        stats.end_step()
        if local is not None:
            pipeline.after_local_update()
        return [np.int32(0)] + self.flags.next_values()  # (an output even without flags)


def _counted(comm: KerasCommunicator, traffic: Traffic, li: int
             ) -> Callable[[str, list], list]:
    """``reduce(name, tensors)`` for a transport's traced rounds: one collective, counted on
    layer ``li`` where it runs (inside a branch: only when the branch is taken)."""
    def reduce(name: str, tensors: list) -> list:
        if not tensors:
            return []
        out = comm.reduce(tensors, name=name)
        if comm.size > 1:
            traffic.add(li, sum(comm.wire_bytes(t) for t in tensors), comm.collectives(tensors))
        return out
    return reduce


def _control_round(comm: KerasCommunicator) -> Callable[[str, tf.Tensor], tf.Tensor]:
    """``reduce(name, vector)`` for a decider's control vector: averaged over ranks in one
    graph allreduce (no compression: the statistics are exact, as in the eager step)."""
    def reduce(name: str, vector: tf.Tensor) -> tf.Tensor:
        if comm.size == 1:
            return vector
        return mpi_ops._allreduce(vector, name=name, op=Average, process_set=comm.process_set)
    return reduce


def _count(comm: KerasCommunicator, traffic: Traffic) -> Callable[[int, object, int], None]:
    """``count(li, nbytes, collectives)`` for a transport's own collectives in a trace."""
    def count(li: int, nbytes, collectives: int) -> None:
        if comm.size > 1:
            traffic.add(li, nbytes, collectives)
    return count


def _plain(comm: KerasCommunicator, traffic: Traffic,
           layer_names: list[str]) -> Callable[[int, list], list]:
    """``plain(li, tensors)`` for a transport's traced rounds: layer ``li``'s plain exchange,
    counted on it."""
    return lambda li, xs: _counted(comm, traffic, li)(f"hvdsync.{layer_names[li]}", xs)


def on_host(fn: Callable[[], None]) -> tf.Tensor:
    """``fn()`` in Python when the step runs here; ``True``."""
    return tf.reshape(tf.py_function(lambda: (fn(), True)[1], [], tf.bool), [])


def _dense(g, comm: KerasCommunicator, technique: str):
    """A decider's or a local step's gradients are dense: ``IndexedSlices`` only with
    ``sparse_as_dense``."""
    if not isinstance(g, tf.IndexedSlices):
        return g
    if not comm.sparse_as_dense:
        raise ValueError(f"{technique}= needs dense gradients and a row-sparse one reached it: "
                         "pass sparse_as_dense=True (with threshold=/select=, sparse=True "
                         "sends row-sparse layers by the sparse exchange every step)")
    return tf.convert_to_tensor(g)


def _host_scalar(fn: Callable[[], float]) -> tf.Tensor:
    """A float32 scalar that ``fn()`` gives on the host as the step runs."""
    return tf.reshape(tf.numpy_function(lambda: np.float32(fn()), [], tf.float32,
                                        stateful=True), [])


def _record_transforms(transforms: list, recorded: list[tuple[int, int, bool]],
                       flat: np.ndarray, sends: list, ok: bool) -> None:
    """Hand each transform its records of the step (``flat``: every record in ``recorded``'s
    order); an average's only where the layer was sent."""
    by: dict[int, list] = {}
    at = 0
    for ti, li, arrived in recorded:
        size = transforms[ti].traced.record_size
        if not arrived or sends[li]:
            by.setdefault(ti, []).append((li, [float(x) for x in flat[at:at + size]]))
        at += size
    for ti, records in by.items():
        transforms[ti].traced.record(records, ok)


def _bytes(comm: KerasCommunicator, g, wire: bool) -> tf.Tensor:
    """Payload bytes of ``g`` as a graph value (sparse sizes are only known at run time)."""
    if isinstance(g, tf.IndexedSlices) and not comm.sparse_as_dense:
        return tf.cast(tf.size(g.values) * g.values.dtype.size
                       + tf.size(g.indices) * g.indices.dtype.size, tf.int64)
    if isinstance(g, tf.IndexedSlices):
        g = tf.convert_to_tensor(g)
    return tf.constant(comm.wire_bytes(g) if wire else payload_bytes(g), tf.int64)


def apply_if(ok, apply: Callable[[list, list], None], grads: list, variables: list) -> None:
    """``apply(grads, variables)`` only where ``ok`` (a step non-finite on some rank is
    skipped on every rank: ``ok`` is the same everywhere; the optimizer takes a skipped
    step's count back: ``hvdsync.keras.optimizer``'s ``_uncount_skipped``)."""
    def update():
        apply(grads, variables)
        return tf.constant(True)
    tf.cond(ok, update, lambda: tf.constant(False))
