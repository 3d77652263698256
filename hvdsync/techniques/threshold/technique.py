"""``threshold=``: accumulation thresholds -- communicate a layer only when what it has
accumulated is large enough (a decider).

Each rank adds every step's gradient of a layer to a local accumulation. At the end of a step
one control-plane allreduce shares every layer's *expected* accumulation at the next step
(the norm of what it holds plus the norm of one more gradient); from those identical numbers
every rank takes the same send/skip plan for the next step, so each planned layer still starts
in backward. A skipped layer takes a local step with this rank's gradient; when it next
syncs, its parameters and optimizer state go back to their last sync (identical on every
rank) and take one step with the rank-averaged sum of everything accumulated since, so the
replicas agree again. Nothing is lost; a threshold of 0 equals Horovod. docs/threshold.md has
the rules (``relative``, ``max_skip``, ``sync_every``, ``scope``) and what they cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

from hvdsync.core.wire import Pending
from hvdsync.core.ports import Communicator, Gradients, TensorOps
from hvdsync.core.technique import LOCAL_STEP, Decider, accumulated, control_part, refill, shared_ok
from hvdsync.techniques.threshold.config import ThresholdConfig


class ThresholdPolicy:
    """The per-step send/skip plan (identical on every rank given identical inputs) and its
    state: consecutive skips per layer (counting the step planned) and ``step``, the steps
    planned so far (the current plan is for step ``step``)."""

    def __init__(self, config: ThresholdConfig, num_layers: int):
        self.config = config
        self.skipped_for = [0] * num_layers
        self.step = 0

    def decide(self, acc_norms: list[float],
               param_norms: Optional[list[float]] = None) -> list[bool]:
        """Which layers to send in the next step, from rank-averaged norms (shared values
        only); ``param_norms`` is needed only with ``relative=True``."""
        c = self.config
        if c.relative and param_norms is None:
            raise ValueError("a relative threshold needs the layers' parameter norms")
        if param_norms is None:
            param_norms = [1.0] * len(acc_norms)
        self.step += 1
        n = len(acc_norms)
        if c.sync_every is not None and self.step % c.sync_every == 0:
            send = [True] * n
        elif c.scope == "global":
            total = math.sqrt(sum(x * x for x in acc_norms))
            limit = c.threshold * (math.sqrt(sum(x * x for x in param_norms))
                                   if c.relative else 1.0)
            forced = c.max_skip is not None and max(self.skipped_for, default=0) >= c.max_skip
            send = [total >= limit or forced] * n
        else:
            send = []
            for norm, pnorm, skipped in zip(acc_norms, param_norms, self.skipped_for):
                limit = c.threshold * (pnorm if c.relative else 1.0)
                send.append(norm >= limit or (c.max_skip is not None and skipped >= c.max_skip))
        self.skipped_for = [0 if s else k + 1 for s, k in zip(send, self.skipped_for)]
        return send

    def state_dict(self) -> dict:
        return {"skipped_for": list(self.skipped_for), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        if len(state["skipped_for"]) != len(self.skipped_for):
            raise ValueError(f"threshold state is for {len(state['skipped_for'])} layers, "
                             f"this optimizer has {len(self.skipped_for)}")
        self.skipped_for = list(state["skipped_for"])
        self.step = int(state["step"])


class Threshold(Decider):
    """Per-layer local accumulation, the shared send/skip plan, and reconciliation.

    ``acc[key]`` holds the gradients of a parameter summed since its layer last synced
    (present only while the layer skips: a layer sent every step costs no copy).
    ``anchor[key]`` holds the parameter and its optimizer state as they were at that sync
    (taken when the first local-only update is about to happen), restored right before the
    layer's next sync. Keys are :meth:`Gradients.key` (a parameter's position). ``plan``: the
    layers that go this step, chosen at the end of the last one.
    """

    name = "threshold"
    reads_values = True  # sync points snapshot the parameters
    per_rank = ("acc", "anchor", "local")
    kept_layers = LOCAL_STEP  # provisional local steps from a sync point
    traceable = True

    def __init__(self, config: ThresholdConfig, grads: Gradients, ops: TensorOps,
                 comm: Communicator, num_layers: int):
        self.policy = ThresholdPolicy(config, num_layers)
        self.grads = grads
        self.ops = ops
        self.comm = comm
        self.num_layers = num_layers
        self.acc: Any = {}  # dicts, or the Keras compiled path's variables (use_memory)
        self.anchor: Any = {}
        #: the shared statistics: expected accumulation norms (with ``relative``, the
        #: parameter norms at the last sync too)
        self.control = ("expected", "sync_norm") if config.relative else ("expected",)
        # step 1: nothing accumulated yet (only a threshold of 0 or sync_every=1 sends)
        self.plan = self.policy.decide([0.0] * num_layers,
                                       [1.0] * num_layers if config.relative else None)
        self._new_step()

    def _new_step(self) -> None:
        self._candidate: dict[str, Any] = {}  # skipped: acc + this step's gradient
        self._synced: list[str] = []  # sent this step: acc goes, the anchor is restored
        self._kept: list[tuple[str, Any]] = []  # kept back this step: (key, gradient)
        #: per ready group: its layers and the norms of their gradients (a device vector)
        self._grad_norms: list[tuple[list[int], Any]] = []
        self._control: Optional[Pending] = None

    def decision(self, li: int) -> bool:
        return self.plan[li]

    def group_ready(self, layers: list[tuple[int, list[int]]]) -> None:
        """Take the norms of the group's gradients (device values: no host sync in backward;
        a few ops for the whole group)."""
        g = self.grads
        layers = [(li, ks) for li, ks in layers if ks]
        for li, ks in layers:
            for k in ks:
                if g.is_row_sparse(li, k):
                    raise ValueError("threshold= needs dense gradients: pass sparse=True (row-"
                                     "sparse layers then take the sparse exchange every step) "
                                     "or sparse_as_dense=True")
        if layers:
            self._grad_norms.append(([li for li, _ in layers],
                                     self.ops.norms([[g.get(li, k) for k in ks]
                                                     for li, ks in layers])))

    def on_send_group(self, layers: list[tuple[int, list[int]]]) -> None:
        """The group's layers that sync now send their accumulations with this step's
        gradients (one multi-tensor add for all of them)."""
        g = self.grads
        owed = []
        for li, ks in layers:
            for k in ks:
                key = g.key(li, k)
                if key in self.acc:
                    owed.append((li, k, key))
                self._synced.append(key)
        if owed:
            for (li, k, _), x in zip(owed, self.ops.add_all(
                    [self.acc[key] for _, _, key in owed], [g.get(li, k) for li, k, _ in owed])):
                g.set(li, k, x)

    def on_skip(self, li: int, ks: list[int]) -> None:
        """The layer stays local this step: its gradient joins the accumulation (computed
        for every kept layer at once in :meth:`share`, committed in :meth:`settle` if the
        step is finite everywhere)."""
        g = self.grads
        self._kept += [(g.key(li, k), g.get(li, k)) for k in ks]

    def _accumulate_kept(self) -> None:
        """The kept layers' candidates: accumulation + this step's gradient (one add and one
        copy for all of them)."""
        kept, self._kept = self._kept, []
        self._candidate.update(accumulated(self.ops, self.acc, kept))

    def share(self, local_bad: Any) -> None:
        """Start the control-plane allreduce of every layer's *expected* accumulation at the
        next step -- the norm of what it holds after this step (0 if it synced) plus the norm
        of this step's gradient, the size of one more -- with ``relative``, the parameter norm
        as of the layer's last sync, and whether this rank's gradients were finite."""
        g, ops, n = self.grads, self.ops, self.num_layers
        self._accumulate_kept()
        # built on the device and sent without a host read: a few ops for every layer
        expected = ops.in_layer_order(n, self._grad_norms)
        keys = ([[g.key(li, k) for k in range(g.size(li))] for li in range(n)]
                if self._candidate or self.policy.config.relative else [])
        if self._candidate:
            holding = [li for li in range(n) if any(key in self._candidate for key in keys[li])]
            held = ops.norms([[self._candidate[key] for key in keys[li] if key in self._candidate]
                              for li in holding])
            expected = ops.add(expected, ops.in_layer_order(n, [(holding, held)]))
        parts = [expected]
        if self.policy.config.relative:  # identical on every rank
            parts.append(ops.norms([[self.anchor[key]["value"] if key in self.anchor
                                     else g.value(li, k) for k, key in enumerate(keys[li])]
                                    for li in range(n)]))
        vector = ops.concat(parts + [local_bad], self.control_dtype_of(ops, g))
        self._control = self.comm.control_async(vector, self.control_name,
                                                self.control_dtype_of(ops, g))

    def settle(self, data_ok: bool) -> bool:
        """If the step was finite on every rank: synced layers drop their accumulation and
        return to their sync point (before the optimizer step applies the averaged sum),
        skipped ones keep their new accumulation, and the next step's plan is taken from the
        shared norms. If not: nothing of the step is kept and the plan stands."""
        shared = self._control.wait()
        ok = data_ok and shared_ok(shared)
        if ok:
            g = self.grads
            for key in self._synced:
                self.acc.pop(key, None)
                anchor = self.anchor.pop(key, None)
                if anchor is not None:
                    g.restore(key, anchor)
            for key, cand in self._candidate.items():
                self.acc[key] = cand
                if key not in self.anchor:  # the first local-only update is next
                    self.anchor[key] = g.snapshot(key)
            self.plan_from(shared, ())  # (the plan reads shared values only)
        self._new_step()
        return ok

    def use_memory(self, held: Any, sync_points: Any) -> None:
        self.acc, self.anchor = held, sync_points

    def plan_from(self, shared: Sequence[float], local: Sequence[float]) -> None:
        """The next plan from the shared expected accumulation norms (and, ``relative``,
        parameter norms)."""
        n = self.num_layers
        self.plan = self.policy.decide(control_part(shared, self.control, "expected", n),
                                       control_part(shared, self.control, "sync_norm", n))

    def flush_replicas(self) -> int:
        """Synchronize every layer that is skipping now, as its due sync would: the ranks'
        accumulations reduced (the user's op and compression, one grouped collective), the
        layer back at its sync point, and one optimizer step with the reduced sum. Afterwards
        every replica is identical and nothing accumulated is lost or counted twice. Which
        layers skip comes from the shared plan, so every rank flushes the same keys."""
        g = self.grads
        keys = sorted(self.anchor, key=int)
        if not keys:
            return 0
        anchors = {key: self.anchor[key] for key in keys}
        pending = self.comm.allreduce("hvdsync.flush.threshold",
                                      [self.ops.clone(self.acc[key]) for key in keys])
        self.comm.dispatch()
        reduced = pending.wait()
        for key in keys:  # (Keras keeps these per layer: a layer's first key empties it)
            g.restore(key, anchors[key])
            self.anchor.pop(key, None)
            self.acc.pop(key, None)
        g.update_only(dict(zip(keys, reduced)))
        flushed = set(keys)
        self.policy.skipped_for = [
            0 if flushed.intersection(g.param_keys(li)) else skipped
            for li, skipped in enumerate(self.policy.skipped_for)]
        return 0

    def state_dict(self) -> dict:
        """Shared: the skip counters and step. Per rank: the unsent accumulations, the sync
        points (parameters and optimizer state) of layers that are skipping, and where this
        rank's local steps have taken those parameters (``local``: replicas differ there, so
        a model saved by one rank does not hold the others')."""
        g = self.grads
        return {"policy": self.policy.state_dict(), "plan": list(self.plan),
                "acc": {k: g.to_saved(k, v) for k, v in self.acc.items()},
                "anchor": {k: g.to_saved(k, v) for k, v in self.anchor.items()},
                "local": {k: g.to_saved(k, g.snapshot(k)) for k in self.anchor}}

    def load_state_dict(self, state: dict) -> None:
        """Without the per-rank part (another rank's checkpoint), the layers continue from the
        parameters loaded with the model and forget what they had not sent."""
        g = self.grads
        self.policy.load_state_dict(state["policy"])
        # (a checkpoint without a plan: sync every layer next step, which is always safe)
        self.plan = [bool(x) for x in state.get("plan", [True] * self.num_layers)]
        self._new_step()
        refill(self.acc, {k: g.from_saved(k, v) for k, v in state.get("acc", {}).items()})
        refill(self.anchor, {k: g.from_saved(k, v) for k, v in state.get("anchor", {}).items()})
        for k, snap in state.get("local", {}).items():
            g.restore(k, g.from_saved(k, snap))

    def forget(self) -> None:
        """Drop unsent accumulations and sync points (after restoring a checkpoint that has
        none they would roll layers back to values from before it)."""
        self.acc.clear()
        self.anchor.clear()
        self._new_step()

    def status(self) -> dict:
        return {"step": self.policy.step, "skipped_for": list(self.policy.skipped_for),
                "next": list(self.plan)}
