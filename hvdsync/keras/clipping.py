"""Applying :mod:`hvdsync.clipping` decisions to Keras gradients inside the compiled train
function, one layer at a time.

Each layer's clip is built from that layer's gradient alone and its allreduce from the clipped
result, so the graph executor clips and sends a layer as soon as backward has produced it --
the pipelining of technique 1 comes from dataflow. The host is asked only for the adaptive
limits (``ema``/``variance``, from the running statistics of earlier steps); the norms seen
this step go back to the host once per step (:meth:`GraphClipper.end_step`).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import tensorflow as tf

from hvdsync.clipping import ClipConfig, ClipPolicy
from hvdsync.keras.comm import coalesce, global_norm
from hvdsync.stats import SyncStats


class GraphClipper:
    """Builds the clip of one layer's gradients and counts what it did (``clipped``: layers
    whose gradient changed; ``nonfinite``: layers with NaN/Inf)."""

    def __init__(self, config: ClipConfig, layer_names: list[str], stats: SyncStats):
        self.config = config
        self.policy = ClipPolicy(config, len(layer_names))
        self.layer_names = layer_names
        self.stats = stats
        self._warned_nonfinite = False

    def _host_limit(self, li: int) -> tf.Tensor:
        """``max_norm`` and the adaptive limits of layer ``li`` as of the last step."""
        c = self.config
        if c.ema is None and c.variance is None:
            return tf.constant(c.max_norm if c.max_norm is not None else math.inf, tf.float32)
        limit = tf.numpy_function(lambda: np.float32(self.policy.norm_limit(li)), [],
                                  tf.float32, stateful=True)
        return tf.reshape(limit, [])

    def clip(self, li: int, grads: list, params: list) -> tuple[list, tf.Tensor]:
        """Clipped ``grads`` of layer ``li`` and a record ``[pre-clip norm, clipped]``."""
        c = self.config
        grads = [coalesce(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        raw_norm = global_norm(grads)
        if c.value is not None:
            grads = [_map_values(g, lambda v: tf.clip_by_value(v, *(tf.cast(x, v.dtype)
                                                                      for x in c.value)))
                     for g in grads]
        norm = global_norm(grads) if c.value is not None else raw_norm
        limit = self._host_limit(li)
        if c.ratio is not None:
            param_norm = global_norm([p.value for p in params])
            limit = tf.minimum(limit, c.ratio * tf.maximum(param_norm, c.eps))
        finite = tf.math.is_finite(raw_norm)
        # Scale only down (a zero norm gives inf -> 1); leave non-finite alone.
        scale = tf.where(finite, tf.minimum(limit / norm, 1.0), 1.0)
        grads = [_map_values(g, lambda v: v * tf.cast(scale, v.dtype)) for g in grads]
        if c.nonfinite == "zero":
            grads = [_map_values(g, lambda v: tf.where(finite, v, tf.zeros_like(v)))
                     for g in grads]
        clipped = tf.logical_and(tf.logical_or(scale < 1.0, tf.not_equal(norm, raw_norm)), finite)
        return grads, tf.stack([raw_norm, tf.cast(clipped, tf.float32)])

    def end_step(self, layers: list[int], records: np.ndarray) -> None:
        """Fold this step's norms into the running statistics and count what was clipped."""
        for li, (norm, was_clipped) in zip(layers, records.reshape(-1, 2).tolist()):
            self.policy.observe(li, norm)
            if was_clipped:
                self.stats.count("clipped")
            if not math.isfinite(norm):
                self.stats.count("nonfinite")
                if not self._warned_nonfinite:
                    self._warned_nonfinite = True
                    what = "sent as zeros" if self.config.nonfinite == "zero" else "sent unchanged"
                    warnings.warn(f"hvdsync: non-finite gradient in layer "
                                  f"{self.layer_names[li]!r} ({what}, clip "
                                  f"nonfinite={self.config.nonfinite!r}); counted in stats as "
                                  "'nonfinite', further warnings suppressed", RuntimeWarning,
                                  stacklevel=2)


def _map_values(g, fn):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(fn(g.values), g.indices, g.dense_shape)
    return fn(g)
