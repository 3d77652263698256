"""A decider (``threshold=``, ``select=``) in a traced step: what a tracing adapter (Keras'
compiled train function, :mod:`hvdsync.keras.graph`) builds in place of the decider's eager
moments -- tensors through :class:`TensorOps`, memory through mappings the adapter makes
(device variables), collectives through callables it passes in.

The plan of each step is a device boolean per layer (the decider's ``plan`` host flag), and
each layer's exchange sits in ``ops.cond(plan[li], send, keep)``: every rank takes the same
branch and the send starts as soon as backward has produced the layer. The decider's memory
is two mappings handed to it by :meth:`Decider.use_memory`: ``held`` (what a kept-back layer
holds: threshold's accumulation, select's residual) and ``copies`` (snapshots of values and
optimizer state: :data:`LOCAL_STEP`'s sync points, :data:`WITHHELD`'s withheld layers).
After the data the step's statistics are averaged in one collective; the step counts only if
they and the gradients are finite on every rank, and the next plan comes from them on the
host (:meth:`KeptLayers.settle`). docs/keras.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hvdsync.core.ports import Gradients, TensorOps
from hvdsync.core.technique import LOCAL_STEP, Decider, control_dtype


class KeptLayers:
    """One decider's step in traced form: its memory (installed in the decider in place of
    its dicts) and the pieces of the step an adapter puts together, in this order:
    :meth:`begin`, :meth:`exchange` per layer as backward produces it, :meth:`control`,
    :meth:`commit` (before the update; what it returns, after), :meth:`settle` on the host.

    A traced memory offers, besides the dict interface, ``read(key)`` (the value, or the empty
    one while absent), ``present(key)`` (a device boolean) and ``put(key, value, present)``
    (present and holding ``value`` where the device boolean ``present`` holds)."""

    def __init__(self, decider: Decider, grads: Gradients, ops: TensorOps, held: Any,
                 copies: Any):
        self.decider = decider
        self.grads = grads
        self.ops = ops
        #: kept-back layers take a local step (else they are withheld)
        self.local_step = decider.kept_layers == LOCAL_STEP
        self.held, self.copies = held, copies
        decider.use_memory(held, copies if self.local_step else None)

    def _keys(self, li: int, ks: list[int]) -> list[str]:
        return [self.grads.key(li, k) for k in ks]

    # -- before backward ---------------------------------------------------------------------
    def begin(self, layers: Sequence[tuple[int, list[int]]]) -> None:
        """At trace time: the layers in the step that it governs, ``(li, ks)`` each (every
        traced step has the same), told as an eager step tells them in its ready groups
        (:meth:`Technique.layer_ready`: select's eligibility); the others have none."""
        present = dict(layers)
        for li in range(self.decider.num_layers):
            self.decider.layer_ready(li, present.get(li, []))

    # -- per layer, as backward produces it --------------------------------------------------
    def exchange(self, li: int, ks: list[int], layer: list, send_plan: Any,
                 send: Callable[[list], tuple[list, list]],
                 idle: Callable[[], list] = list) -> tuple[list, Any, Any, list]:
        """``ops.cond(send_plan, send, keep)`` for layer ``li``'s (dense) gradients ``layer``
        (its parameters ``ks``).

        Send: what the layer holds joins the gradient and ``send(xs) -> (reduced, extras)``
        runs (``extras``: what else leaves the branch -- a global clip's norm, a transport's
        staged memory -- and ``idle()``, called in the other branch, what they are when the
        layer is kept: the same structure). Keep: a local step
        with the layer's own gradient, or withheld (zeros; put back after the update).
        Returns the gradients to apply, the extras, and -- apart from the data, so the control
        round can start while the data is still in flight -- the norm of what the layer holds
        after the step (0 when sent) and whether its local gradient is non-finite where it is
        kept (sent data is checked once reduced: identical everywhere)."""
        ops = self.ops
        keys = self._keys(li, ks)
        zero = ops.zero()
        # what the layer holds joins its gradient only while it holds something: a step
        # that sends every layer pays no pass over each layer to add zeros (the Keras lab
        # notes, benchmarks/results/keras_lab_notes.md: "Two passes less")
        with_held = ops.cond(
            self.held.present(keys[0]),
            lambda: [ops.add(g, ops.cast(self.held.read(key), like=g))
                     for g, key in zip(layer, keys)],
            # (a copy where the framework has one: an eager send may reduce in place, and the
            # local gradients are read again by the control round and the commit)
            lambda: [ops.clone(g) for g in layer])

        def go():
            out, extras = send(with_held)
            return [*out, *extras]

        def keep():
            out = (list(layer) if self.local_step  # the local update with its own gradient
                   else [ops.zeros_like(g) for g in layer])  # withheld (put back anyway)
            return [*out, *idle()]
        res = ops.cond(send_plan, go, keep)
        # a branch of its own: a branch's outputs all wait for its slowest op (the send), and
        # the control round should not wait for this layer's data
        held_norm, bad = ops.cond(send_plan, lambda: (zero, zero),
                                  lambda: (ops.norm(with_held), ops.bad(layer)))
        m = len(layer)
        return list(res[:m]), held_norm, bad, list(res[m:])

    # -- after backward ----------------------------------------------------------------------
    def control(self, layers: Sequence[tuple[int, list[int], list]], held_norms: list,
                bads: list, applied: list, reduce: Callable[[str, Any], Any]
                ) -> tuple[Any, Any, Any]:
        """The step's control vector (the eager pipeline's layout and precision:
        :func:`control_dtype`), averaged over ranks by ``reduce(name, vector)`` (one
        collective). ``layers``: ``(li, ks, local gradients)`` as given to :meth:`exchange`,
        with its ``held_norms`` and ``bads``; ``applied``: the gradients to apply. Returns
        (shared, this rank's values, whether the step was finite on every rank: the shared
        flags and statistics, and the gradients to apply -- a kept gradient's NaN is in the
        flags too, so every rank concludes alike)."""
        ops, grads, decider = self.ops, self.grads, self.decider
        n, zero = decider.num_layers, ops.zero()
        at = {li: i for i, (li, _, _) in enumerate(layers)}
        held = [held_norms[at[li]] if li in at else zero for li in range(n)]

        def statistic(name: str) -> list:
            if name == "held":
                return held
            if name == "expected":
                return [ops.add(h, ops.norm(layers[at[li]][2])) if li in at else h
                        for li, h in enumerate(held)]
            if name == "sync_norm":
                return [self._sync_norm(li, layers[at[li]][1]) if li in at else zero
                        for li in range(n)]
            if name in ("dot", "dot_squared"):
                dots = [ops.dot([(g, grads.value(li, k)) for g, k in
                                 zip(layers[at[li]][2], layers[at[li]][1])])
                        if li in at else zero for li in range(n)]
                if name == "dot":
                    return dots
                # squared in float64, as the eager host computes it
                return [ops.cast(d, "float64") * ops.cast(d, "float64") for d in dots]
            raise ValueError(f"hvdsync: no traced form of the control statistic {name!r}")
        values = [x for name in decider.control for x in statistic(name)]
        bad = ops.norm(bads) > 0  # any kept gradient non-finite: 1 (in the vector's dtype)
        local = ops.vector(values + [bad], control_dtype(ops, applied))
        shared = reduce(decider.control_name, local)
        ok = (shared[-1] == 0) & (ops.bad([shared[:-1], *applied]) == 0)
        return shared, local[:-1], ok

    def _sync_norm(self, li: int, ks: list[int]) -> Any:
        """``"sync_norm"``: the layer's parameter norm as of its last sync (both norms and a
        select: cheaper to trace than a branch)."""
        keys = self._keys(li, ks)
        anchored = self.ops.norm([self.copies.read(key)["value"] for key in keys])
        current = self.ops.norm([self.grads.value(li, k) for k in ks])
        return self.ops.where(self.copies.present(keys[0]), anchored, current)

    def commit(self, layers: Sequence[tuple[int, list[int], list]], plan: Any,
               ok: Any) -> Callable[[], None]:
        """Before the update, on a step finite everywhere: sent layers drop what they held
        (local steps: and return to their sync point), kept ones add their gradient to it
        (local steps: taking a sync point before their first one; withheld: copying the
        layer aside). ``layers``: as for :meth:`control`. Returns what to build after the
        update (withheld layers put back).

        One branch per layer, none nested (in a graph a nested branch captures every variable
        of the ones around it: tracing cost grows with depth), taken only by a layer that is
        kept or holds something; inside it, selects instead of further branches."""
        ops = self.ops
        for li, ks, local in layers:
            keys = self._keys(li, ks)
            kept = ~plan[li]
            holding = self.held.present(keys[0])
            anchored = self.copies.present(keys[0]) if self.local_step else holding
            busy = ok & (kept | holding | anchored)
            ops.cond(busy, lambda keys=keys, local=local, kept=kept, anchored=anchored:
                     self._commit_layer(keys, local, kept, anchored), lambda: None)
        if self.local_step:
            return lambda: None
        return lambda: self._put_back_withheld(layers, plan, ok)

    def _commit_layer(self, keys: list[str], local: list, kept: Any, anchored: Any) -> None:
        """One layer's commit (inside its branch): ``local``, its gradients of this step."""
        ops, grads = self.ops, self.grads
        back = ~kept & anchored  # sent after local steps: back to its sync point
        for key, g in zip(keys, local):
            now = grads.snapshot(key)
            if self.local_step:
                sync = self.copies.read(key)
                # a sync point is taken before the first local step and kept until sent
                self.copies.put(key, ops.where(anchored, sync, now), kept)
                grads.restore(key, ops.where(back, sync, now))
            else:  # withheld: copied aside, put back after the update
                self.copies.put(key, now, kept)
            h = self.held.read(key)
            self.held.put(key, ops.add(h, ops.cast(g, like=h)), kept)

    def _put_back_withheld(self, layers: Sequence[tuple[int, list[int], list]], plan: Any,
                           ok: Any) -> None:
        for li, ks, _ in layers:
            keys = self._keys(li, ks)
            self.ops.cond(ok & ~plan[li], lambda keys=keys: self._put_back(keys), lambda: None)

    def _put_back(self, keys: list[str]) -> None:
        for key in keys:
            self.grads.restore(key, self.copies.read(key))

    # -- on the host, after the step ---------------------------------------------------------
    def settle(self, ok: bool, shared: Sequence[float], local: Sequence[float]) -> None:
        """The next plan, from a step finite everywhere (else the plan stands)."""
        if ok:
            self.decider.plan_from(list(shared), list(local))
