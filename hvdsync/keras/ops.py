"""The tensor arithmetic the framework-neutral techniques ask of Keras' TensorFlow backend
(:class:`hvdsync.core.ports.TensorOps`), eager or inside a traced step, and the float32 norms both
adapters compute alike (docs/design.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from hvdsync.keras.comm import coalesce
from hvdsync.techniques.clip.config import ClipConfig


def norm_of(tensors: Sequence) -> tf.Tensor:
    """L2 norm of all ``tensors`` together as a float32 scalar (``IndexedSlices``: their
    values, so coalesce them first if rows repeat): each tensor's norm in its precision (at
    least float32), their norm, rounded once at the end -- as the torch adapter computes it,
    so both give the same float32 (docs/design.md)."""
    values = [t.values if isinstance(t, tf.IndexedSlices) else t for t in tensors]
    if not values:
        return _zero()
    wide = _wide(values)
    # l2_loss: half the sum of squares in one pass (square-then-sum writes a temporary the
    # size of the tensor); halving and doubling are exact. Each tensor's sum of squares,
    # their sum, its root: as the torch adapter computes it (one multi-tensor op there)
    squares = [tf.nn.l2_loss(v if v.dtype == wide else tf.cast(v, wide)) for v in values]
    total = squares[0] if len(squares) == 1 else tf.add_n(squares)
    return tf.cast(tf.sqrt(2 * total), tf.float32)


def _wide(tensors: Sequence) -> tf.DType:
    """The precision hvdsync's statistics are computed in: the tensors', at least float32."""
    return tf.float64 if any(t.dtype == tf.float64 for t in tensors) else tf.float32


_ZERO: list = []


def _zero() -> tf.Tensor:
    """A float32 zero, made once (an eager op costs more than the arithmetic here); in a
    trace, a constant of that graph (a tensor of another graph cannot be used there)."""
    if not tf.executing_eagerly():
        return tf.zeros((), tf.float32)
    if not _ZERO:
        _ZERO.append(tf.zeros((), tf.float32))
    return _ZERO[0]


def one_call_when_eager(fn: Callable, reduce_retracing: bool = False) -> Callable:
    """``fn`` (TensorFlow ops, no Python state) as one traced function when called eagerly --
    the step pipeline inside ``tf.py_function``, where each eager op costs 50-150 us of
    dispatch here, more than its arithmetic (``bad()`` over a 12-tensor model: 0.71 ms eager,
    0.48 ms as one call; int8 encoding of 65k values 1.8-2.3 ms, 1.0 ms) -- and as plain ops
    inside a trace (the compiled train function builds them into its own graph). Same ops
    either way: the same numbers. Without autograph (plain ops, no Python control flow on
    tensors): with it, the first calls in a process cost ~3 s of conversion (measured on
    tests/test_keras_outer.py: 12.3-13.0 s against 9.7 s; without it 9.9-10.2 s)."""
    traced = tf.function(fn, reduce_retracing=reduce_retracing, autograph=False)

    def run(*args):
        return traced(*args) if tf.executing_eagerly() else fn(*args)
    run.__doc__ = fn.__doc__
    return run


def _bad_ops(tensors: list) -> tf.Tensor:
    finite = [tf.reduce_all(tf.math.is_finite(t.values if isinstance(t, tf.IndexedSlices)
                                              else t)) for t in tensors]
    return 1.0 - tf.cast(tf.reduce_all(tf.stack(finite)), tf.float32)


#: shapes do not matter to it: one trace per list of ranks and dtypes
_bad = one_call_when_eager(_bad_ops, reduce_retracing=True)


def _quantize_blocks(flat, chunk: int) -> list:
    """:meth:`KerasOps.quantize_blocks` (inside the caller's trace: the shapes are static)."""
    n = int(flat.shape[0])
    rows = tf.reshape(tf.pad(flat, [[0, -n % chunk]]), [-1, chunk])
    scale = tf.reduce_max(tf.abs(rows), axis=1) / 127.0
    safe = tf.where(scale > 0, scale, tf.ones_like(scale))
    codes = tf.cast(tf.clip_by_value(tf.round(rows / safe[:, None]), -127, 127), tf.int8)
    return [tf.reshape(codes, [-1])[:n], scale]  # the padding is not sent


def _dequantize_blocks(codes, scale, chunk: int, size: Optional[int]):
    """:meth:`KerasOps.dequantize_blocks`."""
    if size is None:
        rows = tf.pad(tf.cast(codes, tf.float32), [[0, -int(codes.shape[0]) % chunk]])
        return tf.reshape(tf.reshape(rows, [-1, chunk]) * scale[:, None], [-1])
    n = int(codes.shape[0]) // size
    rows = tf.pad(tf.reshape(tf.cast(codes, tf.float32), [size, n]), [[0, 0], [0, -n % chunk]])
    return tf.reshape(tf.reshape(rows, [size, -1, chunk]) * tf.reshape(scale, [size, -1, 1]),
                      [size, -1])[:, :n]


def _unflat(flat, like) -> list:
    """:meth:`KerasOps.unflat`."""
    out, i = [], 0
    for t in like:
        shape = tuple(int(d) for d in t.shape)
        n = int(np.prod(shape))
        out.append(tf.cast(tf.reshape(flat[i:i + n], shape), t.dtype))
        i += n
    return out


# -- clip=, one layer at a time: the same function runs in the compiled train function (the
# plain path: each layer's clip depends only on that layer's gradient, so the graph executor
# clips and sends a layer as soon as backward produced it) and eagerly in the step pipeline
# (the rules and their running statistics are hvdsync.techniques.clip.technique.Clip's)
def clip_layer(grads: list, params: list, c: ClipConfig, limit) -> tuple[list, tf.Tensor,
                                                                            tf.Tensor]:
    """Clipped ``grads`` of one layer, its pre-clip norm and whether it was clipped
    (``limit``: a float or a float32 scalar tensor; ``params``: the layer's variable values,
    needed by the ``ratio`` rule only)."""
    if not grads:
        return grads, None, None
    grads = [coalesce(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    raw_norm = norm_of(grads)
    if c.value is not None:
        grads = [_map_values(g, lambda v: tf.clip_by_value(v, *(tf.constant(x, v.dtype)
                                                                  for x in c.value)))
                 for g in grads]
    norm = norm_of(grads) if c.value is not None else raw_norm
    limit = tf.cast(limit, tf.float32)
    if c.ratio is not None:
        limit = tf.minimum(limit, c.ratio * tf.maximum(norm_of(params), c.eps))
    finite = tf.math.is_finite(raw_norm)
    # Scale only down (a zero norm gives inf -> 1); leave non-finite alone.
    # (1 / norm) * limit in float32, as the torch adapter computes it: the same scale
    scale = tf.where(finite, tf.minimum(tf.math.reciprocal(norm) * limit, 1.0), 1.0)
    cast = {}  # the scale in each gradient dtype, cast once (a node less per variable)
    for g in grads:
        d = (g.values if isinstance(g, tf.IndexedSlices) else g).dtype
        if d not in cast:
            cast[d] = scale if d == tf.float32 else tf.cast(scale, d)
    grads = [_map_values(g, lambda v: v * cast[v.dtype]) for g in grads]
    clipped = tf.logical_and(tf.logical_or(scale < 1.0, tf.not_equal(norm, raw_norm)), finite)
    return grads, raw_norm, clipped


def clip_layers(layers: list, params: list, c: ClipConfig, limits) -> tuple[list, Any]:
    """:func:`clip_layer` for a group of layers (the step pipeline's form: Keras' eager step
    has every layer at once): the clipped layers and the group's record
    (:meth:`hvdsync.techniques.clip.ports.ClipKernel.clip_layers`: row 0 the norms, row 1 0.0 where a layer was
    clipped, else 1.0; ``None`` for no layer)."""
    if not layers:
        return layers, None
    each = limits if isinstance(limits, (list, tuple)) else [limits] * len(layers)
    out = [clip_layer(grads, params[i] if params else [], c, limit)
           for i, (grads, limit) in enumerate(zip(layers, each))]
    return ([grads for grads, _, _ in out],
            tf.stack([tf.stack([norm for _, norm, _ in out]),
                      tf.stack([1.0 - tf.cast(was, tf.float32) for _, _, was in out])]))


def _map_values(g, fn):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(fn(g.values), g.indices, g.dense_shape)
    return fn(g)


class KerasOps:
    """:class:`hvdsync.core.ports.TensorOps` on TensorFlow tensors (immutable: new tensors),
    and the techniques' own ports (``hvdsync/techniques/<name>/ports.py``)."""

    clip_layers = staticmethod(clip_layers)

    @staticmethod
    def add(a, b):
        return a + b

    @staticmethod
    def mul(a, b):
        return a * b

    @staticmethod
    def bad(tensors: Sequence) -> tf.Tensor:
        if not tensors:
            return _zero()
        return _bad(list(tensors))

    @staticmethod
    def all_finite(tensors: Sequence) -> bool:
        return not KerasOps.to_host([KerasOps.bad(tensors)])[0]

    @staticmethod
    def zero_if(flag, tensors: Sequence) -> list:
        tensors = list(tensors)
        if not tensors:
            return []
        # one branch for all (a where per tensor costs three ops each in the compiled step)
        return tf.cond(flag > 0, lambda: [tf.zeros_like(t) for t in tensors],
                       lambda: [tf.identity(t) for t in tensors])

    @staticmethod
    def accumulate(acc, x, sign: int = 1):
        return acc + x if sign > 0 else acc - x

    @staticmethod
    def clone(t):
        return tf.identity(t)

    @staticmethod
    def clone_all(tensors: Sequence) -> list:
        return [tf.identity(t) for t in tensors]

    @staticmethod
    def accumulate_all(accs: Sequence, xs: Sequence, sign: int = 1) -> list:
        return [a + x if sign > 0 else a - x for a, x in zip(accs, xs)]

    @staticmethod
    def norm(tensors: Sequence) -> tf.Tensor:
        return norm_of(tensors)

    @staticmethod
    def dot(pairs: Sequence) -> tf.Tensor:
        wide = _wide([x for pair in pairs for x in pair])
        return tf.cast(tf.add_n([tf.reduce_sum(tf.cast(a, wide) * tf.cast(b, wide))
                                 for a, b in pairs]), tf.float32)

    @staticmethod
    def norms(layers: Sequence[Sequence]) -> tf.Tensor:
        if not layers:
            return tf.zeros([0], tf.float32)
        return tf.stack([norm_of(ts) for ts in layers])

    @staticmethod
    def dots(layers: Sequence[Sequence]) -> tf.Tensor:
        if not layers:
            return tf.zeros([0], tf.float32)
        return tf.stack([KerasOps.dot(pairs) if pairs else _zero() for pairs in layers])

    @staticmethod
    def in_layer_order(n: int, parts: Sequence) -> tf.Tensor:
        parts = [(list(lis), v) for lis, v in parts if len(lis)]
        if len(parts) == 1 and parts[0][0] == list(range(n)):
            return parts[0][1]
        if not parts:
            return tf.zeros([n], tf.float32)
        index = tf.constant([[li] for lis, _ in parts for li in lis], tf.int32)
        return tf.scatter_nd(index, tf.concat([v for _, v in parts], 0), [n])

    @staticmethod
    def concat(parts: Sequence, dtype: str = "float32") -> tf.Tensor:
        return tf.concat([tf.cast(tf.reshape(p, [-1]), dtype) for p in parts], 0)

    @staticmethod
    def read(vectors: Sequence) -> list[list[float]]:
        if not vectors:
            return []
        values = tf.concat([tf.cast(tf.reshape(v, [-1]), tf.float32) for v in vectors],
                           0).numpy().tolist()
        out, i = [], 0
        for v in vectors:
            n = int(np.prod(v.shape))
            out.append(values[i:i + n])
            i += n
        return out

    @staticmethod
    def zero() -> tf.Tensor:
        return _zero()

    @staticmethod
    def to_host(scalars: Sequence) -> list[float]:
        if not scalars:
            return []
        return tf.stack([s if s.dtype == tf.float32 else tf.cast(s, tf.float32)
                         for s in scalars]).numpy().tolist()

    @staticmethod
    def nbytes(x) -> int:
        return int(np.prod(x.shape)) * tf.as_dtype(x.dtype).size

    @staticmethod
    def dtype_key(x) -> str:
        return tf.as_dtype(x.dtype).name

    # -- low-rank factors (lowrank=): a kernel as a matrix of its output units (the last
    # dimension, Keras' layout) by the rest
    @staticmethod
    def matrix_shape(x) -> Optional[tuple[int, int]]:
        shape = [int(d) for d in x.shape]
        if len(shape) < 2 or not all(shape):
            return None
        return int(np.prod(shape[:-1])), shape[-1]

    @staticmethod
    def matrix(x):
        x = tf.convert_to_tensor(x)
        # a Dense kernel is a matrix already: no reshape (an eager op costs 50-150 us)
        return x if x.shape.rank == 2 else tf.reshape(x, [-1, int(x.shape[-1])])

    @staticmethod
    def from_matrix(m, like):
        return m if m.shape == like.shape else tf.reshape(m, like.shape)

    @staticmethod
    def matmul(a, b, transpose_a: bool = False, transpose_b: bool = False):
        return tf.linalg.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)

    @staticmethod
    def matmul_all(a: Sequence, b: Sequence, transpose_a: bool = False,
                   transpose_b: bool = False) -> list:
        return [KerasOps.matmul(x, y, transpose_a, transpose_b) for x, y in zip(a, b)]

    @staticmethod
    def orthonormal_all(ps: Sequence) -> list:
        return [KerasOps.orthonormal(p) for p in ps]

    @staticmethod
    def orthonormal(p):
        if p.dtype in (tf.float16, tf.bfloat16):  # no half-precision QR
            return tf.cast(tf.linalg.qr(tf.cast(p, tf.float32)).q, p.dtype)
        return tf.linalg.qr(p).q

    @staticmethod
    def from_host(values, like):
        return tf.constant(values, dtype=like.dtype)

    # -- the outer synchronization (delay=): parameters are Keras variables
    @staticmethod
    def add_scaled(acc, x, alpha: float):
        return acc + tf.constant(alpha, acc.dtype) * x  # (a cast would go through float32)

    @staticmethod
    def zeros_like(t):
        return tf.zeros_like(t)

    @staticmethod
    def assign(target, value) -> None:
        target.assign(value)

    @staticmethod
    def cast(t, dtype: Optional[str] = None, like=None):
        return tf.cast(t, dtype if dtype is not None else like.dtype)

    # -- the codecs' primitives (hvdsync.core.wire.CodecOps), run inside fused()
    @staticmethod
    def flat(tensors: Sequence):
        return tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], 0)

    @staticmethod
    def unflat(flat, like: Sequence) -> list:
        return _unflat(flat, like)

    @staticmethod
    def bitcast(t, dtype: str):
        return tf.bitcast(t, tf.as_dtype(dtype))

    @staticmethod
    def rows(flat, size: int):
        return tf.reshape(flat, [size, -1])

    @staticmethod
    def quantize_blocks(flat, chunk: int) -> list:
        return _quantize_blocks(flat, chunk)

    @staticmethod
    def dequantize_blocks(codes, scale, chunk: int, size: Optional[int] = None):
        return _dequantize_blocks(codes, scale, chunk, size)

    @staticmethod
    def average_rows(rows, like: Sequence) -> list:
        size = int(rows.shape[0])
        total = None
        for r in range(size):  # in rank order: the same bits on every rank
            mine = _unflat(rows[r], like)
            total = mine if total is None else [a + b for a, b in zip(total, mine)]
        return [KerasOps.add_scaled(tf.zeros_like(t), t, 1.0 / size) for t in total]

    @staticmethod
    def add_all(a: Sequence, b: Sequence) -> list:
        return [x + y for x, y in zip(a, b)]

    @staticmethod
    def sub_all(a: Sequence, b: Sequence) -> list:
        return [x - y for x, y in zip(a, b)]

    @staticmethod
    def add_scaled_all(a: Sequence, b: Sequence, alpha: float) -> list:
        return [KerasOps.add_scaled(x, y, alpha) for x, y in zip(a, b)]

    @staticmethod
    def assign_all(targets: Sequence, values: Sequence) -> None:
        for t, v in zip(targets, values):
            t.assign(v)

    @staticmethod
    def cond(flag, yes: Callable, no: Callable):
        return tf.cond(flag, yes, no)

    @staticmethod
    def where(flag, yes, no):
        return tf.nest.map_structure(lambda a, b: tf.where(flag, a, b), yes, no)

    @staticmethod
    def vector(scalars: Sequence, dtype: str = "float64") -> tf.Tensor:
        return tf.stack([tf.cast(s, dtype) for s in scalars])

    @staticmethod
    def fused(fn: Callable) -> Callable:
        # one trace per shape structure (a fragment's): decoding needs the static shapes
        traced = one_call_when_eager(fn)

        def run(*args):
            # a Keras variable as an argument costs ~0.1 ms a call to convert; its backing
            # TensorFlow variable almost nothing
            return traced(*[[x.value if isinstance(x, keras.Variable) else x for x in a]
                            if isinstance(a, list) else a for a in args])
        return run
