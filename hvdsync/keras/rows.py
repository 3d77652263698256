"""Row-sparse gradients in Keras -- ``tf.IndexedSlices`` (an ``Embedding``'s) -- as
:class:`hvdsync.techniques.sparse.ports.RowSparse`: what the core's sparse exchange (hvdsync/techniques/sparse/exchange.py)
packs, scatters and sums, eagerly and in Keras' compiled step alike. Rows travel in their own
dtype (Horovod's TensorFlow path compresses dense tensors only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hvdsync.keras.comm import coalesce, payload_bytes


class KerasRows:
    """:class:`hvdsync.techniques.sparse.ports.RowSparse` over ``tf.IndexedSlices`` (one sparse dimension)."""

    @staticmethod
    def coalesce(g: tf.IndexedSlices) -> tuple[tf.IndexedSlices, Any]:
        merged = coalesce(g)
        return merged, int(tf.shape(g.indices)[0]) - int(tf.shape(merged.indices)[0])

    @staticmethod
    def layout(g: tf.IndexedSlices) -> tuple[int, int]:
        return int(tf.size(tf.unique(g.indices).y)), 1

    @staticmethod
    def row_count(g: tf.IndexedSlices) -> int:
        return int(tf.shape(g.indices)[0])

    @staticmethod
    def empty(like, sparse_dim: int) -> tf.IndexedSlices:
        shape = [int(d) for d in like.shape]
        return tf.IndexedSlices(tf.zeros([0, *shape[1:]], like.dtype), tf.zeros([0], tf.int64),
                                tf.constant(shape, tf.int64))

    @staticmethod
    def as_rows(g, sparse_dim: int) -> tf.IndexedSlices:
        return tf.IndexedSlices(g, tf.range(tf.shape(g, out_type=tf.int64)[0]),
                                tf.shape(g, out_type=tf.int64))

    @staticmethod
    def pack(g: tf.IndexedSlices) -> tuple[tf.Tensor, Any]:
        rows = tf.reshape(g.values, [-1, _width(g.values.shape)])
        index = tf.bitcast(tf.cast(g.indices, tf.int64), g.values.dtype)
        if index.shape.rank == 1:  # same width (float64)
            index = tf.expand_dims(index, 1)
        return tf.concat([rows, index], axis=1), g.indices.dtype

    @staticmethod
    def unpack_summed(gathered: tf.Tensor, ctx: Any, shape: tuple, sparse_dim: int,
                      divide_by: int) -> tf.IndexedSlices:
        k = 8 // gathered.dtype.size
        width = _width(shape)  # (static: a traced allgather's output shape is not)
        index = gathered[:, width:]
        index = tf.bitcast(index[:, 0] if k == 1 else index, tf.int64)
        values = tf.reshape(gathered[:, :width], [-1, *shape[1:]])
        merged = coalesce(tf.IndexedSlices(values, tf.cast(index, ctx),
                                            tf.constant(shape, tf.int64)))
        return tf.IndexedSlices(_divided(merged.values, divide_by), merged.indices,
                                tf.constant(shape, tf.int64))

    @staticmethod
    def scatter(g: tf.IndexedSlices, shape: tuple) -> tuple[tf.Tensor, Any]:
        flat = tf.reshape(g.values, [-1, _width(shape)])
        rows = tf.concat([flat, tf.ones([tf.shape(flat)[0], 1], flat.dtype)], axis=1)
        return (tf.scatter_nd(tf.expand_dims(g.indices, 1), rows,
                              [shape[0], flat.shape[1] + 1]), g.indices.dtype)

    @staticmethod
    def present_rows(summed: tf.Tensor, ctx: Any, shape: tuple, sparse_dim: int,
                     divide_by: int) -> tf.IndexedSlices:
        present = tf.cast(tf.where(summed[:, -1] > 0)[:, 0], ctx)
        rows = _divided(tf.gather(summed[:, :-1], present), divide_by)
        return tf.IndexedSlices(tf.reshape(rows, [-1, *shape[1:]]), present,
                                tf.constant(shape, tf.int64))

    @staticmethod
    def codes(codes: Sequence[int], like: Any) -> tf.Tensor:
        t = tf.reshape(tf.convert_to_tensor(codes, tf.int64), [1, -1])
        return t if like is None else tf.reshape(tf.bitcast(t, like.dtype), [1, -1])

    @staticmethod
    def codes_of(gathered: tf.Tensor, size: int) -> list[list[int]]:
        return np.asarray(from_values(gathered, size)).reshape(size, -1).tolist()

    @staticmethod
    def dtype_key(t: tf.Tensor) -> str:
        return t.dtype.name

    @staticmethod
    def nbytes(t: tf.Tensor) -> int:
        return payload_bytes(t)


def from_values(gathered: tf.Tensor, size: int) -> tf.Tensor:
    """Inverse of :meth:`KerasRows.codes` on the gathered ``[size, w]``: ``[size, codes]``."""
    if gathered.dtype == tf.int64:
        return gathered
    k = 8 // gathered.dtype.size
    bits = tf.reshape(gathered, [size, -1] if k == 1 else [size, -1, k])
    return tf.bitcast(bits, tf.int64)


def _divided(values: tf.Tensor, divide_by: int) -> tf.Tensor:
    return values if divide_by == 1 else values / tf.constant(divide_by, values.dtype)


def _width(shape) -> int:
    """Values per row (the row shape is static: the variable's)."""
    return int(np.prod([int(d) for d in shape[1:]]))
