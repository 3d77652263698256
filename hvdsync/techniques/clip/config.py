"""``clip=``'s config: the rules and the mode, validated at construction (docs/clip.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from hvdsync.core.config import coerce_config

MODES = ("local", "global")


def _finite(name: str, x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"clip {name} must be a number, got {type(x).__name__} {x!r}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"clip {name} must be finite, got {x}")
    return x


def _pair(name: str, x: Any) -> tuple[float, float]:
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        raise TypeError(f"clip {name} must be a pair of numbers, got {x!r}")
    return _finite(f"{name}[0]", x[0]), _finite(f"{name}[1]", x[1])


@dataclass(frozen=True)
class ClipConfig:
    """Per-layer clipping rules (docs/clip.md), validated at construction. A layer's limit is
    the smallest active one; ``clip=1.0`` is ``ClipConfig(max_norm=1.0)``.

    Args:
        value: ``(low, high)``: clamp every element, before the norm rules.
        max_norm: limit the layer's L2 norm.
        ema: ``(beta, factor)``: limit ``factor`` times the running mean of the layer's norm.
        variance: ``(beta, k)``: limit ``mean + k * std`` of the layer's norm.
        ratio: limit ``ratio * max(norm of the layer's parameters, eps)`` (AGC-style).
        warmup: steps a layer is observed before ``ema`` and ``variance`` apply.
        eps: the floor of the parameter norm for ``ratio``.
        mode: ``"local"``: each rank clips its own gradient before sending it; ``"global"``:
            clip the averaged gradient as each layer arrives.
    """

    value: Optional[tuple[float, float]] = None
    max_norm: Optional[float] = None
    ema: Optional[tuple[float, float]] = None
    variance: Optional[tuple[float, float]] = None
    ratio: Optional[float] = None
    warmup: int = 10
    eps: float = 1e-3
    mode: str = "local"

    def __post_init__(self) -> None:
        if self.value is not None:
            low, high = _pair("value", self.value)
            if not low < high:
                raise ValueError(f"clip value=(low, high) needs low < high, got ({low}, {high})")
            object.__setattr__(self, "value", (low, high))
        if self.max_norm is not None:
            if _finite("max_norm", self.max_norm) <= 0:
                raise ValueError(f"clip max_norm must be > 0, got {self.max_norm}")
            object.__setattr__(self, "max_norm", float(self.max_norm))
        for name in ("ema", "variance"):
            spec = getattr(self, name)
            if spec is not None:
                beta, mult = _pair(name, spec)
                if not 0 < beta < 1:
                    raise ValueError(f"clip {name}=(beta, ...) needs 0 < beta < 1, got {beta}")
                if mult <= 0 if name == "ema" else mult < 0:
                    what = "factor must be > 0" if name == "ema" else "k must be >= 0"
                    raise ValueError(f"clip {name}: {what}, got {mult}")
                object.__setattr__(self, name, (beta, mult))
        if self.ratio is not None:
            if _finite("ratio", self.ratio) <= 0:
                raise ValueError(f"clip ratio must be > 0, got {self.ratio}")
            object.__setattr__(self, "ratio", float(self.ratio))
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"clip warmup must be an int >= 0, got {self.warmup!r}")
        if _finite("eps", self.eps) <= 0:
            raise ValueError(f"clip eps must be > 0, got {self.eps}")
        if self.mode not in MODES:
            raise ValueError(f"clip mode must be one of {MODES}, got {self.mode!r}")
        if not self.has_rule:
            raise ValueError("clip needs at least one rule: value, max_norm, ema, variance "
                             "or ratio")

    @property
    def has_rule(self) -> bool:
        return any(x is not None for x in (self.value, self.max_norm, self.ema,
                                           self.variance, self.ratio))

    @classmethod
    def coerce(cls, clip: Any) -> Optional["ClipConfig"]:
        """``None``, a :class:`ClipConfig`, a dict of its fields, or a number (``max_norm``)."""
        return coerce_config(cls, clip, "clip", "max_norm")
