"""The compiled train function's side of hvdsync.keras: the plain graph path, and the bridge
that runs the step pipeline eagerly inside it.

* **Graph path** (every technique declared ``traceable``: the plain exchange, ``clip=``,
  a decider, :mod:`hvdsync.keras.compiled`, and ``delay=``'s local steps): Horovod's ops are
  built into the train function, one grouped allreduce per layer, each fed only by its own
  layer's (clipped) gradient, so the graph executor clips and sends a layer as soon as
  backward has produced it. Statistics go to the host once per step through one
  ``tf.py_function``. A step that sends nothing (:attr:`StepPipeline.local_step`) builds in
  no collective, only the transport's ``check_local``; that host call runs its moments after
  the update (and one before it, while :class:`HostBeforeUpdate` says so).
* **Pipeline path** (every other technique): they keep memory across steps and decide from
  values shared between ranks, so the step pipeline (:mod:`hvdsync.pipeline`) runs as Python
  inside ``tf.py_function``: gradients go in, the gradients to apply come out; a second
  ``tf.py_function`` after the update closes the step (``after_optimizer_step``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import numpy as np
import tensorflow as tf

from hvdsync.clipping import LayerClip
from hvdsync.keras.clipping import clip_layer
from hvdsync.keras.comm import KerasCommunicator, payload_bytes
from hvdsync.keras.compiled import CompiledDecider
from hvdsync.pipeline import StepPipeline
from hvdsync.technique import Technique


def graph_runs(techniques: list[Technique]) -> bool:
    """Whether the compiled graph path can run these techniques (else: the pipeline path):
    every one declares a traced form (:attr:`hvdsync.technique.Technique.traceable`)."""
    return all(t.traceable for t in techniques)


class HostBeforeUpdate:
    """Whether a traced step that sends nothing calls the host before its update
    (:meth:`hvdsync.technique.Transport.host_before_update`; ``delay=``'s anchors, taken
    before the first update only): a boolean variable the host writes when the answer
    changes -- after each step, and after a checkpoint or shared state was taken in."""

    def __init__(self, pipeline: StepPipeline):
        self.pipeline = pipeline
        self._written = True
        self.due = tf.Variable(True, trainable=False, name="hvdsync_host_before_update")

    def refresh(self) -> None:
        due = bool(self.pipeline.local_step.host_before_update())
        if due != self._written:  # an eager assign costs ~0.1 ms: only when it changes
            self.due.assign(due)
            self._written = due


def graph_step(comm: KerasCommunicator, pipeline: StepPipeline,
               layers: list[tuple[int, list[int]]], grads: list, variables: list,
               apply: Callable[[list, list], None], restored: tf.Variable,
               decider: Optional[CompiledDecider] = None, keys: Optional[list[str]] = None,
               local: Optional[HostBeforeUpdate] = None) -> None:
    """Build one step of the graph path: per layer (fixed order) clip (local), reduce, clip
    (global); then ``apply(grads, variables)`` and record the step's statistics. With a
    ``decider`` (``keys``: each variable's key), each layer's reduce runs only where the
    step's plan sends it, and the decider's memory and control round are built around.
    ``restored``: set when a checkpoint was restored; the step then first runs the
    pipeline's after-restore agreement check (on the host) and clears it -- before the step
    reads any memory or plan: where the check drops per-rank memory, a step that had read it
    already would go on with it on some ranks only. ``local``: with a step that sends nothing
    (:attr:`StepPipeline.local_step`), when it calls the host before the update."""
    with tf.control_dependencies([_when_restored(restored, pipeline)]):
        _graph_step(comm, pipeline, layers, grads, variables, apply, decider, keys, local)


def _graph_step(comm: KerasCommunicator, pipeline: StepPipeline,
                layers: list[tuple[int, list[int]]], grads: list, variables: list,
                apply: Callable[[list, list], None], decider: Optional[CompiledDecider],
                keys: Optional[list[str]], local_flag: Optional[HostBeforeUpdate]) -> None:
    clip = pipeline.by_name.get("clip")
    quiet = pipeline.local_step  # its steps send nothing (delay= local steps)
    stats, layer_names = pipeline.stats, pipeline.layer_names
    grads = list(grads)
    records, clipped, sent, dense, collectives = [], [], [], [], []
    mode = clip.config.mode if clip is not None else None
    plan = None
    if decider is not None:
        decider.trace([(li, sum(payload_bytes(_dense(grads[p], comm, decider.decider.name))
                                for p in positions))
                       for li, positions in layers])
        plan = decider.plan()
    held_norms, bads, steps, params_of = [], [], [], {}
    for li, positions in layers:
        layer = [grads[p] for p in positions]
        if quiet is not None:
            layer = [_dense(g, comm, quiet.name) for g in layer]
        params = [variables[p].value for p in positions]
        dense.append(tf.add_n([_bytes(comm, g, wire=False) for g in layer]))
        if mode == "local":
            layer, norm, was = clip_layer(layer, params, clip.config, _limit(clip, li))
            records.append(tf.stack([norm, tf.cast(was, tf.float32)]))
            clipped.append(li)

        def send(xs: list, li=li, params=params) -> tuple[list, list]:
            reduced = comm.reduce(xs, name=None if decider is None
                                  else f"hvdsync.{layer_names[li]}")
            if mode != "global":
                return reduced, []
            reduced, norm, was = clip_layer(reduced, params, clip.config, _limit(clip, li))
            return reduced, [norm, tf.cast(was, tf.float32)]
        if quiet is not None:
            reduced = layer
        elif decider is None:
            reduced, extras = send(layer)
        else:
            layer = [_dense(g, comm, decider.decider.name) for g in layer]
            ks = [keys[p] for p in positions]
            reduced, held, bad, extras = decider.exchange(li, ks, layer, plan[li], send,
                                                          2 if mode == "global" else 0)
            held_norms.append(held)
            bads.append(bad)
            steps.append((li, ks, layer))
            params_of[li] = params
        if mode == "global":
            records.append(tf.stack(extras))
            clipped.append(li)
        for p, r in zip(positions, reduced):
            grads[p] = r
        sent.append(tf.add_n([_bytes(comm, g, wire=True) for g in layer]))
        collectives.append(comm.collectives(layer) if comm.size > 1 else 0)
    local_bad = before = tf.constant(False)
    if quiet is not None:
        grads, local_bad = quiet.check_local(grads)
        ok = tf.constant(True)
        shared = local = tf.zeros([0], tf.float64)
        before = tf.cond(local_flag.due, lambda: _on_host(pipeline.before_local_update),
                         lambda: tf.constant(False))
        with tf.control_dependencies([before]):
            apply(grads, variables)
        # the host's moments after the update read and assign the variables: after it
        done = [tf.convert_to_tensor(v.value) for v in variables]
    elif decider is None:
        # finite on every rank: the exchanged gradients carry any rank's NaN/Inf everywhere
        ok = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(
            g.values if isinstance(g, tf.IndexedSlices) else g)) for g in grads]))
        shared = local = tf.zeros([0], tf.float64)
        _apply_if(ok, apply, grads, variables)
    else:
        shared, local, ok = decider.control([(li, layer) for li, _, layer in steps],
                                            held_norms, bads, params_of, grads)
        put_back = decider.commit(steps, plan, ok)
        _apply_if(ok, apply, grads, variables)
        put_back()
    record = tf.stack(records) if records else tf.zeros([0, 2], tf.float32)
    names = [layer_names[li] for li, _ in layers]
    sends = plan if plan is not None else tf.ones([len(layer_names)], tf.bool)
    order = [li for li, _ in layers]

    def finish(sent, dense, record, ok, sends, shared, local, local_bad, before):  # eager
        sent, dense, record, ok, sends, shared, local, local_bad, before = (
            x.numpy() for x in (sent, dense, record, ok, sends, shared, local, local_bad,
                                before))
        sends = sends.tolist()
        for li, name, nbytes, d, c in zip(order, names, sent.tolist(), dense.tolist(),
                                          collectives):
            stats.dense(int(d))
            if not sends[li]:
                stats.skipped(name)
            elif quiet is None and (comm.size > 1 or decider is not None):
                stats.sent(name, int(nbytes) if comm.size > 1 else 0, c)
        if decider is not None and comm.size > 1:
            stats.control(shared.nbytes)
        if clip is not None:
            clip.record_step([(li, float(n), bool(w)) for li, (n, w)
                              in zip(clipped, np.asarray(record).reshape(-1, 2))
                              if mode == "local" or sends[li]], bool(ok))
        if decider is not None:
            decider.settle(bool(ok), shared, local)
        if quiet is not None:
            if not before:  # the transport did not need it before the update
                pipeline.before_local_update()
            pipeline.end_local_step(bool(local_bad))
        if not ok:
            pipeline.note_nonfinite()
        stats.end_step()
        if quiet is not None:
            pipeline.after_local_update()
            local_flag.refresh()
        return np.int32(0)
    with tf.control_dependencies(done if quiet is not None else []):
        tf.py_function(finish, [tf.stack(sent), tf.stack(dense), record, ok, sends, shared,
                                local, local_bad, before], tf.int32)


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


def _limit(clip: LayerClip, li: int) -> tf.Tensor:
    """``max_norm`` and the adaptive limits of layer ``li`` as of the last step."""
    c = clip.config
    if c.ema is None and c.variance is None:
        return tf.constant(c.max_norm if c.max_norm is not None else np.inf, tf.float32)
    limit = tf.numpy_function(lambda: np.float32(clip.norm_limit(li)), [], tf.float32,
                              stateful=True)
    return tf.reshape(limit, [])


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
            spec.append(("sparse", tuple(int(d) for d in shape)))
            flat += [g.values, g.indices]
        else:
            spec.append(("dense", None))
            flat.append(g)
    return flat, spec


def _unflatten(flat: list, spec: list) -> list:
    out, i = [], 0
    for kind, shape in spec:
        if kind == "sparse":
            out.append(tf.IndexedSlices(flat[i], flat[i + 1], tf.constant(shape, tf.int64)))
            i += 2
        else:
            out.append(flat[i])
            i += 1
    return out
