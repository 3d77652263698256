"""The compiled train function's side of hvdsync.keras: the graph path, and the bridge that
runs the step pipeline eagerly inside it.

* **Graph path** (every technique ``traceable``: plain, ``clip=``, a decider's traced form
  (:mod:`hvdsync.kept_layers`), ``lowrank=``'s and ``sparse=``'s traced rounds, ``delay=``):
  Horovod's ops are built into the train function, one grouped allreduce per layer fed only
  by that layer's gradient, so a layer is clipped and sent as soon as backward produced it;
  statistics reach the host once per step through one ``tf.numpy_function``. A step that
  updates locally (``delay=``) builds its transport's ``trace_local`` instead.
* **Pipeline path** (every other combination): the step pipeline (:mod:`hvdsync.pipeline`)
  runs as Python inside ``tf.py_function``; a second one after the update closes the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import tensorflow as tf
from horovod.tensorflow import mpi_ops
from horovod.tensorflow.mpi_ops import Average

from hvdsync.keras.comm import KerasCommunicator, payload_bytes
from hvdsync.kept_layers import KeptLayers
from hvdsync.pipeline import StepPipeline
from hvdsync.technique import Technique
from hvdsync.traced import TracedRounds


def graph_runs(techniques: list[Technique]) -> bool:
    """Whether the compiled graph path can run these techniques (else: the pipeline path):
    every one declares a traced form (:attr:`hvdsync.technique.Technique.traceable`) that is
    built beside the others (:attr:`~hvdsync.technique.Technique.traced_with`)."""
    names = {t.name for t in techniques}
    return all(t.traceable and (t.traced_with is None or names - {t.name} <= set(t.traced_with))
               for t in techniques)


class Traffic:
    """Bytes and collectives per layer that a transport's traced rounds sent, counted on the
    device (which branch ran -- warm-up or compressed -- is known at run time only): a
    growing ``[layers, 2]`` variable; :meth:`since_last` gives the step's share on the host."""

    def __init__(self, n_layers: int):
        self.variable = tf.Variable(tf.zeros([n_layers, 2], tf.int64), trainable=False,
                                    name="hvdsync_traffic")
        self._seen = np.zeros([n_layers, 2], np.int64)

    def add(self, li: int, nbytes, collectives: int) -> None:
        """In the step: layer ``li`` sent ``nbytes`` (an int, or a device scalar where the
        size is known at run time only) in ``collectives`` (where this runs)."""
        if isinstance(nbytes, int):
            row = np.zeros(self._seen.shape, np.int64)
            row[li] = (nbytes, collectives)
            self.variable.assign_add(tf.constant(row))
            return
        self.variable.scatter_nd_add([[li, 0], [li, 1]], tf.stack(
            [tf.cast(nbytes, tf.int64), tf.constant(collectives, tf.int64)]))

    def since_last(self, total: np.ndarray) -> np.ndarray:
        """On the host: what was counted since the last call (``total``: the variable read
        at the end of a step)."""
        step, self._seen = total - self._seen, total
        return step


class HostFlags:
    """What the host decides between steps that the traced step branches on
    (:meth:`hvdsync.technique.Technique.host_flags`: ``delay=``'s anchors taken before the
    first update only, ``lowrank=``'s warm-up, a decider's plan): a boolean variable (or
    vector) each. The step's host call returns them for the next step and the graph assigns
    them (:meth:`next_values`); outside a step -- at a trace, after a checkpoint or shared
    state was taken in, after a flush -- the host writes what changed (:meth:`refresh`)."""

    def __init__(self, techniques: list[Technique]):
        self.techniques = techniques
        self._written = self._now()
        self.variables = {name: tf.Variable(value, trainable=False, name=f"hvdsync_{name}")
                          for name, value in self._written.items()}

    def _now(self) -> dict[str, Any]:
        return {f"{t.name}.{flag}": ([bool(x) for x in value] if isinstance(value, list)
                                     else bool(value))
                for t in self.techniques for flag, value in t.host_flags().items()}

    def of(self, technique: Technique) -> dict[str, tf.Tensor]:
        """``technique``'s flags, read in the step."""
        prefix = f"{technique.name}."
        return {name[len(prefix):]: v.read_value() for name, v in self.variables.items()
                if name.startswith(prefix)}

    def refresh(self) -> None:
        """Write what changed (eagerly: outside a step -- at a trace, after a flush or a
        restore)."""
        for name, value in self._now().items():
            if value != self._written[name]:  # an eager assign costs ~0.1 ms: on change only
                self.variables[name].assign(value)
                self._written[name] = value

    def next_values(self) -> list[np.ndarray]:
        """In the step's host call: every flag for the next step, which the graph assigns
        after the call (:meth:`assign_in_graph`). Not an eager assign from inside the host
        call: that one left, in about one 10-step fit in 40, one rank taking the other
        branch of a flag in the next step -- a collective on one rank only, a hang
        (docs/keras.md, "Host flags")."""
        self._written = self._now()
        return [np.asarray(self._written[name], bool) for name in self.variables]

    def assign_in_graph(self, values: list) -> None:
        """In the step, after the host call: assign its :meth:`next_values`."""
        for v, x in zip(self.variables.values(), values):
            v.assign(tf.reshape(x, v.shape))


def graph_step(comm: KerasCommunicator, pipeline: StepPipeline,
               layers: list[tuple[int, list[int]]], grads: list, variables: list,
               apply: Callable[[list, list], None], restored: tf.Variable,
               flags: HostFlags, traffic: Traffic,
               kept: Optional[KeptLayers] = None) -> None:
    """Build one step of the graph path: per layer (fixed order) clip (local), reduce, clip
    (global); then ``apply(grads, variables)`` and record the step's statistics. With a
    decider (``kept``, its traced form), each layer's reduce runs only where the step's plan
    sends it, and the decider's memory and control round are built around. A
    transport with rounds of its own (:meth:`hvdsync.traced.TracedRounds.traced_groups`:
    ``lowrank=``) builds its layers' exchange itself; what it sent is counted in ``traffic``
    (bytes and collectives per layer, a variable: which branch ran is known at run time).
    ``restored``: set when a checkpoint was restored; the step then first runs the
    pipeline's after-restore agreement check (on the host) and clears it -- before the step
    reads any memory or plan: where the check drops per-rank memory, a step that had read it
    already would go on with it on some ranks only. ``flags``: the techniques' host flags."""
    with tf.control_dependencies([_when_restored(restored, pipeline)]):
        _graph_step(comm, pipeline, layers, grads, variables, apply, flags, traffic, kept)


def _graph_step(comm: KerasCommunicator, pipeline: StepPipeline,
                layers: list[tuple[int, list[int]]], grads: list, variables: list,
                apply: Callable[[list, list], None], flags: HostFlags, traffic: Traffic,
                kept: Optional[KeptLayers]) -> None:
    transforms = list(enumerate(pipeline.transforms))
    on_send = [(ti, t) for ti, t in transforms if t.applies(arrived=False)]
    on_average = [(ti, t) for ti, t in transforms if t.applies(arrived=True)]
    local = pipeline.local_step  # its step updates with this rank's gradient (delay=)
    stats, layer_names = pipeline.stats, pipeline.layer_names
    grads = list(grads)
    #: the transforms' records, by (transform, layer, whether after the average arrived)
    records: dict[tuple[int, int, bool], tf.Tensor] = {}
    sent, collectives, dense = {}, {}, []
    plan = None
    groups: list[tuple[Technique, list[int]]] = []
    pipeline.grads.begin_step(variables, grads)  # the step's gradients, as techniques see them
    groups = [(t, group) for t in pipeline.transports if isinstance(t, TracedRounds)
              for group in t.traced_groups(one_layer_each=kept is not None and t.decidable)]
    if len({li for _, group in groups for li in group}) < sum(len(g) for _, g in groups):
        raise NotImplementedError(
            "hvdsync: a layer both of these transports exchange in the compiled step ("
            f"{', '.join(sorted({t.name for t, _ in groups}))}: a layer with a row-sparse "
            "gradient and a compressible matrix): set HVDSYNC_KERAS_PIPELINE=1 to run it "
            "through the step pipeline")
    # beside a decider, a decidable transport's layers (lowrank=) go where the plan says, one
    # layer's rounds in the branch that sends it; the others' groups (sparse=) every step
    decided: dict[int, Technique] = {}
    if kept is not None:
        decided = {li: t for t, group in groups if t.decidable for li in group}
        if len(decided) < sum(len(g) for t, g in groups if t.decidable):
            raise NotImplementedError("hvdsync: beside a decider, a transport's rounds in the "
                                      "compiled step take one layer each")
        groups = [(t, group) for t, group in groups if not t.decidable]
    grouped = {li for _, group in groups for li in group}
    exchangers = list({t.name: t for t in [*(t for t, _ in groups), *decided.values()]}
                      .values())
    if kept is not None:  # it governs the layers no transport of its own takes
        decider = kept.decider.name
        kept.begin([(li, sum(payload_bytes(_dense(grads[p], comm, decider))
                             for p in positions))
                    for li, positions in layers if li not in grouped])
    with tf.init_scope():  # a flag may depend on what the trace saw (eagerly, now)
        flags.refresh()
    if kept is not None:
        plan = flags.of(kept.decider)["plan"]
        # one op for every layer's flag (indexing the vector: a strided slice and three
        # constants per use)
        plan_of = tf.unstack(plan)
    flags_of = {t.name: flags.of(t) for t in exchangers}
    held_norms, bads, steps, params_of = [], [], [], {}  # (steps: a decider's layers)
    local_layers: list[tuple[int, list[int], list]] = []

    def after_arrival(li: int, reduced: list, params: list) -> tuple[list, list]:
        """The transforms that apply to an average (global-mode clip); their records."""
        extras = []
        for _, t in on_average:
            reduced, record = t.trace_layer(li, reduced, params, True, _host_scalar)
            extras += [tf.reshape(record, [t.traced_record])]
        return reduced, extras

    def no_records() -> list:  # a kept layer's (no average arrived)
        return [tf.zeros([t.traced_record]) for _, t in on_average]

    def record_average(li: int, extras: list) -> None:
        for (ti, _), record in zip(on_average, extras):
            records[(ti, li, True)] = record
    for li, positions in layers:
        layer = [grads[p] for p in positions]
        if local is not None:
            layer = [_dense(g, comm, local.name) for g in layer]
        params = params_of[li] = [variables[p].value for p in positions]
        dense.append(tf.add_n([_bytes(comm, g, wire=False) for g in layer]))
        for ti, t in on_send:
            layer, record = t.trace_layer(li, layer, params, False, _host_scalar)
            if record is not None:
                records[(ti, li, False)] = tf.reshape(record, [t.traced_record])
        if li in grouped:  # its transport's rounds, below
            for k, g in enumerate(layer):
                pipeline.grads.set(li, k, g)
            continue
        if local is not None:  # its transport's step, below
            local_layers.append((li, list(range(len(layer))), layer))
            if local.sends_in_step:  # each step's gradient goes once (as the eager step counts)
                own = local.traced_traffic(li, layer, comm.wire_bytes, flags.of(local))
                sent[li] = (tf.add_n([_bytes(comm, g, wire=True) for g in layer]) if own is None
                            else tf.cast(own[0], tf.int64))
                collectives[li] = (0 if comm.size == 1 else comm.collectives(layer)
                                   if own is None else own[1])
            continue

        transport = decided.get(li)
        one = [(li, list(range(len(layer))))]

        def send(xs: list, li=li, params=params, t=transport, one=one) -> tuple[list, list]:
            if t is None:
                reduced = comm.reduce(xs, name=None if kept is None
                                      else f"hvdsync.{layer_names[li]}")
            else:  # its rounds, on what the layer holds and its gradient
                for k, x in enumerate(xs):
                    pipeline.grads.set(li, k, x)
                reduced = t.trace_exchange(one, _counted(comm, traffic, li),
                                           _plain(comm, traffic, layer_names),
                                           flags_of[t.name], _count(comm, traffic))[li]
            if kept is not None:  # (a branch's outputs keep the shapes both branches give)
                for r, x in zip(reduced, xs):
                    r.set_shape(x.shape)
            reduced, extras = after_arrival(li, reduced, params)
            return reduced, extras + (t.staged(one, built=True) if t is not None else [])
        if kept is None:
            reduced, extras = send(layer)
        else:
            layer = [_dense(g, comm, decider) for g in layer]
            ks = one[0][1]
            n_after = len(on_average)
            reduced, held, bad, extras = kept.exchange(
                li, ks, layer, plan_of[li], send,
                lambda t=transport, one=one: no_records() + (
                    t.staged(one, built=False) if t is not None else []))
            if transport is not None:  # written after the step where the plan sent it
                transport.restage(one, extras[n_after:], plan_of[li])
                extras = extras[:n_after]
                for k, g in enumerate(layer):  # (the local gradients again, outside)
                    pipeline.grads.set(li, k, g)
            held_norms.append(held)
            bads.append(bad)
            steps.append((li, ks, layer))
        record_average(li, extras)
        for p, r in zip(positions, reduced):
            grads[p] = r
        if transport is not None:  # counted where its rounds ran (traffic)
            continue
        sent[li] = tf.add_n([_bytes(comm, g, wire=True) for g in layer])
        collectives[li] = comm.collectives(layer) if comm.size > 1 else 0
    positions_of = dict(layers)
    for t, group in groups:
        delivered = t.trace_exchange(
            [(li, list(range(len(positions_of[li])))) for li in group],
            _counted(comm, traffic, group[0]), _plain(comm, traffic, layer_names),
            flags.of(t), _count(comm, traffic))
        for li in group:
            reduced, extras = after_arrival(li, delivered[li], params_of[li])
            record_average(li, extras)
            for p, r in zip(positions_of[li], reduced):
                grads[p] = r
    local_bad, before = tf.constant(0.0), tf.constant(False)
    if local is not None:
        applied, local_bad = local.trace_local(
            local_layers, lambda li, name, xs: comm.reduce(xs, name=name), flags.of(local))
        for (li, _, _), xs in zip(local_layers, applied):
            for p, x in zip(positions_of[li], xs):
                grads[p] = x
        ok = tf.constant(True)
        shared = own = tf.zeros([0], tf.float64)
        before = tf.cond(flags.of(local)["before_update"],
                         lambda: _on_host(pipeline.before_local_update),
                         lambda: tf.constant(False))
        with tf.control_dependencies([before]):
            apply(grads, variables)
        # the host's moments after the update read and assign the variables: after it
        done = [tf.convert_to_tensor(v.value) for v in variables]
    elif kept is None:
        # finite on every rank: the exchanged gradients carry any rank's NaN/Inf everywhere
        ok = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(
            g.values if isinstance(g, tf.IndexedSlices) else g)) for g in grads]))
        shared = own = tf.zeros([0], tf.float64)
        _apply_if(ok, apply, grads, variables)
    else:
        shared, own, ok = kept.control(steps, held_norms, bads, grads, _control_round(comm))
    host_reads: list = []  # what the transports' host calls read after the step
    for t in exchangers:  # what the rounds staged, if ok
        host_reads += t.trace_commit(ok) or []
    if kept is not None:  # (the transports' groups beside it went every step: sparse=)
        put_back = kept.commit(steps, plan_of, ok)
        _apply_if(ok, apply, grads, variables)
        put_back()
    recorded = sorted(records)
    record = (tf.concat([records[key] for key in recorded], 0) if records
              else tf.zeros([0], tf.float32))
    order = [li for li, _ in layers]
    names = [layer_names[li] for li in order]
    sends = plan if plan is not None else tf.ones([len(layer_names)], tf.bool)
    static_bytes = tf.stack([sent.get(li, tf.constant(0, tf.int64)) for li in order])
    # (a device value where a transport's step decides: lowrank= inside delay=)
    calls = tf.stack([tf.cast(collectives.get(li, 0), tf.int64) for li in order])
    counted = (traffic.variable.read_value() if exchangers
               else tf.zeros([0, 2], tf.int64))
    sending = set(sent)  # (not delay='s local steps)

    def finish(sent, calls, dense, record, ok, sends, shared, own, local_bad, before,
               counted):  # on the host, numpy arrays in
        sends = sends.tolist()
        if exchangers:
            counted = traffic.since_last(counted)
        for li in grouped:  # (they go every step, whatever a decider planned)
            sends[li] = True
        for li, name, nbytes, n, d in zip(order, names, sent.tolist(), calls.tolist(),
                                          dense.tolist()):
            stats.dense(int(d))
            if li in grouped:
                if comm.size > 1:
                    stats.sent(name, int(counted[li][0]), int(counted[li][1]))
            elif not sends[li]:
                stats.skipped(name)
            elif li in decided:
                stats.sent(name, int(counted[li][0]), int(counted[li][1]))
            elif li in sending and (comm.size > 1 or kept is not None):
                stats.sent(name, int(nbytes) if comm.size > 1 else 0, int(n))
        if kept is not None and comm.size > 1:
            stats.control(shared.nbytes)
        _record_transforms(pipeline.transforms, recorded, record, sends, bool(ok))
        if kept is not None:
            kept.settle(bool(ok), shared.tolist(), own.tolist())
        for t in exchangers:
            t.end_traced_step(bool(ok))
        if local is not None:
            if not before:  # the transport did not need it before the update
                pipeline.before_local_update()
            pipeline.end_local_step(int(round(float(local_bad))))
        if not ok:
            pipeline.note_nonfinite()
        stats.end_step()
        if local is not None:
            pipeline.after_local_update()
        return [np.int32(0)] + flags.next_values()  # (an output even without flags)
    with tf.control_dependencies((done if local is not None else []) + host_reads):
        # numpy in and out, not py_function's eager tensors: 0.1-0.25 ms less a step (the
        # plain path 2.5-3.5 % of a small MLP's step: docs/keras.md, "The step's host call")
        _, *following = tf.numpy_function(
            finish, [static_bytes, calls, tf.stack(dense), record, ok, sends, shared, own,
                     local_bad, before, counted], [tf.int32] + [tf.bool] * len(flags.variables),
            stateful=True)
    flags.assign_in_graph(following)


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


def _on_host(fn: Callable[[], None]) -> tf.Tensor:
    """``fn()`` in Python when the step runs here; ``True``."""
    return tf.reshape(tf.py_function(lambda: (fn(), True)[1], [], tf.bool), [])


def _when_restored(restored: tf.Variable, pipeline: StepPipeline) -> tf.Tensor:
    """After a restore only (no host call otherwise): the pipeline's agreement check, a
    collective on the host, then clear ``restored``; what the rest of the step waits on."""
    def check():
        with tf.control_dependencies([_on_host(pipeline.check_load)]):
            restored.assign(False)
        return tf.constant(True)
    return tf.cond(restored, check, lambda: tf.constant(False))


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
        size = transforms[ti].traced_record
        if not arrived or sends[li]:
            by.setdefault(ti, []).append((li, [float(x) for x in flat[at:at + size]]))
        at += size
    for ti, records in by.items():
        transforms[ti].record_traced(records, ok)


def _bytes(comm: KerasCommunicator, g, wire: bool) -> tf.Tensor:
    """Payload bytes of ``g`` as a graph value (sparse sizes are only known at run time)."""
    if isinstance(g, tf.IndexedSlices) and not comm.sparse_as_dense:
        return tf.cast(tf.size(g.values) * g.values.dtype.size
                       + tf.size(g.indices) * g.indices.dtype.size, tf.int64)
    if isinstance(g, tf.IndexedSlices):
        g = tf.convert_to_tensor(g)
    return tf.constant(comm.wire_bytes(g) if wire else payload_bytes(g), tf.int64)


def eager_step(run: Callable[[list, list], tuple[list, bool]], finish: Callable[[], None],
               grads: list, variables: list, apply: Callable[[list, list], None],
               values: bool) -> None:
    """Build one step of the pipeline path: ``run(grads, values)`` eagerly (gradients in;
    gradients to apply and whether to apply them out -- a step non-finite on some rank is
    skipped on every rank; ``values``: the variables' values read before the update, or
    ``[]``), ``apply`` them, then ``finish()`` eagerly after the update."""
    shapes = [v.shape for v in variables]
    flat, spec = _flatten(grads, shapes)
    reads = [tf.convert_to_tensor(v.value) for v in variables] if values else []

    def call(*tensors):
        step_grads = _unflatten(list(tensors[:len(flat)]), spec)
        out, ok = run(step_grads, list(tensors[len(flat):]))
        out_flat, out_spec = _flatten(out, shapes)
        if [s[0] for s in out_spec] != [s[0] for s in spec]:
            raise RuntimeError("hvdsync: a technique changed the gradient layout")
        return [*out_flat, tf.constant(bool(ok))]
    results = tf.py_function(call, flat + reads, [t.dtype for t in flat] + [tf.bool])
    for r, t in zip(results, flat):
        r.set_shape(t.shape if t.shape.is_fully_defined() else [None] * t.shape.rank)
    new_grads, ok = _unflatten(list(results[:-1]), spec), tf.reshape(results[-1], [])
    with tf.control_dependencies([t for t in results]):
        _apply_if(ok, apply, new_grads, variables)
    after = [tf.convert_to_tensor(v.value) for v in variables]  # read after the update

    def close(*_):
        finish()
        return tf.zeros([], tf.int32)
    tf.py_function(close, after, tf.int32)


def _apply_if(ok, apply: Callable[[list, list], None], grads: list, variables: list) -> None:
    """``apply(grads, variables)`` only where ``ok`` (a step non-finite on some rank is
    skipped on every rank: ``ok`` is the same everywhere). A skipped step does not count:
    Keras adds one to the optimizer's ``iterations`` after every apply, so take it back
    (as Keras' own LossScaleOptimizer leaves a skipped step uncounted)."""
    optimizer = getattr(apply, "__self__", None)

    def update():
        apply(grads, variables)
        return tf.constant(True)

    def skip():
        if optimizer is not None and not optimizer.gradient_accumulation_steps:
            optimizer._iterations.assign_add(-1)
        return tf.constant(False)
    tf.cond(ok, update, skip)


def in_xla_context() -> bool:
    try:
        from tensorflow.python.ops import control_flow_util
        return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except Exception:  # pragma: no cover - private API moved
        return False


def _flatten(grads: list, shapes: list) -> tuple[list, list]:
    """Gradients as a flat list of tensors (``IndexedSlices`` as values, indices) and what it
    takes to rebuild them (the static dense shape comes from the variable)."""
    flat, spec = [], []
    for g, shape in zip(grads, shapes):
        if isinstance(g, tf.IndexedSlices):
            spec.append(("slices", tuple(int(d) for d in shape)))
            flat += [g.values, g.indices]
        else:
            spec.append(("tensor", None))
            flat.append(g)
    return flat, spec


def _unflatten(flat: list, spec: list) -> list:
    out, i = [], 0
    for kind, shape in spec:
        if kind == "slices":
            out.append(tf.IndexedSlices(flat[i], flat[i + 1], tf.constant(shape, tf.int64)))
            i += 2
        else:
            out.append(flat[i])
            i += 1
    return out
