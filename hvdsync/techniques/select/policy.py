"""``select=``'s policy: the per-step scores and the shared choice of layers, from numbers every
rank shares (no tensors)."""

from __future__ import annotations

import random
from typing import Optional

import numpy as np

from hvdsync.techniques.select.config import SelectConfig
from hvdsync.techniques.select.hypernet import Hypernet, saved_floats

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
