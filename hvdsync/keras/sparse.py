"""``sparse=`` for Keras ``IndexedSlices`` gradients: the sparse grouped allgather as a
transport (the rules live in :mod:`hvdsync.sparse`).

Per step: each rank sums its duplicate rows, then **one** small allgather shares every sparse
gradient's distinct-row count from every rank; from those (identical everywhere) each
gradient takes the same route on every rank: ``gather`` (the indices and values of all such
gradients in **one** grouped allgather per value dtype; equal counts give a fixed-shape
gather, unequal ones Horovod's uneven-size allgather; each row carries its index bit-cast
into extra value columns), ``dense`` (scattered into a dense buffer with a "present" column
and allreduced, when gathering would cost more) or ``none`` (no rank has a row). Duplicate
rows across ranks are summed (divided by the number of ranks for ``Average``). These
variables go every step; deciders govern the dense ones.

In Keras the counts always travel first, in a collective of their own (torch's
``one_round`` routes by the previous step's counts to save that round; not built here yet).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from horovod.tensorflow.mpi_ops import Average

from hvdsync.keras.backend import KerasGradients
from hvdsync.keras.comm import KerasCommunicator, coalesce, payload_bytes
from hvdsync.sparse import SparseConfig, choose_route
from hvdsync.stats import SyncStats
from hvdsync.technique import Pending, Transport

_INDEX_BYTES = 8  # int64 row indices


class SparseExchange(Transport):
    name = "sparse"
    decidable = False  # row-sparse gradients go every step
    scale_sensitive = False  # rows summed, no memory across steps

    def __init__(self, config: SparseConfig, grads: KerasGradients, comm: KerasCommunicator,
                 stats: SyncStats):
        self.config = config
        self.grads = grads
        self.comm = comm
        self.stats = stats
        self._queue: list[tuple[int, int]] = []
        #: the last step's route, per-rank row counts and rows handed to the optimizer (after
        #: summing duplicates across ranks) per sparse variable path, for logging and tests
        self.last_routes: dict[str, tuple[str, tuple[int, ...], int]] = {}

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

    def flush(self) -> dict[int, Pending]:
        items, self._queue = sorted(self._queue), []
        if not items:
            return {}
        grads = [self.grads.get(li, k) for li, k in items]
        local = np.array([[int(tf.shape(g.indices)[0]) for g in grads]], dtype=np.int64)
        if self.comm.size > 1:
            self.stats.control(local.nbytes)
        counts = self.comm.allgather([tf.constant(local)], "hvdsync.sparse.counts")[0]
        counts = np.asarray(counts)
        routes = []
        for j, g in enumerate(grads):
            row = int(np.prod(g.values.shape[1:])) * g.values.dtype.size
            dense_bytes = int(np.prod(g.dense_shape)) * g.values.dtype.size
            routes.append(choose_route(counts[:, j], row + _INDEX_BYTES, dense_bytes,
                                       self.config.dense_ratio))
        scale = 1.0 / self.comm.size if self.comm.op == Average else 1.0
        sends: dict[int, list[int]] = {}  # layer -> [bytes, collectives]
        for r in routes:
            self.stats.count(f"sparse_{r.route}")
            if r.route == "gather" and r.equal_counts:
                self.stats.count("sparse_gather_equal")
        gather = [j for j, r in enumerate(routes) if r.route == "gather"]
        dense = [j for j, r in enumerate(routes) if r.route == "dense"]
        by_dtype: dict[tf.DType, list[int]] = {}
        for j in gather:  # one grouped allgather per value dtype (a group has one dtype)
            by_dtype.setdefault(grads[j].values.dtype, []).append(j)
        for dtype, js in by_dtype.items():
            packed = [_pack(grads[j]) for j in js]
            for j, t in zip(js, packed):
                sends.setdefault(items[j][0], [0, 0])[0] += payload_bytes(t)
            gathered = self.comm.allgather(packed, f"hvdsync.sparse.rows.{dtype.name}")
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
        self.last_routes = {}
        for (li, k), r in zip(items, routes):
            rows = (int(tf.shape(self.grads.get(li, k).indices)[0]) if r.route != "none" else 0)
            self.last_routes[self.grads.name(li, k)] = (r.route, r.counts, rows)
        if self.comm.size == 1:
            return {}
        return {li: Pending(nbytes=b, collectives=c) for li, (b, c) in sends.items()}

    def status(self) -> dict:
        return dict(self.last_routes)


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
