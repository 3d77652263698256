"""``select=``: hypernet-selected layer pushes with error feedback (a decider).

Each step only some layers are pushed (allreduced) -- ``k`` of them, or as many as fit a
byte ``budget`` -- the others add their gradient to a local residual that goes with their
next push, so nothing a rank computed is lost; ``max_wait`` bounds a layer's wait. The
selector scores the layers: a small hypernet trained on per-layer dot products
``<g_l, theta_l>`` (default), the largest residual norm, random, or round robin. Every
rank's statistics are averaged in one control-plane allreduce per step and every rank
computes the same scores and choice from them (the no-hang rule of docs/design.md); the set
for step ``t + 1`` is chosen at the end of step ``t``, so each pushed layer still starts the
moment backward produces it. docs/select.md says how each selector works and what it costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional


from hvdsync.core.stats import SyncStats
from hvdsync.core.wire import Pending
from hvdsync.core.ports import Communicator, Gradients, TensorOps
from hvdsync.core.technique import WITHHELD, Decider, accumulated, control_part, refill, shared_ok
from hvdsync.techniques.select.config import SelectConfig
from hvdsync.techniques.select.policy import SelectPolicy


class Select(Decider):
    """Per-layer residuals (error feedback), the local statistics the selector needs, and the
    shared choice.

    A layer chosen for this step sends ``g + residual`` (its residual empties); a layer not
    chosen adds ``g`` to its residual and is withheld from the wrapped optimizer
    (:meth:`Gradients.withhold`: torch drops its gradient, Keras puts the layer back after
    the update), so it -- and its momentum or Adam moments -- does not move this step,
    identically on every rank.
    """

    name = "select"
    reads_values = True  # <g, theta> and the values a withheld layer returns to
    per_rank = ("residual",)
    traceable = True
    kept_layers = WITHHELD  # a layer not chosen does not move (its residual kept)

    def __init__(self, config: SelectConfig, grads: Gradients, ops: TensorOps,
                 comm: Communicator, layer_names: list[str], stats: SyncStats):
        self.policy = SelectPolicy(config, len(layer_names))
        self.grads = grads
        self.ops = ops
        self.comm = comm
        self.layer_names = layer_names
        self.num_layers = len(layer_names)
        self.stats = stats
        self.residual: Any = {}  # a dict, or the Keras compiled path's variables (use_memory)
        self._second_order = (self.policy.hypernet is not None
                              and config.objective == "second_order")
        #: the shared statistics: the dot products if the hypernet scores, the residual
        #: norms, their squares with the second-order objective
        self.control = ((("dot",) if self.policy.hypernet is not None else ()) + ("held",)
                        + (("dot_squared",) if self._second_order else ()))
        n = len(layer_names)
        #: per ready group: its layers and their ``<g, theta>`` (a device vector)
        self._dots: list[tuple[list[int], Any]] = []
        self._eligible = [True] * n
        #: each layer's dense gradient bytes (for a byte budget: its parameters', at first use)
        self._bytes: Optional[list[int]] = None
        self._journal: dict[str, Any] = {}  # residuals as they were before this step
        self._withheld: list[tuple[str, Any]] = []  # withheld this step: (key, gradient)
        self._local: Any = None  # this rank's statistics of the step (a device vector)
        self._control: Optional[Pending] = None
        #: the last step's local scores, rank-averaged scores, residual norms and (hypernet)
        #: alpha per layer -- for logging and plots
        self.last: dict[str, list[float]] = {}

    def group_ready(self, layers: list[tuple[int, list[int]]]) -> None:
        """Take the group's statistics (no host sync: device values; a few ops for the whole
        group)."""
        g = self.grads
        for li, ks in layers:
            self.layer_ready(li, ks)
            for k in ks:
                if g.is_row_sparse(li, k):
                    raise ValueError("select= needs dense gradients: pass sparse=True (row-"
                                     "sparse layers then take the sparse exchange every step) "
                                     "or sparse_as_dense=True")
        layers = [(li, ks) for li, ks in layers if ks]
        if self.policy.hypernet is not None and layers:
            # dL/dalpha_l at alpha = 1 for the loss with the layer's weights scaled by alpha
            self._dots.append(([li for li, _ in layers],
                               self.ops.dots([[(g.get(li, k), g.value(li, k)) for k in ks]
                                              for li, ks in layers])))

    def layer_ready(self, li: int, ks: list[int]) -> None:
        """Whether layer ``li`` has gradients this step that it governs (``ks``; else it
        cannot be chosen next): told per ready group in an eager step, once at trace time in
        a traced one."""
        self._eligible[li] = bool(ks)

    def decision(self, li: int) -> bool:
        return self.policy.selected[li]  # chosen at the end of the last step

    def on_send_group(self, layers: list[tuple[int, list[int]]]) -> None:
        """The group's pushed layers send ``g + residual`` (one multi-tensor add for all)."""
        g = self.grads
        owed = []
        for li, ks in layers:
            for k in ks:
                key = g.key(li, k)
                r = self.residual.pop(key, None)
                self._journal.setdefault(key, r)  # to put back if the step is non-finite
                if r is not None:
                    owed.append((li, k, r))
        if owed:  # (in place where the framework allows)
            for (li, k, _), x in zip(owed, self.ops.accumulate_all(
                    [g.get(li, k) for li, k, _ in owed], [r for _, _, r in owed])):
                g.set(li, k, x)

    def on_skip(self, li: int, ks: list[int]) -> None:
        """The layer is withheld; its gradient joins its residual (for every withheld layer
        at once, in :meth:`share`)."""
        g = self.grads
        for k in ks:
            key = g.key(li, k)
            self._journal.setdefault(key, self.residual.get(key))
            self._withheld.append((key, g.get(li, k)))
            g.withhold(li, k)

    def _withhold_all(self) -> None:
        """The withheld gradients join their residuals (one add and one copy for all)."""
        kept, self._withheld = self._withheld, []
        self.residual.update(accumulated(self.ops, self.residual, kept))

    def share(self, local_bad: Any) -> None:
        """Start the control-plane allreduce of every rank's dot products and residual norms
        (and whether its gradients were finite): the next step's layers come from it."""
        n, g, ops = len(self.layer_names), self.grads, self.ops
        self._withhold_all()
        holding = []
        if self.residual:
            keys = [[g.key(li, k) for k in range(g.size(li))] for li in range(n)]
            holding = [li for li in range(n) if any(key in self.residual for key in keys[li])]
        norms = ops.in_layer_order(n, [(holding, ops.norms(
            [[self.residual[key] for key in keys[li] if key in self.residual]
             for li in holding]))] if holding else [])
        parts = [norms]
        if self.policy.hypernet is not None:
            dots = ops.in_layer_order(n, self._dots)
            parts.insert(0, dots)
            if self._second_order:  # the rank average of the squares: a curvature estimate
                wide = ops.cast(dots, "float64")  # (squared in float64, as Keras' trace does)
                parts.append(ops.mul(wide, wide))
        self._dots = []
        dtype = self.control_dtype_of(ops, g)
        self._local = ops.concat(parts, dtype)
        self._control = self.comm.control_async(ops.concat([self._local, local_bad], dtype),
                                                self.control_name, dtype)

    def settle(self, data_ok: bool) -> bool:
        """Take the next step's layers from the shared statistics; a non-finite step puts
        the residuals back and leaves the selector as it was."""
        shared = self._control.wait()
        local = self.ops.read([self._local])[0] if self._local is not None else []
        self._control, self._local = None, None
        journal, self._journal = self._journal, {}
        if not (data_ok and shared_ok(shared)):
            for key, r in journal.items():  # nothing of this step is kept
                if r is None:
                    self.residual.pop(key, None)
                else:
                    self.residual[key] = r
            return False
        self.plan_from(shared, local)
        return True

    def use_memory(self, held: Any, sync_points: Any) -> None:
        self.residual = held

    def plan_from(self, shared: Sequence[float], local: Sequence[float]) -> None:
        """The next step's layers from the shared statistics (:attr:`control`); this rank's
        own residual norms go to the stats."""
        n, control = len(self.layer_names), self.control
        dots = control_part(shared, control, "dot", n)
        shared_dots = dots if dots is not None else [0.0] * n
        shared_norms = control_part(shared, control, "held", n)
        self.policy.pushed(list(self.policy.selected))  # round_robin scores by the waits
        scores = self.policy.scores(shared_dots, shared_norms,
                                    control_part(shared, control, "dot_squared", n))
        if self._bytes is None:
            self._bytes = [self.grads.layer_bytes(li) for li in range(n)]
        self.policy.choose(scores, list(self._eligible), self._bytes)
        own = control_part(local, control, "held", n)
        self.stats.count("residual_norm", sum(x * x for x in own) ** 0.5)
        self.last = {"scores": scores, "residual_norms": shared_norms}
        if self.policy.hypernet is not None:
            self.last["dots"] = shared_dots
            self.last["alpha"] = self.policy.prev_alpha.tolist()

    def state_dict(self) -> dict:
        """Shared: the selector (hypernet and its Adam state, score EMA, wait counters, the
        next step's layers). Per rank: the residuals."""
        return {"policy": self.policy.state_dict(),
                "residual": {k: self.grads.to_saved(k, v) for k, v in self.residual.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.forget()
        refill(self.residual, {k: self.grads.from_saved(k, v)
                               for k, v in state.get("residual", {}).items()})

    def forget(self) -> None:
        self.residual.clear()
        self._journal.clear()
        self._withheld = []
        self._dots = []

    def status(self) -> dict:
        """The last step's per-layer ``scores``, rank-averaged ``residual_norms`` and
        (hypernet) ``dots`` and ``alpha``, and the layers chosen for the next step (``next``,
        layer names); with a byte budget, ``credit`` (bytes granted and not yet used)."""
        nxt = [name for name, s in zip(self.layer_names, self.policy.selected) if s]
        extra = {"credit": self.policy.credit} if self.policy.config.budget is not None else {}
        return {**self.last, "next": nxt, **extra}
