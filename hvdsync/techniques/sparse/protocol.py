"""``sparse=``: sparse grouped allgather for row-sparse gradients (embeddings).

Horovod sends each sparse gradient as backward made it (a row looked up 50 times travels 50
times), as two allgathers per tensor. hvdsync, per step: sums duplicate rows locally; shares
every sparse gradient's distinct-row count on every rank (counts first; a rank that did not
use a table takes part with zero rows instead of hanging); and from those shared counts picks
the same route per tensor on every rank -- ``"gather"`` (indices and values packed, every
gradient of the step in one grouped allgather), ``"dense"`` (scattered into a dense buffer with
a "present" column and allreduced, where that is smaller: ``dense_ratio``) or ``"none"``. With
``one_round=True`` (default) the counts ride in the step's allgather and each gradient takes
the route the last step's counts chose (a wrong guess costs bytes, never correctness). The
result is a coalesced sparse gradient. docs/sparse.md has the routes and what they cost; the
exchange that moves the rows: hvdsync/techniques/sparse/exchange.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from hvdsync.core.stats import SyncStats
from hvdsync.core.technique import Transport
from hvdsync.techniques.sparse.config import SparseConfig

#: Layout codes shared in the counts collective (a count >= 0 means "sparse, that many rows").
DENSE = -1
ABSENT = -2

ROUTES = ("none", "gather", "dense")


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


class SparseProtocol:
    """What the sparse exchange decides alike in every adapter, on parameter positions ``i``
    (the fixed order of the wrapped optimizer's parameters): each rank's layout codes, the
    shared layouts and counts, every gradient's route -- from this step's counts, or with
    ``one_round`` predicted from the last step's --, the counters and the last step's routes.
    The adapter moves the tensors (packing, the grouped allgather with the codes as its
    first tensor, the dense route's "present" column) and calls it at these moments:
    :meth:`begin` (this rank's codes), :meth:`absorb` (every rank's, once shared),
    :meth:`take` (a gradient's route this step), :meth:`end_step`."""

    def __init__(self, config: SparseConfig, names: Sequence[str], stats: SyncStats):
        self.config = config
        self.names = list(names)
        self.stats = stats
        #: this step's shared layouts, once known: i -> (layout, per-rank counts, sparse_dim)
        self.layout: dict[int, tuple[str, list[int], int]] = {}
        #: the last layout seen with a gradient somewhere: i -> (layout, sparse_dim)
        self.known: dict[int, tuple[str, int]] = {}
        #: ``one_round``: this step's route per sparse parameter, from the last step's counts
        self.predicted: dict[int, str] = {}
        self.taken: dict[int, str] = {}  # this step's route per parameter
        self.codes: list[int] = []  # this rank's codes this step (count or layout, sparse_dim)
        #: the last step's route, per-rank row counts and rows handed to the optimizer (after
        #: summing duplicates across ranks) per sparse parameter name, for logging and tests
        self.last_routes: dict[str, tuple[str, tuple[int, ...], int]] = {}
        self._nothing_sparse_said = False  # (the warning of :meth:`_warn_if_nothing_sparse`)

    def begin(self, local: Sequence[tuple[int, int]]) -> list[int]:
        """A new step: per parameter this rank's code (distinct rows, :data:`DENSE` or
        :data:`ABSENT`) and sparse dimensions; returns the codes every rank must share
        (flat: code, sparse_dim per parameter)."""
        self.layout = {}
        self.codes = [x for code_and_dim in local for x in code_and_dim]
        return self.codes

    def absorb(self, rows: Sequence[Sequence[int]]) -> None:
        """Every rank's codes (``rows[rank]``, as :meth:`begin` returned them), shared."""
        layouts = gradient_layouts([r[0::2] for r in rows], self.names)
        for i, (name, layout) in enumerate(zip(self.names, layouts)):
            sparse_dims = {r[2 * i + 1] for r in rows if r[2 * i] >= 0}
            if len(sparse_dims) > 1:
                raise RuntimeError(f"the sparse gradient of {name!r} has different sparse_dim "
                                   f"on different ranks: {sorted(sparse_dims)}")
            sdim = sparse_dims.pop() if sparse_dims else 0
            self.layout[i] = (layout, [max(r[2 * i], 0) for r in rows], sdim)
            if layout != "absent":
                self.known[i] = (layout, sdim)
        self._warn_if_nothing_sparse()

    def _warn_if_nothing_sparse(self) -> None:
        """Once, at the first step where every gradient is there: ``sparse=`` with no
        row-sparse gradient changes nothing, which a user should hear of (the wrapper never
        sees the model, so this is the first moment it can know)."""
        layouts = {layout for layout, _, _ in self.layout.values()}
        if self._nothing_sparse_said or "absent" in layouts or not layouts:
            return
        self._nothing_sparse_said = True
        if "sparse" not in layouts:
            warnings.warn(
                "hvdsync: sparse= is on, but no gradient of the first full step was row-sparse, "
                "so every layer goes dense as without it. Row-sparse gradients come from "
                "torch's nn.Embedding / nn.EmbeddingBag with sparse=True and from Keras' "
                "Embedding layers on the TensorFlow backend; on Keras' torch backend they are "
                "dense (docs/sparse.md). Or drop sparse=.", RuntimeWarning,
                stacklevel=2)

    def is_sparse(self, i: int) -> bool:
        """Whether parameter ``i``'s gradient travels sparse this step: some rank has it
        sparse (once shared), else as last seen."""
        if i in self.layout:
            return self.layout[i][0] == "sparse"
        return self.known.get(i, ("dense",))[0] == "sparse"

    def sparse_dim(self, i: int) -> int:
        return self.layout[i][2] if i in self.layout else self.known[i][1]

    def holds(self, i: int, has_gradient: bool) -> bool:
        """``one_round``: a parameter with no gradient here that was never seen with one
        anywhere (sparse or dense is unknown) waits for the shared layouts."""
        return self.config.one_round and not has_gradient and i not in self.known

    def route(self, i: int, gathered_row_bytes: int, dense_bytes: int) -> SparseRoute:
        """This step's route for parameter ``i`` from the shared counts (the adapter gives
        what a gathered row and the dense tensor cost on the wire)."""
        return choose_route(self.layout[i][1], gathered_row_bytes, dense_bytes,
                            self.config.dense_ratio)

    def take(self, i: int, route: str) -> None:
        """Parameter ``i`` goes by ``route`` this step (counted as ``sparse_<route>``)."""
        self.taken[i] = route
        self.stats.count(f"sparse_{route}")

    def count_equal(self, i: int) -> None:
        """A gather whose counts turned out equal on every rank (a fixed-shape gather)."""
        if len(set(self.layout[i][1])) == 1:
            self.stats.count("sparse_gather_equal")

    def state_dict(self) -> dict:
        """What later steps' collectives depend on, the same on every rank: the layouts seen
        and the predicted routes (a rank that joins a running job gets them with the shared
        state, Horovod Elastic)."""
        return {"known": [[i, layout, sdim] for i, (layout, sdim) in sorted(self.known.items())],
                "predicted": [[i, route] for i, route in sorted(self.predicted.items())]}

    def load_state_dict(self, state: dict) -> None:
        self.known = {int(i): (str(layout), int(sdim)) for i, layout, sdim in state["known"]}
        self.predicted = {int(i): str(route) for i, route in state["predicted"]}

    def forget(self) -> None:
        """Back to no memory: the next step shares the layouts first."""
        self.known, self.predicted = {}, {}

    def end_step(self, route_of: Callable[[int], str], rows_of: Callable[[int], int]) -> None:
        """``one_round``: next step's routes (``route_of(i)``: by this step's shared counts);
        the routes of this step for :attr:`last_routes` (``rows_of(i)``: rows handed to the
        optimizer)."""
        self.predicted = {i: route_of(i) for i, (layout, _, _) in self.layout.items()
                          if layout == "sparse"}
        self.last_routes = {self.names[i]: (route, tuple(self.layout[i][1]), rows_of(i))
                            for i, route in self.taken.items()}
        self.taken = {}


class SparseTransport(Transport):
    """Both adapters' sparse exchange: what they share (the :class:`SparseProtocol` and its
    memory in checkpoints); each moves its framework's tensors."""

    name = "sparse"
    scale_sensitive = False  # rows summed; the memory is of layouts and routes only
    protocol: SparseProtocol

    def beside_join(self, by_name: bool) -> Optional[str]:
        return ("sparse= gathers every rank's rows, and Horovod answers nothing but allreduce "
                "while a rank is in hvd.join()") if by_name else None

    def state_dict(self) -> dict:
        return {"protocol": self.protocol.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "protocol" in state:
            self.protocol.load_state_dict(state["protocol"])
        else:
            self.forget()

    def forget(self) -> None:
        self.protocol.forget()
