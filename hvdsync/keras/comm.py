"""Communicators for Keras: the pieces that move gradient bytes (TensorFlow tensors), built on
``horovod.tensorflow`` ops (Horovod's own Keras wrapper does not work with Keras 3).

Two execution contexts use them:

* the plain path builds Horovod ops into the compiled train function (graph mode; op names
  come from the graph, as in Horovod's TensorFlow optimizer);
* the techniques run their exchange eagerly inside ``tf.py_function`` (see
  :mod:`hvdsync.keras.optimizer`). Eager Horovod ops are matched across ranks by the name they
  are given, so every eager call here passes an explicit name, the same on every rank.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Optional

import numpy as np
import tensorflow as tf
from horovod.tensorflow import allreduce as hvd_allreduce
from horovod.tensorflow import mpi_ops
from horovod.tensorflow.compression import FP16Compressor
from horovod.tensorflow.mpi_ops import Average, ProcessSet, Sum

from hvdsync.stats import SyncStats


def payload_bytes(g) -> int:
    """Bytes a collective carries for ``g`` (values and indices for ``IndexedSlices``)."""
    if isinstance(g, tf.IndexedSlices):
        return payload_bytes(g.values) + payload_bytes(g.indices)
    n = g.shape.num_elements()
    if n is None:  # dynamic shape: only known when running eagerly
        n = int(tf.size(g))
    return n * g.dtype.size


def coalesce(g: tf.IndexedSlices) -> tf.IndexedSlices:
    """Sum duplicate rows (Keras' embedding gradient has one row per lookup)."""
    unique, position = tf.unique(g.indices)
    values = tf.math.unsorted_segment_sum(g.values, position, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, g.dense_shape)


class Reducer:
    """Averages (or sums) gradients across ranks as Horovod's ``DistributedOptimizer`` does:
    dense gradients of one layer in one grouped allreduce (with ``compression`` and
    ``gradient_predivide_factor``), ``IndexedSlices`` through Horovod's allgather path, or
    densified with ``sparse_as_dense``."""

    def __init__(self, compression, op, gradient_predivide_factor: float,
                 sparse_as_dense: bool, process_set: ProcessSet):
        self.compression = compression
        self.op = op
        self.predivide = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

    @property
    def size(self) -> int:
        return self.process_set.size()

    def _op_and_scales(self) -> tuple:
        if self.op == Average and self.predivide != 1.0:
            return Sum, 1.0 / self.predivide, self.predivide / self.size
        return self.op, 1.0, 1.0

    def wire_bytes(self, g) -> int:
        """Payload after compression (fp16 halves float32 dense tensors)."""
        if isinstance(g, tf.IndexedSlices) and not self.sparse_as_dense:
            return payload_bytes(g)
        n = payload_bytes(tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g)
        fp16 = isinstance(self.compression, type) and issubclass(self.compression, FP16Compressor)
        if fp16 and g.dtype.is_floating and g.dtype.size > 2:
            return n * 2 // g.dtype.size
        return n

    def reduce(self, grads: Sequence, name: Optional[str] = None) -> list:
        """Reduce one layer's gradients. ``name`` is required when running eagerly."""
        if self.size == 1:
            return list(grads)
        op, pre, post = self._op_and_scales()
        out: list = [None] * len(grads)
        dense_pos = []
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                if self.sparse_as_dense:
                    grads = list(grads)
                    grads[i] = tf.convert_to_tensor(g)
                    dense_pos.append(i)
                else:
                    out[i] = hvd_allreduce(g, op=op, compression=self.compression,
                                           prescale_factor=pre, postscale_factor=post,
                                           name=None if name is None else f"{name}.sparse{i}",
                                           process_set=self.process_set)
            else:
                dense_pos.append(i)
        if dense_pos:
            pairs = [self.compression.compress(grads[i]) for i in dense_pos]
            reduced = mpi_ops._grouped_allreduce([c for c, _ in pairs], name=name, op=op,
                                                 prescale_factor=pre, postscale_factor=post,
                                                 process_set=self.process_set)
            for i, r, (_, ctx) in zip(dense_pos, reduced, pairs):
                out[i] = self.compression.decompress(r, ctx)
        return out

    def reduce_layers(self, layers: Sequence[tuple[str, Sequence]], tag: str) -> list[list]:
        """Eager: reduce several layers' dense gradients in **one** grouped allreduce -- one
        negotiation round instead of one per layer (eager Horovod ops block, so separate calls
        would run one after the other). Named by ``tag`` and the layer names, which every rank
        has alike. Returns the reduced gradients per layer."""
        if not layers:
            return []
        flat = [g for _, grads in layers for g in grads]
        key = zlib.crc32("|".join(name for name, _ in layers).encode())
        reduced = self.reduce(flat, name=f"hvdsync.{tag}.{key:08x}")
        out, i = [], 0
        for _, grads in layers:
            out.append(reduced[i:i + len(grads)])
            i += len(grads)
        return out

    def record_sent(self, layers: Sequence[tuple[str, Sequence]], stats: SyncStats) -> None:
        """Count :meth:`reduce_layers`' payload per layer (one collective for all of them)."""
        for i, (name, grads) in enumerate(layers):
            stats.sent(name, sum(self.wire_bytes(g) for g in grads),
                       1 if i == 0 and self.size > 1 else 0)

    def collectives(self, grads: Sequence) -> int:
        """How many collectives :meth:`reduce` runs for ``grads``."""
        sparse = sum(isinstance(g, tf.IndexedSlices) for g in grads) if not self.sparse_as_dense else 0
        return sparse * 2 + (1 if sparse < len(grads) else 0)


def control_allreduce(values: list[float], name: str, process_set: ProcessSet,
                      stats: SyncStats) -> list[float]:
    """The control plane (eager): average a small vector of per-layer statistics across ranks
    in one collective, so every rank decides from the same numbers."""
    x = tf.constant(np.asarray(values, dtype=np.float64))
    stats.control(payload_bytes(x))
    if process_set.size() == 1:
        return [float(v) for v in values]
    out = mpi_ops._allreduce(x, name=name, op=Average, process_set=process_set)
    return out.numpy().tolist()


def global_norm(tensors: Sequence) -> tf.Tensor:
    """L2 norm of all ``tensors`` together as a float32 scalar (``IndexedSlices``: their
    values, so coalesce them first if rows repeat)."""
    parts = [tf.reduce_sum(tf.square(tf.cast(t.values if isinstance(t, tf.IndexedSlices) else t,
                                             tf.float32))) for t in tensors]
    return tf.sqrt(tf.add_n(parts)) if parts else tf.zeros((), tf.float32)
