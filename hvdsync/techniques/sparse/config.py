"""``sparse=``'s config, validated at construction (docs/sparse.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from hvdsync.core.config import coerce_config

@dataclass(frozen=True)
class SparseConfig:
    """How row-sparse gradients travel (docs/sparse.md).

    Args:
        dense_ratio: switch a gradient to a dense allreduce when its gathered bytes would
            exceed ``dense_ratio`` times its dense bytes. ``0`` always sends dense,
            ``math.inf`` never does.
        one_round: share the counts in the same grouped allgather as the rows, routing each
            gradient by the previous step's counts (one collective round per step, as
            Horovod's own path); ``False``: counts first in a collective of their own, routes
            from this step's counts (two rounds).
    """

    dense_ratio: float = 1.0
    one_round: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.one_round, bool):
            raise TypeError(f"sparse one_round must be True or False, got {self.one_round!r}")
        r = self.dense_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise TypeError(f"sparse dense_ratio must be a number, got {type(r).__name__} {r!r}")
        if math.isnan(r) or r < 0:
            raise ValueError(f"sparse dense_ratio must be >= 0 (math.inf: never dense), got {r}")
        object.__setattr__(self, "dense_ratio", float(r))

    @classmethod
    def coerce(cls, value: Any) -> Optional["SparseConfig"]:
        """``None``/``False`` (off), ``True`` (defaults), a :class:`SparseConfig`, a dict of its
        fields, or a number (``dense_ratio``)."""
        if value is False:
            return None
        if value is True:
            return cls()
        return coerce_config(cls, value, "sparse", "dense_ratio")
