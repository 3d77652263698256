"""Horovod's own way to train a Keras 3 model: ``horovod.tensorflow.DistributedGradientTape``
in a custom ``train_step`` (``horovod.tensorflow.keras`` does not work on Keras 3). The peer
hvdsync.keras is measured against (benchmarks) and checked against (tests)."""

from __future__ import annotations


def horovod_tape_model(model):
    """A copy of the functional/sequential ``model``'s graph whose ``train_step`` averages
    gradients with ``DistributedGradientTape`` (same layers, same variables)."""
    import keras
    import tensorflow as tf
    import horovod.tensorflow as htf

    class HorovodTapeModel(keras.Model):
        def train_step(self, data):
            x, y = data[0], data[1]
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            tape = htf.DistributedGradientTape(tape)
            # Horovod's tape needs tf.Variables (it calls .ref()); Keras 3 wraps them
            grads = tape.gradient(loss, [v.value for v in self.trainable_variables])
            self.optimizer.apply(grads, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return HorovodTapeModel(model.inputs, model.outputs)
