"""``sparse=``'s exchange, the same for every adapter: the step's moments of the sparse grouped
allgather over an adapter's :class:`hvdsync.techniques.sparse.ports.RowSparse` primitives (pack, scatter, the
codes bit-cast into a value dtype) and two grouped collectives of its communicator
(``gather_rows``, ``sum_rows``). What it decides -- layouts, counts, routes -- is
:class:`hvdsync.techniques.sparse.protocol.SparseProtocol`'s; docs/sparse.md has the wire format and the costs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

from hvdsync.core.wire import Codec, Pending
from hvdsync.core.ports import Communicator, Gradients
from hvdsync.techniques.sparse.ports import RowSparse
from hvdsync.techniques.sparse.protocol import ABSENT, DENSE, SparseProtocol, SparseTransport
from hvdsync.techniques.sparse.codec import ROUTE_CODECS
from hvdsync.techniques.sparse.config import SparseConfig
from hvdsync.core.stats import SyncStats

INDEX_BYTES = 8  # a row's index travels as int64, bit-cast into the value dtype


def index_columns(sparse_dim: int, itemsize: int) -> int:
    """How many columns of a value dtype of ``itemsize`` bytes carry a row's index."""
    if INDEX_BYTES % itemsize:
        raise TypeError(f"sparse gradients travel with their indices bit-cast to the value "
                        f"dtype, which needs an element size dividing 8, got {itemsize}")
    return sparse_dim * INDEX_BYTES // itemsize


class _Sends:
    """What one layer waits for in this exchange: its gradients' finishers and counts."""

    def __init__(self) -> None:
        self.finishers: list = []
        self.nbytes = 0
        self.collectives = 0

    def pending(self) -> Pending:
        finishers = self.finishers
        return Pending(lambda: [f() for f in finishers] and None, None, self.nbytes,
                       self.collectives, what="the sparse exchange")


class Sparse(SparseTransport):
    """Moves the row-sparse gradients of one step. Per step: :meth:`backward_done` takes every
    parameter's layout (counts first: shares them at once); :meth:`start_early` (one round)
    sends the gradients the last step's counts predicted, with this rank's codes as the first
    tensor of the allgather; :meth:`send_rest` sends the rest by this step's shared counts.

    ``shapes[i]`` and ``wire_itemsize[i]``: parameter ``i``'s shape and the element size it
    travels in (after the adapter's compression), ``i`` a position in layer order."""

    # an adapter's traced form (Keras) goes beside a decider: its layers go every step,
    # outside the decider's branches (rules.UNDECIDED), and beside lowrank='s rounds
    traced_with = ("clip", "plain", "threshold", "select", "lowrank")

    def __init__(self, config: SparseConfig, grads: Gradients, comm: Communicator, rows: RowSparse,
                 stats: SyncStats, names: Sequence[str], shapes: Sequence[Sequence[int]],
                 wire_itemsize: Sequence[int], layers: int):
        self.config, self.grads, self.comm, self.rows, self.stats = (
            config, grads, comm, rows, stats)
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.itemsize = list(wire_itemsize)
        self.layers = layers
        self.protocol = SparseProtocol(config, names, stats)
        self._queue: list[tuple[int, int]] = []
        self._at: dict[int, tuple[int, int]] = {}  # position -> (layer, k) this step
        self._done: set[int] = set()  # positions sent with the codes (one round)
        self._codecs: dict[tuple[int, str, int], Codec] = {}

    def _each(self):
        """``(position, layer, k)`` of every parameter of this step."""
        g = self.grads
        return ((int(g.key(li, k)), li, k) for li in range(self.layers) for k in range(g.size(li)))

    # -- the transport's moments ----------------------------------------------------------------
    def owns(self, li: int, k: int) -> bool:
        return self.grads.is_row_sparse(li, k)

    def layer_ready(self, li: int, ks: list[int]) -> None:
        for k in ks:  # before clipping, so the duplicates are counted
            merged, duplicates = self.rows.coalesce(self.grads.get(li, k))
            self.stats.count("sparse_duplicate_rows", duplicates)
            self.grads.set(li, k, merged)

    def start(self, li: int, ks: list[int], layer: list) -> None:
        self._queue += [(li, k) for k in ks]

    def fill(self, li: int, k: int):
        return self._empty(li, k) if self.protocol.is_sparse(int(self.grads.key(li, k))) \
            else None

    def _empty(self, li: int, k: int):
        """No rows, for a rank on which a parameter was not used while others have rows."""
        return self.rows.empty(self.grads.value(li, k),
                               self.protocol.sparse_dim(int(self.grads.key(li, k))))

    def backward_done(self, missing: list[int]) -> list[int]:
        """Every parameter's layout code; counts first: share them now (one collective).
        Returns the missing layers that wait for the shared layouts (:meth:`_holds`)."""
        self._at, self._done = {}, set()
        local = [(ABSENT, 0)] * len(self.shapes)
        for i, li, k in self._each():
            self._at[i] = (li, k)
            g = self.grads.get(li, k)
            if g is not None:
                local[i] = self.rows.layout(g) if self.grads.is_row_sparse(li, k) else (DENSE, 0)
        codes = self.protocol.begin(local)
        if not self.config.one_round:
            self._absorb(self.comm.gather_rows("hvdsync.sparse.layouts",
                                               [self.rows.codes(codes, None)]), codes)
        return [li for li in missing if self._holds(li)]

    def _absorb(self, gathered: Pending, codes: list[int], own_collective: bool = True) -> None:
        """Every rank's codes, from the first output of ``gathered``."""
        if self.comm.size > 1 and gathered.collectives:  # (else run for it in its node)
            self.stats.control(INDEX_BYTES * len(codes), collectives=int(own_collective))
        self.protocol.absorb(self.rows.codes_of(gathered.wait()[0], self.comm.size))
        missing = [self.protocol.names[i] for i, (layout, _, _) in self.protocol.layout.items()
                   if layout == "sparse" and i not in self._at]
        if missing:
            raise RuntimeError(f"the gradients of {missing} are sparse on some rank but this "
                               "rank's step has none: every rank must train the same variables")

    def _holds(self, li: int) -> bool:
        """One round: a parameter with no gradient here that was never seen with one anywhere
        (sparse or dense is unknown) waits for the shared layouts."""
        g = self.grads
        return any(self.protocol.holds(int(g.key(li, k)), g.get(li, k) is not None)
                   for k in range(g.size(li)))

    def start_early(self) -> dict[int, Pending]:
        """One round: the codes, with the rows of every parameter routed as the last step's
        counts chose, in one grouped allgather (and one allreduce for those routed dense)."""
        if not self.config.one_round:
            return {}
        missing = [self.protocol.names[i] for i in self.protocol.predicted if i not in self._at]
        if missing:
            raise RuntimeError(f"the gradients of {missing} were sparse last step but this "
                               "rank's step has none now")
        positions = sorted(self.protocol.predicted)
        for i in positions:
            li, k = self._at[i]
            g = self.grads.get(li, k)
            if g is None:
                self.grads.set(li, k, self._empty(li, k))
            elif not self.grads.is_row_sparse(li, k):  # dense here, sparse elsewhere: it
                # goes as rows, and absorbing the codes raises on every rank alike
                self.grads.set(li, k, self.rows.as_rows(g, self.protocol.sparse_dim(i)))
        routes = ["dense" if self.protocol.predicted[i] == "dense" else "gather"
                  for i in positions]
        self._done = set(positions)
        return self._send(positions, routes, header=self.protocol.codes)

    def send_rest(self) -> dict[int, Pending]:
        # in the fixed parameter order: layers became ready in a different order on each rank
        queued, self._queue = self._queue, []
        positions = sorted(i for i in (int(self.grads.key(li, k)) for li, k in queued)
                           if i not in self._done)
        if not positions:
            return {}
        return self._send(positions, [self._route(i) for i in positions])

    def route_bytes(self, i: int) -> tuple[int, int]:
        """What a gathered row of parameter ``i`` (values and index) and its dense tensor
        cost on the wire: :func:`hvdsync.techniques.sparse.protocol.choose_route`'s inputs."""
        shape, esize = self.shapes[i], self.itemsize[i]
        seen = i in self.protocol.layout or i in self.protocol.known
        s = (self.protocol.sparse_dim(i) if seen else 0) or 1  # (an embedding's, until seen)
        row = math.prod(shape[s:])
        return (row + index_columns(s, esize)) * esize, math.prod(shape) * esize

    def codec(self, i: int, route: str) -> Codec:
        """The codec of parameter ``i``'s rows on ``route`` (``"gather"``, ``"dense"``; made
        once per layout)."""
        key = (i, route, self.protocol.sparse_dim(i))
        codec = self._codecs.get(key)
        if codec is None:
            codec = self._codecs[key] = ROUTE_CODECS[route](self.shapes[i], key[2])
        return codec

    def divisor(self) -> int:
        """What the ranks' sum is divided by: the ranks for an average, else 1."""
        return self.comm.size if self.comm.averages else 1

    def _route(self, i: int) -> str:
        """This step's route for parameter ``i`` from the shared counts."""
        return self.protocol.route(i, *self.route_bytes(i)).route

    # -- what a traced step decides on the device ---------------------------------------------
    def codes_go_first(self, positions: Sequence[int]) -> bool:
        """Whether this step shares the codes before the rows: counts first, or no route
        predicted yet for one of ``positions`` (the first step)."""
        predicted = self.protocol.predicted
        return (not self.config.one_round or not predicted
                or any(i not in predicted for i in positions))

    def predicted_dense(self) -> list[bool]:
        """Per parameter, whether the last step's counts route it dense this step."""
        return [self.protocol.predicted.get(i) == "dense" for i in range(len(self.shapes))]

    def dense_limits(self) -> tuple[list[int], list[float]]:
        """Per parameter, a gathered row's bytes and the gathered bytes above which it goes
        dense (:func:`hvdsync.techniques.sparse.protocol.choose_route`'s rule, for a device to apply)."""
        row, whole = zip(*(self.route_bytes(i) for i in range(len(self.shapes))))
        return list(row), [self.config.dense_ratio * w for w in whole]

    def end_step(self, ok: bool) -> None:
        """One round: next step's routes from this step's shared counts."""
        def rows(i: int) -> int:
            at = self._at.get(i)
            if at is None or not self.grads.is_row_sparse(*at):
                return 0
            return self.rows.row_count(self.grads.get(*at))
        self.protocol.end_step(self._route, rows)
        self._done = set()

    def status(self) -> dict:
        return dict(self.protocol.last_routes)

    # -- the collectives ---------------------------------------------------------------------
    def _send(self, positions: list[int], routes: list[str],
              header: Optional[list[int]] = None) -> dict[int, Pending]:
        """Send the gradients at ``positions`` by ``routes``: one grouped allgather per wire
        dtype and one grouped allreduce for those routed dense. ``header`` (this rank's
        codes) goes bit-cast as the first tensor of the first allgather (alone, if nothing
        is gathered); every rank's are absorbed before this returns."""
        for i, route in zip(positions, routes):
            self.protocol.take(i, route)
        if self.comm.size == 1:  # nothing to send: the local rows are the sum
            if header is not None:
                self.protocol.absorb([header])
            return {}
        sends: dict[int, _Sends] = {}
        gather = [i for i, r in zip(positions, routes) if r == "gather"]
        dense = [i for i, r in zip(positions, routes) if r == "dense"]
        groups: dict[str, list[tuple[int, Any, Any]]] = {}
        for i in gather:
            (packed,), ctx = self.codec(i, "gather").encode(self.rows,
                                                            [self.grads.get(*self._at[i])])
            groups.setdefault(self.rows.dtype_key(packed), []).append((i, packed, ctx))
        if header is not None and not groups:
            self._absorb(self.comm.gather_rows("hvdsync.sparse.layouts",
                                               [self.rows.codes(header, None)]), header)
            header = None
        if dense:
            self._start_dense(dense, sends)
        for key in sorted(groups):
            self._start_gather(groups[key], sends, header, f"hvdsync.sparse.rows.{key}")
            header = None
        for i in gather:  # the codes are shared by now
            self.protocol.count_equal(i)
        return {li: s.pending() for li, s in sends.items()}

    def _start_gather(self, group: list[tuple[int, Any, Any]], sends: dict[int, _Sends],
                      header: Optional[list[int]], name: str) -> None:
        first = [] if header is None else [self.rows.codes(header, group[0][1])]
        gathered = self.comm.gather_rows(name, first + [packed for _, packed, _ in group])
        if header is not None:
            self._absorb(gathered, header, own_collective=False)
        ran = gathered.collectives
        divide_by = self.divisor()

        def finisher(j: int, i: int, ctx: Any):
            def finish() -> None:
                out = gathered.wait()[len(first) + j]
                self.grads.set(*self._at[i], self.codec(i, "gather").average(
                    self.rows, [out], divide_by, ctx)[0])
            return finish
        self._record([(i, packed, finisher(j, i, ctx))
                      for j, (i, packed, ctx) in enumerate(group)], sends, ran)

    def _start_dense(self, positions: list[int], sends: dict[int, _Sends]) -> None:
        """The dense route: each gradient scattered into its dense shape with a "present"
        column (which rows any rank had), in one grouped allreduce of sums."""
        scattered = [self.codec(i, "dense").encode(self.rows, [self.grads.get(*self._at[i])])
                     for i in positions]
        summed = self.comm.sum_rows("hvdsync.sparse.dense", [b for (b,), _ in scattered])
        divide_by = self.divisor()

        def finisher(j: int, i: int, ctx: Any):
            def finish() -> None:
                self.grads.set(*self._at[i], self.codec(i, "dense").average(
                    self.rows, [summed.wait()[j]], divide_by, ctx)[0])
            return finish
        self._record([(i, buffer, finisher(j, i, ctx))
                      for j, (i, ((buffer,), ctx)) in enumerate(zip(positions, scattered))],
                     sends, summed.collectives)

    def _record(self, items: list[tuple[int, Any, Any]], sends: dict[int, _Sends],
                ran: int) -> None:
        """Each gradient's finisher and bytes go to its layer's sends; the grouped collective
        counts once, at the first gradient's layer -- where this rank ran it (``ran``: the
        collective's count; 0 where a rank of its node ran it for this one)."""
        for i, sent, finish in items:
            s = sends.setdefault(self._at[i][0], _Sends())
            s.finishers.append(finish)
            s.nbytes += self.rows.nbytes(sent) if ran else 0
        sends[self._at[items[0][0]][0]].collectives += ran
