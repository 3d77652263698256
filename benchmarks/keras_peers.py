"""Horovod's own way to train a Keras 3 model: ``horovod.tensorflow.DistributedGradientTape``
in a custom ``train_step`` (``horovod.tensorflow.keras`` does not work on Keras 3). The peer
hvdsync.keras is measured against (benchmarks) and checked against (tests)."""

from __future__ import annotations


#: what :func:`horovod_tape_model` adds to each step with ``statistics=``: the least a decider
#: (``threshold=``, ``select=``) computes every step -- each layer's squared gradient norm --
#: per layer, packed (every gradient concatenated, one segment sum), or per layer and then
#: allreduced as a decider's control round is (docs/keras.md, "A decider's floor")
STATISTICS = ("layers", "packed", "layers, shared")


def horovod_tape_model(model, statistics: str | None = None):
    """A copy of the functional/sequential ``model``'s graph whose ``train_step`` averages
    gradients with ``DistributedGradientTape`` (same layers, same variables); with
    ``statistics`` (one of :data:`STATISTICS`), each step also computes its layers' squared
    gradient norms into a variable (an experiment's floor, not Horovod's behaviour)."""
    import keras
    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as htf
    if statistics not in (None, *STATISTICS):
        raise ValueError(f"statistics must be None or one of {STATISTICS}, got {statistics!r}")

    def layer_statistics(grads, variables):
        layer_of = [v.path.rsplit("/", 1)[0] for v in variables]
        names = list(dict.fromkeys(layer_of))
        if statistics == "packed":
            sizes = [int(np.prod(v.shape)) for v in variables]
            segments = np.repeat([names.index(n) for n in layer_of], sizes).astype("int32")
            flat = tf.concat([tf.reshape(g, [-1]) for g in grads], 0)
            return tf.math.unsorted_segment_sum(tf.square(flat), segments, len(names))
        norms = tf.stack([tf.add_n([tf.nn.l2_loss(g) for g, n in zip(grads, layer_of)
                                    if n == name]) for name in names])
        return htf.allreduce(norms, name="floor.statistics") if "shared" in statistics else norms

    class HorovodTapeModel(keras.Model):
        def train_step(self, data):
            x, y = data[0], data[1]
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            if statistics is None:
                tape = htf.DistributedGradientTape(tape)
            # Horovod's tape needs tf.Variables (it calls .ref()); Keras 3 wraps them
            grads = tape.gradient(loss, [v.value for v in self.trainable_variables])
            if statistics is not None:  # of the local gradients, then the tape's allreduces
                # (kept in a variable: a value nothing reads would be pruned)
                self.floor_statistics.assign(layer_statistics(grads,
                                                              self.trainable_variables))
                grads = [htf.allreduce(g, op=htf.Average) for g in grads]
            self.optimizer.apply(grads, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    tape_model = HorovodTapeModel(model.inputs, model.outputs)
    if statistics is not None:
        layers = {v.path.rsplit("/", 1)[0] for v in tape_model.trainable_variables}
        tape_model.floor_statistics = tf.Variable(tf.zeros([len(layers)]), trainable=False)
    return tape_model
