"""``lowrank=``'s config, validated at construction (docs/lowrank.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from hvdsync.core.config import coerce_config

@dataclass(frozen=True)
class LowRankConfig:
    """Low-rank compression of weight matrices (docs/lowrank.md).

    Args:
        rank: columns of the factors (higher: closer to the plain average, more bytes).
        warmup_steps: steps sent plain before compression starts.
        min_compression: a matrix is compressed only when its factors are at least this many
            times smaller than it (``0``: every matrix, whatever the rank).
        seed: of the first ``Q`` (the same on every rank).
        bucket_bytes: consecutive layers (in backward order) share their P and Q rounds until
            their factors reach this many bytes -- fewer collectives, each a little later;
            ``0``: every layer has its own rounds (as in Keras' compiled step beside a
            decider, whose branches send one layer each).
    """

    rank: int = 4
    warmup_steps: int = 10
    min_compression: float = 2.0
    seed: int = 0
    bucket_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "warmup_steps", "seed", "bucket_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"lowrank {name} must be an int, got {type(v).__name__} {v!r}")
        if self.rank < 1:
            raise ValueError(f"lowrank rank must be >= 1, got {self.rank}")
        if self.warmup_steps < 0:
            raise ValueError(f"lowrank warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.bucket_bytes < 0:
            raise ValueError(f"lowrank bucket_bytes must be >= 0, got {self.bucket_bytes}")
        c = self.min_compression
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) \
                or c < 0:
            raise ValueError(f"lowrank min_compression must be a finite number >= 0, got {c!r}")

    @classmethod
    def coerce(cls, value: Any) -> Optional["LowRankConfig"]:
        """``None``, a :class:`LowRankConfig`, a dict of its fields, or an int (the rank)."""
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return coerce_config(cls, value, "lowrank", "rank")
