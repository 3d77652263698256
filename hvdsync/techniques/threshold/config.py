"""``threshold=``'s config, validated at construction (docs/threshold.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from hvdsync.core.config import coerce_config

SCOPES = ("layer", "global")


def _optional_positive_int(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"threshold {name} must be None or an int >= 1, got {value!r}")


@dataclass(frozen=True)
class ThresholdConfig:
    """When to communicate an accumulated layer (docs/threshold.md); ``threshold=0.6`` is
    ``ThresholdConfig(0.6)``.

    Args:
        threshold: a layer is sent at the next step once the rank-averaged norm of what it
            will have accumulated reaches this; ``0`` sends every step (Horovod).
        relative: compare against ``threshold`` times the layer's parameter norm.
        scope: ``"layer"`` (a decision per layer) or ``"global"`` (one for the whole model).
        max_skip: send a layer after at most this many skipped steps (``None``: no bound).
        sync_every: send every layer every this many steps (``None``: never forced).
    """

    threshold: float
    relative: bool = False
    scope: str = "layer"
    max_skip: Optional[int] = None
    sync_every: Optional[int] = None

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"threshold must be a number, got {type(t).__name__} {t!r}")
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"threshold must be a finite number >= 0, got {t}")
        object.__setattr__(self, "threshold", float(t))
        if not isinstance(self.relative, bool):
            raise TypeError(f"threshold relative must be True or False, got {self.relative!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"threshold scope must be one of {SCOPES}, got {self.scope!r}")
        _optional_positive_int("max_skip", self.max_skip)
        _optional_positive_int("sync_every", self.sync_every)

    @classmethod
    def coerce(cls, value: Any) -> Optional["ThresholdConfig"]:
        """``None``, a :class:`ThresholdConfig`, a dict of its fields, or a number."""
        return coerce_config(cls, value, "threshold", "threshold")
