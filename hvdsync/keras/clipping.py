"""The arithmetic of ``clip=`` on Keras gradients, one layer at a time (the rules and their
running statistics are :class:`hvdsync.techniques.clip.technique.LayerClip`'s). The same function runs in the
compiled train function (the plain path: each layer's clip depends only on that layer's
gradient, so the graph executor clips and sends a layer as soon as backward produced it) and
eagerly in the step pipeline."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvdsync.techniques.clip.config import ClipConfig
from hvdsync.keras.ops import norm_of
from hvdsync.keras.comm import coalesce


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
    (:data:`hvdsync.techniques.clip.technique.ClipLayers`: row 0 the norms, row 1 0.0 where a layer was
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
