"""Keras mixed precision (``mixed_float16``) with hvdsync: the loss scaler's skip decision
taken together by every rank (docs/mixed_precision.md).

Keras wraps the optimizer of a ``mixed_float16`` model in its ``LossScaleOptimizer``, which
unscales the gradients and, when they are finite, lets the wrapped optimizer apply them;
otherwise it skips the step and halves the scale. It decides from this rank's gradients
alone: one rank's overflow would make that rank skip hvdsync's exchange while the others
wait in it (a hang), and the ranks' scales would drift apart. So the ``LossScaleOptimizer``
that wraps an hvdsync optimizer -- passed to ``hvd.DistributedOptimizer``, added by
``model.compile`` or by hand -- decides with every rank: finite only if every rank's
gradients are (one small allreduce per step). The hvdsync optimizer inside then sees
unscaled gradients, so clip limits, threshold norms, select scores and every memory do too.
"""

from __future__ import annotations

import types

import tensorflow as tf
from horovod.tensorflow import mpi_ops
from horovod.tensorflow.mpi_ops import Min, ProcessSet
from keras.optimizers import LossScaleOptimizer

from hvdsync.safety.watchdog import guard

__all__ = ["LossScaleOptimizer", "share_loss_scale_decision"]


def share_loss_scale_decision(lso: LossScaleOptimizer, process_set: ProcessSet) -> None:
    """Make ``lso`` (wrapping an hvdsync optimizer) call its gradients finite only if they
    are on every rank of ``process_set``: every rank then skips, or applies, together."""
    if getattr(lso, "_hvdsync_shared", False):
        return

    def check_finite(self, grads):
        local = LossScaleOptimizer.check_finite(self, grads)
        if process_set.size() == 1:
            return local
        with guard("the loss scaler's shared finite check"):
            every = mpi_ops._allreduce(tf.cast(local, tf.int32), op=Min,
                                       name="hvdsync.loss_scale.finite",
                                       process_set=process_set)
        return tf.cast(every, tf.bool)

    lso.check_finite = types.MethodType(check_finite, lso)
    lso._hvdsync_shared = True
