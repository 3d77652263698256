"""``sparse=``: sparse grouped allgather for row-sparse gradients (embeddings).

Horovod sends each sparse gradient as it comes out of backward -- every lookup a row, so a
row looked up 50 times in a batch travels 50 times -- as two allgathers (indices, values) per
tensor, and never asks whether a dense allreduce would be cheaper. hvdsync, per step:

1. sums each rank's duplicate rows locally, then shares in **one** small collective the
   number of distinct rows of *every* sparse gradient of the step on every rank (plus, for
   robustness, whether each parameter has a dense, sparse or no gradient on each rank: a rank
   on which an embedding was not used takes part with zero rows instead of hanging);
2. from those counts, which every rank has identically, picks per tensor the same route:

   * ``"gather"``: indices and values packed into one tensor per gradient (indices carried
     bit-for-bit in the value dtype) and all gradients of the step sent in **one** grouped
     allgather. When every rank has the same count the gathered tensor has a fixed shape
     (``ranks x rows``); otherwise ranks contribute different first dimensions (Horovod's
     allgather carries uneven sizes natively, so nothing is padded either way);
   * ``"dense"``: the gathered size would exceed the dense tensor's (``dense_ratio``, default
     1: the allgather's output ``sum_r rows_r x row_bytes`` against the allreduce's ``S``;
     with a ring the per-rank traffic is ``(N-1)/N`` of the former against ``2(N-1)/N`` of
     the latter, and the sparse route must also sort what it receives, so the crossover sits
     near a per-rank density of ``1/N``). The gradient is scattered into a dense buffer with
     one extra "present" column and allreduced like any dense gradient; rows whose present
     column is non-zero are the rows some rank touched, so the result has exactly the rows
     the gather route would give;
   * ``"none"``: no rank has a row; nothing is sent.
3. sums duplicate rows across ranks (and divides by the number of ranks for ``Average``),
   handing the optimizer a coalesced sparse gradient (``SparseAdam`` and ``SGD`` accept it).

Rounds. Each Horovod collective that must finish before the next can start costs a round
trip (negotiation plus transfer), which for small gradients costs more than the bytes.
Counts first, then rows, is two rounds per step where Horovod's own path takes one. So by
default (``one_round=True``) the counts of step ``t`` travel as the first tensor of step
``t``'s grouped allgather, and each gradient takes the route that step ``t - 1``'s counts
chose (shared, so identical on every rank); a wrong guess costs bytes, never correctness.
Gradients with no history yet (the first step, a table first used later) take the
counts-first path in a second round of that step. ``one_round=False`` always shares the
counts first, in a collective of their own, and routes by the current step's counts.

Enabled with ``sparse=True`` (or a :class:`SparseConfig`); without it sparse gradients take
Horovod's own path, and ``sparse_as_dense=True`` keeps Horovod's meaning (the two are
exclusive).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from hvdsync.config import coerce_config

#: Layout codes shared in the counts collective (a count >= 0 means "sparse, that many rows").
DENSE = -1
ABSENT = -2

ROUTES = ("none", "gather", "dense")


@dataclass(frozen=True)
class SparseConfig:
    """How row-sparse gradients travel; see the module docstring.

    ``dense_ratio``: switch a gradient to a dense allreduce when its gathered bytes would
    exceed ``dense_ratio`` times its dense bytes. ``0`` always sends dense, ``math.inf``
    never does. ``one_round``: share the counts in the same grouped allgather as the rows,
    routing each gradient by the previous step's counts (one collective round per step, as
    Horovod's own path); ``False``: counts first in a collective of their own, routes from
    this step's counts (two rounds).
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


def gradient_layouts(codes: Sequence[Sequence[int]], names: Sequence[str]) -> list[str]:
    """Per tensor, ``"sparse"``, ``"dense"`` or ``"absent"`` from every rank's layout codes
    (``codes[rank][tensor]``: a row count, :data:`DENSE` or :data:`ABSENT`).

    A tensor sparse on one rank and dense on another cannot be reduced consistently: every
    rank sees the same codes, so every rank raises the same error instead of hanging.
    """
    out = []
    for t, name in enumerate(names):
        column = [rank_codes[t] for rank_codes in codes]
        sparse = any(c >= 0 for c in column)
        dense = any(c == DENSE for c in column)
        if sparse and dense:
            ranks = [r for r, c in enumerate(column) if c >= 0]
            raise RuntimeError(
                f"the gradient of {name!r} is sparse on rank(s) {ranks} but dense on others; "
                "every rank must produce the same gradient layout (use the same module, or "
                "sparse_as_dense=True)")
        out.append("sparse" if sparse else "dense" if dense else "absent")
    return out


@dataclass(frozen=True)
class SparseRoute:
    """How one sparse gradient travels this step (identical on every rank)."""

    route: str
    counts: tuple[int, ...]
    gathered_bytes: int
    dense_bytes: int

    @property
    def equal_counts(self) -> bool:
        """Every rank has the same number of rows (a fixed-shape gather)."""
        return len(set(self.counts)) == 1


def choose_route(counts: Sequence[int], gathered_row_bytes: int, dense_bytes: int,
                 dense_ratio: float) -> SparseRoute:
    """The route for a gradient with ``counts[r]`` distinct rows on rank ``r``.

    ``gathered_row_bytes`` is what one gathered row costs (values and index), ``dense_bytes``
    the size of the dense tensor an allreduce would carry.
    """
    counts = tuple(int(c) for c in counts)
    gathered = sum(counts) * gathered_row_bytes
    if sum(counts) == 0:
        route = "none"
    elif gathered > dense_ratio * dense_bytes:
        route = "dense"
    else:
        route = "gather"
    return SparseRoute(route, counts, gathered, dense_bytes)
