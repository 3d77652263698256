"""A decider (``threshold=``, ``select=``) inside Keras' compiled train function.

Deciders plan each step one step ahead (:mod:`hvdsync.threshold`, :mod:`hvdsync.select`),
so a step's plan exists before its backward. The compiled function reads it from a boolean
variable (written on the host after each step) and wraps each layer's exchange in
``tf.cond(plan[li], send, keep)``: the send branch is a Horovod graph op named after the layer,
which the graph executor starts as soon as backward has produced that layer's gradient, and
every rank takes the same branch (the plan comes from shared values only). No Python runs
between the gradients and the update.

What a decider keeps between steps lives in ``tf.Variable``s (:class:`VariableMemory`):

* ``held``: what a kept-back layer holds per parameter (threshold's accumulation, select's
  residual), zero while its layer holds nothing (a flag per layer says whether it does);
* ``copies``: for a decider whose kept-back layers take a local step
  (:data:`~hvdsync.technique.LOCAL_STEP`), the sync points (a skipping layer's parameters and
  optimizer slots as at its last sync, put back right before its next sync); for one that
  withholds them (:data:`~hvdsync.technique.WITHHELD`), the withheld layers (copied before the
  update and put back after it, so they do not move).

Only what :class:`hvdsync.technique.Decider` declares is used: the decider keeps its policy
(plan, scores, hypernet, counters) in Python and is handed this memory (``use_memory``) as
mappings with the dict interface it uses in the eager pipeline, so ``state_dict`` /
``load_state_dict`` / ``forget`` / ``status`` and the checkpoint format are unchanged. After the
data, the step's statistics -- the decider's declared ``control`` layout, the eager pipeline's
vector -- are averaged in one graph allreduce; the step counts only if they are finite on every
rank (else nothing is committed and the optimizer does not step), and the next plan comes from
them on the host (``plan_from``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import tensorflow as tf
from horovod.tensorflow import mpi_ops
from horovod.tensorflow.mpi_ops import Average

from hvdsync.keras.backend import KerasGradients, KerasOps, norm_of
from hvdsync.keras.comm import KerasCommunicator
from hvdsync.keras.memory import VariableMemory
from hvdsync.technique import LOCAL_STEP, Decider


class CompiledDecider:
    """One wrapped optimizer's decider in compiled form: its memory in variables (installed
    into the core technique in place of its dicts) and the graph pieces of one step, which
    :func:`hvdsync.keras.graph.graph_step` puts together."""

    def __init__(self, decider: Decider, grads: KerasGradients, comm: KerasCommunicator,
                 layer_names: list[str]):
        self.decider = decider
        #: kept-back layers take a local step (else they are withheld)
        self.local_step = decider.kept_layers == LOCAL_STEP
        self.comm = comm
        self.layer_names = layer_names
        self.held = VariableMemory.of_parameters(grads, with_slots=False, name="held")
        self.copies = VariableMemory.of_parameters(grads, with_slots=True, name="copy")
        #: per key, the model variable and its optimizer slots (what ``copies`` mirror)
        self.targets = {grads.key_of(v): [v, *grads.slots.of[v.path]]
                        for vs in grads.layer_vars for v in vs}
        decider.use_memory(self.held, self.copies if self.local_step else None)
        #: the step's plan, written on the host whenever the decider's plan may change (after
        #: each step, after a restore), so the compiled step reads it without a host call
        self._written = self._decisions()  # what plan_now holds
        self.plan_now = tf.Variable(self._written, trainable=False, name="hvdsync_plan")

    def _decisions(self) -> list[bool]:
        return [bool(self.decider.decision(li)) for li in range(len(self.layer_names))]

    def refresh(self, only_if_changed: bool = False) -> None:
        """The decider's plan changed on the host (a step settled, a checkpoint restored).
        ``only_if_changed``: skip the write when the plan is the one written last (a step
        whose plan stands: an eager assign costs ~0.1 ms of a few-ms step)."""
        plan = self._decisions()
        if only_if_changed and plan == self._written:
            return
        self.plan_now.assign(plan)
        self._written = plan

    # -- before backward ---------------------------------------------------------------------
    def trace(self, layers: list[tuple[int, int]]) -> None:
        """At trace time: the layers in the step and their dense bytes (select's eligibility
        and byte budget; every traced step has the same layers)."""
        present = dict(layers)
        for li in range(len(self.layer_names)):
            self.decider.layer_seen(li, li in present, lambda li=li: present[li])

    def plan(self) -> tf.Tensor:
        """This step's plan, a boolean per layer."""
        return self.plan_now.read_value()

    # -- per layer, as backward produces it ---------------------------------------------------
    def exchange(self, li: int, keys: list[str], layer: list, send_plan: tf.Tensor,
                 send: Callable[[list], tuple[list, list]], n_extra: int
                 ) -> tuple[list, tf.Tensor, tf.Tensor, list]:
        """``tf.cond(send_plan, send, keep)`` for layer ``li``'s (dense) gradients ``layer``
        (of the parameters ``keys``).

        Send: the held tensor joins the gradient and ``send(xs) -> (reduced, extras)`` runs
        (``extras``: ``n_extra`` float32 scalars, zeros when kept). Keep: a local step with the
        layer's own gradient, or withheld (zeros; put back after the update). Returns the
        gradients to apply, the extras, and -- apart from the data, so the control round can
        start while the data is still in flight -- the norm of what the layer holds after the
        step (its candidate, committed by :meth:`commit`; 0 when sent) and whether its local
        gradient is non-finite where it is kept (sent data is checked once reduced: identical
        everywhere)."""
        held = [self.held.store[k][0] for k in keys]
        zero = tf.zeros([], tf.float32)

        def go():
            # a layer that holds nothing holds zeros (VariableMemory): no branch on its flag
            out, extras = send([g + tf.cast(h, g.dtype) for g, h in zip(layer, held)])
            return [*out, *extras]

        def keep():
            out = (list(layer) if self.local_step  # the local update with its own gradient
                   else [tf.zeros_like(g) for g in layer])  # withheld (put back anyway)
            return [*out, *[zero] * n_extra]
        res = tf.cond(send_plan, go, keep)
        m = len(layer)
        for r, g in zip(res[:m], layer):
            r.set_shape(g.shape)
        # a branch of its own: a cond's outputs all wait for its slowest op (the send), and
        # the control round should not wait for this layer's data
        held_norm, bad = tf.cond(
            send_plan, lambda: (zero, zero),
            lambda: (norm_of([g + tf.cast(h, g.dtype) for g, h in zip(layer, held)]),
                     KerasOps.bad(layer)))
        return list(res[:m]), held_norm, bad, list(res[m:])

    # -- after backward --------------------------------------------------------------------------
    def control(self, layers: list[tuple[int, list]], held_norms: list, bads: list,
                params: dict[int, list], applied: list) -> tuple[tf.Tensor, tf.Tensor,
                                                                  tf.Tensor]:
        """The step's control vector (the eager pipeline's layout), averaged over ranks in one
        graph allreduce. Returns (shared, this rank's dots and norms, whether the step was
        finite on every rank: the shared flags and statistics, and the gradients to apply --
        a local gradient's NaN is in the flags too, so every rank concludes alike)."""
        n = len(self.layer_names)
        zero = tf.zeros([], tf.float32)
        at = {li: i for i, (li, _) in enumerate(layers)}
        held = [held_norms[at[li]] if li in at else zero for li in range(n)]

        def per_layer(name: str) -> list:
            if name == "held":
                return held
            if name == "expected":
                return [h + norm_of(layers[at[li]][1]) if li in at else h
                        for li, h in enumerate(held)]
            if name == "sync_norm":
                return [self._sync_norm(li, params[li]) if li in at else zero
                        for li in range(n)]
            if name == "dot":
                return [KerasOps.dot(list(zip(layers[at[li]][1], params[li]))) if li in at
                        else zero for li in range(n)]
            raise ValueError(f"hvdsync: no compiled form of the control statistic {name!r}")
        blocks: dict[str, tf.Tensor] = {}
        for name in self.decider.control:  # squares in float64, as the eager host computes
            blocks[name] = (tf.square(blocks["dot"]) if name == "dot_squared"
                            else tf.cast(tf.stack(per_layer(name)), tf.float64))
        local = (tf.concat([blocks[name] for name in self.decider.control], 0)
                 if blocks else tf.zeros([0], tf.float64))
        bad = tf.reduce_max(tf.stack(bads)) if bads else zero
        vector = tf.concat([local, tf.reshape(tf.cast(bad, tf.float64), [1])], 0)
        shared = (mpi_ops._allreduce(vector, name=self.decider.control_name, op=Average,
                                     process_set=self.comm.process_set)
                  if self.comm.size > 1 else vector)
        ok = tf.logical_and(tf.equal(shared[-1], 0.0),
                            tf.reduce_all(tf.math.is_finite(shared[:-1])))
        return shared, local, tf.logical_and(ok, tf.equal(KerasOps.bad(applied), 0.0))

    def _sync_norm(self, li: int, params: list) -> tf.Tensor:
        """``"sync_norm"``: the layer's parameter norm as of its last sync (both norms and a
        select: cheaper to trace than a branch)."""
        anchored = [self.copies.store[k][0] for k in self.copies.layer_keys[li]]
        return tf.where(self.copies.flags[li], norm_of([tf.identity(a) for a in anchored]),
                        norm_of(params))

    def commit(self, layers: list[tuple[int, list[str], list]], plan: tf.Tensor,
               ok: tf.Tensor) -> Callable[[], None]:
        """Before the update, on a step finite everywhere: sent layers drop what they held
        (local steps: and return to their sync point), kept ones add their gradient to it
        (local steps: taking a sync point before their first one; withheld: copying the
        layer aside). ``layers``: (li, the layer's keys in the step, its local gradients).
        Returns what to build after the update (select: put withheld layers back).

        One branch per layer, none nested (a nested branch captures every variable of the
        ones around it: tracing cost grows with depth), taken only by a layer that is kept
        or holds something; inside it, selects (``tf.where``) instead of further branches."""
        for li, keys, local in layers:
            kept = tf.logical_not(plan[li])
            flag, anchor = self.held.flags[li], self.copies.flags[li]
            anchored = anchor.read_value()
            busy = tf.logical_and(ok, tf.logical_or(kept, tf.logical_or(flag.read_value(),
                                                                         anchored)))
            _when(busy, partial(self._commit_layer, keys, local, kept, flag, anchor, anchored))
        if self.local_step:
            return lambda: None
        return lambda: self._put_back_withheld(layers, plan, ok)

    def _commit_layer(self, keys: list[str], local: list, kept: tf.Tensor, flag: tf.Variable,
                      anchor: tf.Variable, anchored: tf.Tensor) -> None:
        variables = [self.targets[k] for k in keys]
        copies = [self.copies.store[k] for k in keys]
        if self.local_step:
            take = tf.logical_and(kept, tf.logical_not(anchored))  # before its first local step
            release = tf.logical_and(tf.logical_not(kept), anchored)  # sent: back to the sync
            for vs, cs in zip(variables, copies):
                for v, c in zip(vs, cs):
                    c.assign(tf.where(take, v, c))
                    v.assign(tf.where(release, c, v))
            anchor.assign(kept)
        else:  # withheld: copied aside, put back after the update
            for vs, cs in zip(variables, copies):
                for v, c in zip(vs, cs):
                    c.assign(tf.where(kept, v, c))
        for h, g in zip((self.held.store[k][0] for k in keys), local):
            h.assign(tf.where(kept, h + tf.cast(g, h.dtype), tf.zeros_like(h)))
        flag.assign(kept)

    def _put_back_withheld(self, layers: list[tuple[int, list[str], list]], plan: tf.Tensor,
                           ok: tf.Tensor) -> None:
        for li, keys, _ in layers:
            kept = tf.logical_and(ok, tf.logical_not(plan[li]))
            copies = [self.copies.store[k] for k in keys]
            variables = [self.targets[k] for k in keys]
            _when(kept, lambda c=copies, v=variables: _put_back(c, v))

    # -- on the host, after the step ----------------------------------------------------------
    def settle(self, ok: bool, shared: np.ndarray, local: np.ndarray) -> None:
        """The next plan, from a step finite everywhere (else the plan stands); eager (the
        step's host function)."""
        if ok:
            self.decider.plan_from(shared.tolist(), local.tolist())
            self.refresh(only_if_changed=True)


def _when(cond: tf.Tensor, fn: Callable[[], Any]) -> None:
    """Run ``fn``'s variable updates only where ``cond`` holds (a graph ``tf.cond``)."""
    def yes():
        fn()
        return tf.constant(True)
    tf.cond(cond, yes, lambda: tf.constant(False))


def _put_back(copies: list[list[tf.Variable]], variables: list) -> None:
    for vs, cs in zip(variables, copies):
        for v, c in zip(vs, cs):
            v.assign(c)


