"""``select=``'s config, validated at construction (docs/select.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from hvdsync.core.config import coerce_config

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
