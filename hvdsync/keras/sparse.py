"""Sparse grouped allgather for Keras ``IndexedSlices`` gradients (technique 3; the rules live
in :mod:`hvdsync.sparse`).

Per step: each rank sums its duplicate rows, then **one** small allgather shares every sparse
gradient's distinct-row count from every rank; from those (identical everywhere) each
gradient takes the same route on every rank: ``gather`` (the indices and values of all such
gradients in **one** grouped allgather; equal counts give a fixed-shape gather, unequal ones
Horovod's uneven-size allgather; each row carries its index bit-cast into extra value columns), ``dense`` (scattered into a dense buffer with a "present"
column and allreduced, when gathering would cost more) or ``none`` (no rank has a row).
Duplicate rows across ranks are summed (divided by the number of ranks for ``Average``).

In Keras the counts always travel first, in a collective of their own (``one_round`` is a torch
option: routing by the previous step's counts needs state that outlives one step's traced
graph; the counts-first route is what the rules describe and costs one extra small round).
Dense gradients of the step are reduced per layer as on the plain path.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from horovod.tensorflow import mpi_ops
from horovod.tensorflow.mpi_ops import Average, Sum

from hvdsync.keras.comm import Reducer, coalesce, payload_bytes
from hvdsync.keras.techniques import EagerTechnique, StepLayout
from hvdsync.sparse import SparseConfig, choose_route
from hvdsync.stats import SyncStats

_INDEX_BYTES = 8  # int64 row indices


class EagerSparse(EagerTechnique):
    accepts_sparse = True

    def __init__(self, config: SparseConfig, reducer: Reducer, stats: SyncStats):
        self.config = config
        self.reducer = reducer
        self.stats = stats
        #: the last step's route, per-rank row counts and rows handed to the optimizer (after
        #: summing duplicates across ranks) per sparse variable path, for logging and tests
        self.last_routes: dict[str, tuple[str, tuple[int, ...], int]] = {}

    def before_apply(self, layout: StepLayout, grads: list, values: list) -> list:
        out = list(grads)
        sparse: list[tuple[int, int, tf.IndexedSlices]] = []  # (layer, position, gradient)
        dense_layers: list[tuple[str, list]] = []
        dense_positions: list[list[int]] = []
        for li, positions in layout.layers:
            name = layout.names[li]
            dense = [p for p in positions if not isinstance(grads[p], tf.IndexedSlices)]
            for p in positions:
                self.stats.dense(payload_bytes(grads[p]))
                if p not in dense:
                    g = coalesce(grads[p])
                    self.stats.count("sparse_duplicate_rows",
                                     int(tf.shape(grads[p].indices)[0]) - int(tf.shape(g.indices)[0]))
                    sparse.append((li, p, g))
            if dense:
                dense_layers.append((name, [grads[p] for p in dense]))
                dense_positions.append(dense)
        self.reducer.record_sent(dense_layers, self.stats)
        for positions, reduced in zip(dense_positions,
                                      self.reducer.reduce_layers(dense_layers, "dense")):
            for p, r in zip(positions, reduced):
                out[p] = r
        if not sparse:
            return out
        size = self.reducer.size
        local = np.array([[int(tf.shape(g.indices)[0]) for _, _, g in sparse]], dtype=np.int64)
        self.stats.control(local.nbytes)
        counts = (local if size == 1 else
                  mpi_ops.allgather(tf.constant(local), name="hvdsync.sparse.counts",
                                    process_set=self.reducer.process_set).numpy())
        routes = []
        for k, (li, p, g) in enumerate(sparse):
            row = int(np.prod(g.values.shape[1:])) * g.values.dtype.size
            dense_bytes = int(np.prod(g.dense_shape)) * g.values.dtype.size
            routes.append(choose_route(counts[:, k], row + _INDEX_BYTES, dense_bytes,
                                       self.config.dense_ratio))
        gather = [k for k, r in enumerate(routes) if r.route == "gather"]
        dense = [k for k, r in enumerate(routes) if r.route == "dense"]
        scale = 1.0 / size if self.reducer.op == Average else 1.0
        for k, r in enumerate(routes):
            self.stats.count(f"sparse_{r.route}")
            if r.route == "gather" and r.equal_counts:
                self.stats.count("sparse_gather_equal")
        per_layer: dict[int, list[int]] = {}
        if gather:
            # One grouped allgather per value dtype (Horovod groups need one dtype): each
            # gradient as rows of [values..., its index bit-cast into the value dtype].
            by_dtype: dict[tf.DType, list[int]] = {}
            for k in gather:
                by_dtype.setdefault(sparse[k][2].values.dtype, []).append(k)
            for dtype, ks in by_dtype.items():
                packed = [_pack(sparse[k][2]) for k in ks]
                for k, t in zip(ks, packed):
                    per_layer.setdefault(sparse[k][0], [0, 0])
                    per_layer[sparse[k][0]][0] += payload_bytes(t)
                gathered = (packed if size == 1 else
                            mpi_ops.grouped_allgather(packed,
                                                      name=f"hvdsync.sparse.rows.{dtype.name}",
                                                      process_set=self.reducer.process_set))
                for k, t in zip(ks, gathered):
                    li, p, g = sparse[k]
                    merged = coalesce(_unpack(t, g))
                    out[p] = tf.IndexedSlices(merged.values * tf.cast(scale, g.values.dtype),
                                              merged.indices, g.dense_shape)
                per_layer[sparse[ks[0]][0]][1] += 1
        if dense:
            buffers = []
            for k in dense:
                g = sparse[k][2]
                shape = [int(d) for d in g.dense_shape]
                flat = tf.reshape(g.values, [-1, int(np.prod(shape[1:]))])
                rows = tf.concat([flat, tf.ones([tf.shape(flat)[0], 1], flat.dtype)], axis=1)
                buffers.append(tf.scatter_nd(tf.expand_dims(g.indices, 1), rows,
                                             [shape[0], flat.shape[1] + 1]))
                per_layer.setdefault(sparse[k][0], [0, 0])
                per_layer[sparse[k][0]][0] += payload_bytes(buffers[-1])
            summed = (buffers if size == 1 else
                      mpi_ops._grouped_allreduce(buffers, name="hvdsync.sparse.dense", op=Sum,
                                                 process_set=self.reducer.process_set))
            for j, k in enumerate(dense):
                li, p, g = sparse[k]
                present = tf.cast(tf.where(summed[j][:, -1] > 0)[:, 0], g.indices.dtype)
                rows = tf.gather(summed[j][:, :-1], present) * tf.cast(scale, g.values.dtype)
                out[p] = tf.IndexedSlices(tf.reshape(rows, [-1, *g.values.shape[1:]]),
                                          present, g.dense_shape)
            per_layer[sparse[dense[0]][0]][1] += 1
        self.last_routes = {}
        for k, r in enumerate(routes):
            p = sparse[k][1]
            rows = int(tf.shape(out[p].indices)[0]) if r.route != "none" else 0
            self.last_routes[layout.key(p)] = (r.route, r.counts, rows)
        for li, (nbytes, collectives) in sorted(per_layer.items()):
            self.stats.sent(layout.names[li], nbytes, collectives)
        return out


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
