"""``sparse=`` for Keras ``IndexedSlices`` gradients: the sparse grouped allgather as a
transport. The protocol -- layouts, shared counts, routes, one round or counts first -- is
:class:`hvdsync.sparse.SparseProtocol`, the same as torch's; this file moves Keras' tensors.

Per step each rank sums its duplicate rows; every variable's layout code (its distinct-row
count, dense or absent) is shared with every rank, and from those (identical everywhere) each
gradient takes the same route on every rank: ``gather`` (indices and values of all such
gradients in **one** grouped allgather per value dtype; each row carries its index bit-cast
into extra value columns; unequal counts use Horovod's uneven-size allgather), ``dense``
(scattered into a dense buffer with a "present" column and allreduced, when gathering would
cost more) or ``none`` (no rank has a row). Duplicate rows across ranks are summed (divided by
the number of ranks for ``Average``). These variables go every step; deciders govern the dense
ones.

With ``one_round`` (the default) the codes travel bit-cast as the first tensor of the rows'
allgather, and each gradient takes the route the last step's counts chose: one collective
round per step; a variable with no history yet (the first step) waits for this step's codes
(a second round). ``one_round=False`` shares the codes first, in an allgather of their own.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf
from horovod.tensorflow.mpi_ops import Average

from hvdsync.keras.backend import KerasGradients
from hvdsync.keras.comm import KerasCommunicator, coalesce, payload_bytes
from hvdsync.sparse import ABSENT, DENSE, SparseConfig, SparseProtocol, SparseTransport
from hvdsync.stats import SyncStats
from hvdsync.technique import Pending

_INDEX_BYTES = 8  # int64 row indices


class SparseExchange(SparseTransport):
    """Moves the sparse (``IndexedSlices``) gradients of one step, as the torch adapter's
    exchange does: the protocol's decisions are :class:`hvdsync.sparse.SparseProtocol`'s."""

    def __init__(self, config: SparseConfig, grads: KerasGradients, comm: KerasCommunicator,
                 stats: SyncStats):
        self.config = config
        self.grads = grads
        self.comm = comm
        self.stats = stats
        #: every model variable in layer order: the protocol's parameter positions
        self._vars = [v for vs in grads.layer_vars for v in vs]
        self.protocol = SparseProtocol(config, [v.path for v in self._vars], stats)
        self._queue: list[tuple[int, int]] = []
        self._at: dict[int, tuple[int, int]] = {}  # position -> (layer, k) this step
        self._done: set[int] = set()  # positions sent with the codes (one round)

    def owns(self, li: int, k: int) -> bool:
        return self.grads.is_row_sparse(li, k)

    def layer_ready(self, li: int, ks: list[int]) -> None:
        for k in ks:  # before clipping, so the duplicates are counted
            g = self.grads.get(li, k)
            merged = coalesce(g)
            self.stats.count("sparse_duplicate_rows",
                             int(tf.shape(g.indices)[0]) - int(tf.shape(merged.indices)[0]))
            self.grads.set(li, k, merged)

    def start(self, li: int, ks: list[int]) -> None:
        self._queue += [(li, k) for k in ks]

    def backward_done(self) -> None:
        """Every variable's layout code (a Keras variable is in every step of its train
        function or in none); counts first: share them now."""
        self._at, self._done = {}, set()
        local = [(ABSENT, 0)] * len(self._vars)
        for li in range(len(self.grads.layer_vars)):
            for k in range(self.grads.size(li)):
                i = int(self.grads.key(li, k))
                self._at[i] = (li, k)
                g = self.grads.get(li, k)  # (summed in layer_ready, after the step's stats)
                local[i] = ((int(tf.size(tf.unique(g.indices).y)), 1)
                            if isinstance(g, tf.IndexedSlices) else (DENSE, 0))
        codes = self.protocol.begin(local)
        if not self.config.one_round:
            self._share_codes(codes)

    def _share_codes(self, codes: list[int]) -> None:
        """The codes in an allgather of their own (counts first, or nothing to gather)."""
        self._absorb(self.comm.allgather([tf.constant([codes], tf.int64)],
                                         "hvdsync.sparse.layouts")[0], codes)

    def _absorb(self, gathered, codes: list[int], own_collective: bool = True) -> None:
        """Every rank's codes, gathered (in their own collective, or with the rows)."""
        if self.comm.size > 1:
            self.stats.control(8 * len(codes), collectives=int(own_collective))
        self.protocol.absorb(np.asarray(gathered).reshape(self.comm.size, -1).tolist())
        for i, (layout, _, _) in self.protocol.layout.items():
            if layout == "sparse" and i not in self._at:
                raise RuntimeError(f"the gradient of {self._vars[i].path!r} is sparse on some "
                                   "rank but this rank's train function has none: every rank "
                                   "must train the same variables")

    def start_early(self) -> dict[int, Pending]:
        """One round: the codes, with the rows of every variable routed as the last step's
        counts chose, in one grouped allgather (and one allreduce for those routed dense)."""
        if not self.config.one_round:
            return {}
        missing = [self._vars[i].path for i in self.protocol.predicted if i not in self._at]
        if missing:
            raise RuntimeError(f"the gradients of {missing} were sparse last step but this "
                               "rank's train function has none now")
        positions = sorted(self.protocol.predicted)
        routes = ["dense" if self.protocol.predicted[i] == "dense" else "gather"
                  for i in positions]
        self._done = set(positions)
        return self._send(positions, routes, header=self.protocol.codes)

    def flush(self) -> dict[int, Pending]:
        queued, self._queue = self._queue, []
        positions = sorted(i for i in (int(self.grads.key(li, k)) for li, k in queued)
                           if i not in self._done)
        if not positions:
            return {}
        return self._send(positions, routes=[self._route(i) for i in positions])

    def _route(self, i: int) -> str:
        """This step's route for variable ``i`` from the shared counts."""
        v = self._vars[i]
        shape, size = [int(d) for d in v.shape], tf.as_dtype(v.dtype).size
        row = int(np.prod(shape[1:])) * size
        return self.protocol.route(i, row + _INDEX_BYTES, int(np.prod(shape)) * size).route

    def _send(self, positions: list[int], routes: list[str],
              header: Optional[list[int]] = None) -> dict[int, Pending]:
        """Send the gradients at ``positions`` by ``routes`` (eager: done on return); with
        ``header`` (this rank's codes), share it bit-cast as the first tensor of the first
        value dtype's allgather (alone, if nothing is gathered) and absorb every rank's."""
        scale = 1.0 / self.comm.size if self.comm.op == Average else 1.0
        sends: dict[int, list[int]] = {}  # layer -> [bytes, collectives]
        items = [self._at[i] for i in positions]
        grads = [self.grads.get(li, k) for li, k in items]
        for i, route in zip(positions, routes):
            self.protocol.take(i, route)
        gather = [j for j, r in enumerate(routes) if r == "gather"]
        dense = [j for j, r in enumerate(routes) if r == "dense"]
        by_dtype: dict[tf.DType, list[int]] = {}
        for j in gather:  # one grouped allgather per value dtype (a group has one dtype)
            by_dtype.setdefault(grads[j].values.dtype, []).append(j)
        if header is not None and not by_dtype:
            self._share_codes(header)
            header = None
        for dtype, js in sorted(by_dtype.items(), key=lambda item: item[0].name):
            packed = [_pack(grads[j]) for j in js]
            for j, t in zip(js, packed):
                sends.setdefault(items[j][0], [0, 0])[0] += payload_bytes(t)
            first = [] if header is None else [_as_values(header, dtype)]
            gathered = self.comm.allgather(first + packed, f"hvdsync.sparse.rows.{dtype.name}")
            if header is not None:
                self._absorb(_from_values(gathered[0], self.comm.size), header,
                             own_collective=False)
                header, gathered = None, gathered[1:]
            for j, t in zip(js, gathered):
                g = grads[j]
                merged = coalesce(_unpack(t, g))
                self.grads.set(*items[j], tf.IndexedSlices(
                    merged.values * tf.constant(scale, g.values.dtype), merged.indices,
                    g.dense_shape))
            sends[items[js[0]][0]][1] += 1
        if dense:
            buffers = []
            for j in dense:
                g = grads[j]
                shape = [int(d) for d in g.dense_shape]
                flat = tf.reshape(g.values, [-1, int(np.prod(shape[1:]))])
                rows = tf.concat([flat, tf.ones([tf.shape(flat)[0], 1], flat.dtype)], axis=1)
                buffers.append(tf.scatter_nd(tf.expand_dims(g.indices, 1), rows,
                                             [shape[0], flat.shape[1] + 1]))
                sends.setdefault(items[j][0], [0, 0])[0] += payload_bytes(buffers[-1])
            summed = self.comm.sum(buffers, "hvdsync.sparse.dense")
            for b, j in zip(summed, dense):
                g = grads[j]
                present = tf.cast(tf.where(b[:, -1] > 0)[:, 0], g.indices.dtype)
                rows = tf.gather(b[:, :-1], present) * tf.constant(scale, g.values.dtype)
                self.grads.set(*items[j], tf.IndexedSlices(
                    tf.reshape(rows, [-1, *g.values.shape[1:]]), present, g.dense_shape))
            sends[items[dense[0]][0]][1] += 1
        for j in gather:  # the codes are shared by now
            self.protocol.count_equal(positions[j])
        if self.comm.size == 1:
            return {}
        return {li: Pending(nbytes=b, collectives=c) for li, (b, c) in sends.items()}

    def end_step(self, ok: bool) -> None:
        def rows(i: int) -> int:
            g = self.grads.get(*self._at[i]) if i in self._at else None
            return int(tf.shape(g.indices)[0]) if isinstance(g, tf.IndexedSlices) else 0
        self.protocol.end_step(self._route, rows)

    def status(self) -> dict:
        return dict(self.protocol.last_routes)


def _as_values(codes: list[int], dtype: tf.DType) -> tf.Tensor:
    """``[1, w]``: the int64 codes bit-cast into the value dtype (an allgather copies bytes)."""
    bits = tf.bitcast(tf.constant(codes, tf.int64), dtype)
    return tf.reshape(bits, [1, -1])


def _from_values(gathered: tf.Tensor, size: int) -> np.ndarray:
    """Inverse of :func:`_as_values` on the gathered ``[size, w]``: ``[size, codes]``."""
    k = 8 // gathered.dtype.size
    bits = tf.reshape(gathered, [size, -1] if k == 1 else [size, -1, k])
    return tf.bitcast(bits, tf.int64).numpy()


def _pack(g: tf.IndexedSlices) -> tf.Tensor:
    """``[rows, width + k]``: each row's values, then its int64 index bit-cast into ``k``
    columns of the value dtype (bit-for-bit: an allgather copies bytes, no arithmetic)."""
    rows = tf.reshape(g.values, [tf.shape(g.values)[0], -1])
    index = tf.bitcast(tf.cast(g.indices, tf.int64), g.values.dtype)
    if index.shape.rank == 1:  # same width (float64)
        index = tf.expand_dims(index, 1)
    return tf.concat([rows, index], axis=1)


def _unpack(packed: tf.Tensor, like: tf.IndexedSlices) -> tf.IndexedSlices:
    k = 8 // packed.dtype.size
    width = int(packed.shape[1]) - k
    index = packed[:, width:]
    index = tf.bitcast(index[:, 0] if k == 1 else index, tf.int64)
    values = tf.reshape(packed[:, :width], [-1, *like.values.shape[1:]])
    return tf.IndexedSlices(values, tf.cast(index, like.indices.dtype), like.dense_shape)
