"""The compiled train function's side of hvdsync.keras: which path a step takes, and the
bridge that runs the step pipeline eagerly inside it.

* **Graph path** (every technique ``traceable``: plain, ``clip=``, a decider's traced form
  (:mod:`hvdsync.core.kept_layers`), ``lowrank=``'s and ``sparse=``'s traced rounds, ``delay=``):
  the step pipeline's moments built into the train function
  (:class:`hvdsync.keras.traced_step.TracedStep`).
* **Pipeline path** (every other combination): the step pipeline (:mod:`hvdsync.core.pipeline`)
  runs as Python inside ``tf.py_function``; a second one after the update closes the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import tensorflow as tf

from hvdsync.keras.comm import KerasCommunicator
from hvdsync.keras.flags import HostFlags, Traffic
from hvdsync.keras.traced_step import TracedStep, apply_if, on_host
from hvdsync.core.kept_layers import KeptLayers
from hvdsync.core.pipeline import StepPipeline
from hvdsync.core.technique import Technique


def graph_runs(techniques: list[Technique]) -> bool:
    """Whether the compiled graph path can run these techniques (else: the pipeline path):
    every one declares a traced form (:attr:`hvdsync.core.technique.Technique.traceable`) that is
    built beside the others (:attr:`~hvdsync.core.technique.Technique.traced_with`)."""
    names = {t.name for t in techniques}
    return all(t.traceable and (t.traced_with is None or names - {t.name} <= set(t.traced_with))
               for t in techniques)


def graph_step(comm: KerasCommunicator, pipeline: StepPipeline,
               layers: list[tuple[int, list[int]]], grads: list, variables: list,
               apply: Callable[[list, list], None], restored: tf.Variable,
               flags: HostFlags, traffic: Traffic, step: tf.Tensor,
               kept: Optional[KeptLayers] = None) -> tf.Tensor:
    """Build one step of the graph path: per layer (fixed order) clip (local), reduce, clip
    (global); then ``apply(grads, variables)`` and record the step's statistics. With a
    decider (``kept``, its traced form), each layer's reduce runs only where the step's plan
    sends it, and the decider's memory and control round are built around. A
    transport with rounds of its own (:meth:`hvdsync.core.traced.TracedRounds.traced_groups`:
    ``lowrank=``) builds its layers' exchange itself; what it sent is counted in ``traffic``
    (bytes and collectives per layer, a variable: which branch ran is known at run time).
    ``restored``: set when a checkpoint was restored; the step then first runs the
    pipeline's after-restore agreement check (on the host) and clears it -- before the step
    reads any memory or plan: where the check drops per-rank memory, a step that had read it
    already would go on with it on some ranks only. ``flags``: the techniques' host flags.
    ``step``: the step's number, for its entry tag (:meth:`KerasCommunicator.step_tag`),
    sent beside the step's data and checked before the update: a rank in ``flush()`` or a
    save meanwhile makes every rank raise, and no update is made with what was paired.
    Returns whether the update was applied (the same on every rank)."""
    checked = _when_restored(restored, pipeline)
    with tf.control_dependencies([checked]):
        entered = comm.step_tag(step)  # (after the restore check's own tags: one name)

    def apply_entered(grads: list, variables: list) -> None:
        with tf.control_dependencies([entered]):  # no update unless every rank is stepping
            apply(grads, variables)
    with tf.control_dependencies([checked]):
        return TracedStep(comm, pipeline, layers, grads, variables, apply_entered, flags,
                          traffic, kept).build()


def _when_restored(restored: tf.Variable, pipeline: StepPipeline) -> tf.Tensor:
    """After a restore only (no host call otherwise): the pipeline's agreement check, a
    collective on the host, then clear ``restored``; what the rest of the step waits on."""
    def check():
        with tf.control_dependencies([on_host(pipeline.check_load)]):
            restored.assign(False)
        return tf.constant(True)
    return tf.cond(restored, check, lambda: tf.constant(False))


def eager_step(run: Callable[[list, list], tuple[list, bool]], finish: Callable[[], None],
               grads: list, variables: list, apply: Callable[[list, list], None],
               values: bool) -> tf.Tensor:
    """Build one step of the pipeline path: ``run(grads, values)`` eagerly (gradients in;
    gradients to apply and whether to apply them out -- a step non-finite on some rank is
    skipped on every rank; ``values``: the variables' values read before the update, or
    ``[]``), ``apply`` them, then ``finish()`` eagerly after the update. Returns whether the
    update was applied."""
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
        apply_if(ok, apply, new_grads, variables)
    after = [tf.convert_to_tensor(v.value) for v in variables]  # read after the update

    def close(*_):
        finish()
        return tf.zeros([], tf.int32)
    tf.py_function(close, after, tf.int32)
    return ok


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
