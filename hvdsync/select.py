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

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from hvdsync.config import coerce_config
from hvdsync.stats import SyncStats
from hvdsync.pending import Pending
from hvdsync.ports import Communicator, Gradients, TensorOps
from hvdsync.select_hypernet import Hypernet, saved_floats
from hvdsync.technique import Decider, accumulated, control_part, refill, shared_ok

SELECTORS = ("hypernet", "norm", "random", "round_robin")
OBJECTIVES = ("first_order", "second_order")
INPUTS = ("embedding", "statistics")


@dataclass(frozen=True)
class SelectConfig:
    """Which layers to push each step (docs/select.md).

    Args:
        k: layers pushed per step, an int >= 1 or a fraction in (0, 1] of the layers (rounded
            up; 0.25 when neither ``k`` nor ``budget`` is given).
        budget: instead of ``k``, the dense gradient bytes pushed per step on average, an
            int >= 1 or a fraction in (0, 1] of the model's.
        selector: ``"hypernet"`` (learned), ``"norm"``, ``"random"`` or ``"round_robin"``.
        max_wait: a layer is pushed at least every ``max_wait + 1`` steps (``None``: no bound).
        ema: the hypernet's score smoothing.
        embed_dim: the hypernet's input embedding size.
        hidden: the hypernet's hidden width.
        lr: the hypernet's Adam learning rate.
        seed: initialises the hypernet and the random selector.
        objective: what the hypernet learns (docs/select.md).
        inputs: what the hypernet reads (docs/select.md).
    """

    k: Union[int, float, None] = None
    budget: Union[int, float, None] = None
    selector: str = "hypernet"
    max_wait: Optional[int] = 4
    ema: float = 0.9
    embed_dim: int = 8
    hidden: int = 16
    lr: float = 0.01
    seed: int = 0
    objective: str = "second_order"
    inputs: str = "statistics"

    def __post_init__(self) -> None:
        if self.k is not None and self.budget is not None:
            raise ValueError(f"select takes k (layers per step) or budget (bytes per step), not "
                             f"both: got k={self.k!r}, budget={self.budget!r}")
        for name, unit in (("k", "layers"), ("budget", "bytes")):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"select {name} must be an int or a fraction, got "
                                f"{type(v).__name__} {v!r}")
            if isinstance(v, int) and v < 1:
                raise ValueError(f"select {name} must be >= 1 {unit}, got {v}")
            if isinstance(v, float) and not 0 < v <= 1:
                raise ValueError(f"select {name} as a fraction must be in (0, 1], got {v}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"select objective must be one of {OBJECTIVES}, got "
                             f"{self.objective!r}")
        if self.inputs not in INPUTS:
            raise ValueError(f"select inputs must be one of {INPUTS}, got {self.inputs!r}")
        if self.selector not in SELECTORS:
            raise ValueError(f"select selector must be one of {SELECTORS}, got {self.selector!r}")
        if self.max_wait is not None and (isinstance(self.max_wait, bool)
                                          or not isinstance(self.max_wait, int)
                                          or self.max_wait < 0):
            raise ValueError(f"select max_wait must be None or an int >= 0, got {self.max_wait!r}")
        if not (isinstance(self.ema, (int, float)) and 0 <= self.ema < 1):
            raise ValueError(f"select ema must be in [0, 1), got {self.ema!r}")
        for name in ("embed_dim", "hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"select {name} must be an int >= 1, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"select lr must be a finite number > 0, got {self.lr!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"select seed must be an int, got {self.seed!r}")

    @classmethod
    def coerce(cls, value: Any) -> Optional["SelectConfig"]:
        """``None``, a :class:`SelectConfig`, a dict of its fields, or a number (``k``)."""
        return coerce_config(cls, value, "select", "k")

    def layers_per_step(self, num_layers: int) -> int:
        """``k`` as a number of layers (0.25 of them when neither ``k`` nor ``budget`` is
        given; with a ``budget`` the count is whatever fits, see :meth:`budget_bytes`)."""
        k = 0.25 if self.k is None else self.k
        if isinstance(k, float):
            return max(1, math.ceil(k * num_layers))
        return min(k, num_layers)

    def budget_bytes(self, dense_bytes: int) -> Optional[float]:
        """The byte budget per step given the selectable layers' ``dense_bytes`` (None: the
        budget is a layer count)."""
        if self.budget is None:
            return None
        return self.budget * dense_bytes if isinstance(self.budget, float) else float(self.budget)


class SelectPolicy:
    """Per-step scores (from shared statistics), and the shared choice -- top ``k`` layers,
    or the best-scored layers that fit the byte budget -- with the wait bound.

    Byte budget: ``credit`` grows by the budget every step and pays for the layers chosen;
    layers are taken in score order while the next one fits, and the first that does not
    ends the choice (its bytes are saved up for: a large layer ranked first is not starved
    by small ones). Forced layers (wait bound) are paid first and may overdraw the credit,
    which later steps then repay, so the bytes per step average the budget."""

    def __init__(self, config: SelectConfig, num_layers: int):
        self.config = config
        self.num_layers = num_layers
        self.k = config.layers_per_step(num_layers)
        features = num_layers if config.inputs == "statistics" else 0
        self.hypernet = (Hypernet(num_layers, config.embed_dim, config.hidden, config.lr,
                                  config.seed, features)
                         if config.selector == "hypernet" else None)
        self.prev_alpha = self.hypernet.alpha() if self.hypernet is not None else None
        self.ema = np.zeros(num_layers)
        self.waited = [0] * num_layers
        self.step = 0
        self.credit = 0.0  # bytes the budget has granted and no layer has used yet
        #: the layers to push at the next step (step 1: all)
        self.selected = [True] * num_layers

    def scores(self, dots: list[float], acc_norms: list[float],
               curvature: Optional[list[float]] = None) -> list[float]:
        """The score per layer from the rank-averaged ``<g_l, theta_l>``, residual norms
        and (hypernet, ``objective="second_order"``) rank-averaged ``<g_l, theta_l>^2`` (a
        hypernet step: call once per model step)."""
        c = self.config
        if c.selector == "hypernet":
            features = None
            if c.inputs == "statistics":  # scale-free: each norm against the layers' mean
                norms = np.asarray(acc_norms, dtype=float)
                features = np.log1p(norms / max(float(norms.mean()), 1e-30))
            alpha = self.hypernet.step(
                np.asarray(dots, dtype=float),
                None if curvature is None else np.asarray(curvature, dtype=float), features)
            self.ema = c.ema * self.ema + (1 - c.ema) * np.abs(alpha - self.prev_alpha)
            self.prev_alpha = alpha
            return self.ema.tolist()
        if c.selector == "norm":
            return list(acc_norms)
        if c.selector == "round_robin":  # the longest wait first (ties: layer order)
            return [float(w) for w in self.waited]
        # random: the same draw on every rank (seeded by the step, not by the rank)
        rng = random.Random(c.seed * 1_000_003 + self.step)
        return [rng.random() for _ in range(self.num_layers)]

    def choose(self, scores: list[float], eligible: Optional[list[bool]] = None,
               layer_bytes: Optional[list[int]] = None) -> list[bool]:
        """The layers to push next step from rank-averaged ``scores`` (same on every rank).
        Layers not ``eligible`` (no dense gradient: they go by the sparse exchange every
        step) are not ranked and count neither toward ``k``, the budget nor the wait bound.
        ``layer_bytes`` (each layer's dense gradient bytes) is needed with a byte budget."""
        self.step += 1
        n, bound = self.num_layers, self.config.max_wait
        if eligible is None:
            eligible = [True] * n
        candidates = [i for i in range(n) if eligible[i]]
        # a layer not chosen now would have waited waited+1 steps; force it at the bound
        forced = [i for i in candidates if bound is not None and self.waited[i] + 1 > bound]
        rest = sorted((i for i in candidates if i not in set(forced)),
                      key=lambda i: (-scores[i], i))
        if self.config.budget is None:
            k = self.k if len(candidates) == n else self.config.layers_per_step(len(candidates))
            chosen = set(forced) | set(rest[:max(0, k - len(forced))])
        else:
            if layer_bytes is None:
                raise ValueError("a byte budget needs the layers' sizes")
            budget = self.config.budget_bytes(sum(layer_bytes[i] for i in candidates))
            largest = max((layer_bytes[i] for i in candidates), default=0)
            self.credit = min(self.credit + budget, budget + largest)
            chosen = set(forced)
            self.credit -= sum(layer_bytes[i] for i in forced)
            for i in rest:
                if layer_bytes[i] > self.credit:
                    break
                chosen.add(i)
                self.credit -= layer_bytes[i]
        self.selected = [i in chosen or not eligible[i] for i in range(n)]
        return list(self.selected)

    def pushed(self, mask: list[bool]) -> None:
        """Record which layers were pushed this step (for the wait bound)."""
        self.waited = [0 if m else w + 1 for m, w in zip(mask, self.waited)]

    def state_dict(self) -> dict:
        return {"hypernet": self.hypernet.state_dict() if self.hypernet is not None else None,
                "prev_alpha": None if self.prev_alpha is None else self.prev_alpha.copy(),
                "ema": self.ema.copy(), "waited": list(self.waited), "step": self.step,
                "selected": list(self.selected), "credit": self.credit}

    def load_state_dict(self, state: dict) -> None:
        if len(state["waited"]) != self.num_layers:
            raise ValueError(f"select state is for {len(state['waited'])} layers, this "
                             f"optimizer has {self.num_layers}")
        if self.hypernet is not None:
            self.hypernet.load_state_dict(state["hypernet"])
            self.prev_alpha = saved_floats(state["prev_alpha"])
        self.ema = saved_floats(state["ema"])
        self.waited = list(state["waited"])
        self.step = int(state["step"])
        self.selected = list(state["selected"])
        self.credit = float(state.get("credit", 0.0))


class SelectedPushes(Decider):
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
        self._bytes = [0] * n  # each layer's dense gradient bytes (for a byte budget)
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
            self.layer_seen(li, bool(ks), lambda li=li: g.payload_bytes(li))
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

    def layer_seen(self, li: int, present: bool, nbytes: Callable[[], int]) -> None:
        """Whether layer ``li`` has gradients this step (else it cannot be chosen next), and
        its dense bytes (``nbytes()``, asked once) for a byte budget."""
        self._eligible[li] = present
        if present and not self._bytes[li]:
            self._bytes[li] = nbytes()

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
