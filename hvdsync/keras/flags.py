"""What the host and the graph path's compiled step tell each other between steps:
:class:`HostFlags` (what the host decides that the step branches on) and :class:`Traffic`
(what a transport's traced rounds sent, counted on the device)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from hvdsync.core.pipeline import StepPipeline
from hvdsync.core.technique import Technique


class Traffic:
    """Bytes and collectives per layer that a transport's traced rounds sent, counted on the
    device (which branch ran -- warm-up or compressed -- is known at run time only): a
    growing ``[layers, 2]`` variable; :meth:`since_last` gives the step's share on the host."""

    def __init__(self, n_layers: int):
        self.variable = tf.Variable(tf.zeros([n_layers, 2], tf.int64), trainable=False,
                                    name="hvdsync_traffic")
        self._seen = np.zeros([n_layers, 2], np.int64)

    def add(self, li: int, nbytes, collectives: int) -> None:
        """In the step: layer ``li`` sent ``nbytes`` (an int, or a device scalar where the
        size is known at run time only) in ``collectives`` (where this runs)."""
        if isinstance(nbytes, int):
            row = np.zeros(self._seen.shape, np.int64)
            row[li] = (nbytes, collectives)
            self.variable.assign_add(tf.constant(row))
            return
        self.variable.scatter_nd_add([[li, 0], [li, 1]], tf.stack(
            [tf.cast(nbytes, tf.int64), tf.constant(collectives, tf.int64)]))

    def since_last(self, total: np.ndarray) -> np.ndarray:
        """On the host: what was counted since the last call (``total``: the variable read
        at the end of a step)."""
        step, self._seen = total - self._seen, total
        return step


class HostFlags:
    """What the host decides between steps that the traced step branches on
    (:meth:`hvdsync.core.technique.Technique.host_flags`: ``lowrank=``'s warm-up, a decider's
    plan; and whether a local step's host moments run before its update: the outer
    synchronization's anchors are taken before the first update only): a boolean variable (or
    vector) each. The step's host call returns them for the next step and the graph assigns
    them (:meth:`next_values`); outside a step -- at a trace, after a checkpoint or shared
    state was taken in, after a flush -- the host writes what changed (:meth:`refresh`)."""

    #: the step's own flag: the host's moments of a local step run before its update
    #: (:meth:`hvdsync.core.pipeline.StepPipeline.host_before_update`)
    BEFORE_UPDATE = "step.before_update"

    def __init__(self, pipeline: StepPipeline):
        self.pipeline = pipeline
        self._written = self._now()
        self.variables = {name: tf.Variable(value, trainable=False, name=f"hvdsync_{name}")
                          for name, value in self._written.items()}

    def _now(self) -> dict[str, Any]:
        flags = {f"{t.name}.{flag}": ([bool(x) for x in value] if isinstance(value, list)
                                      else bool(value))
                 for t in self.pipeline.techniques for flag, value in t.host_flags().items()}
        if self.pipeline.local_step is not None:
            flags[self.BEFORE_UPDATE] = self.pipeline.host_before_update()
        return flags

    def before_update(self) -> tf.Tensor:
        """Whether this step's host moments run before its update (a local step only)."""
        return self.variables[self.BEFORE_UPDATE].read_value()

    def of(self, technique: Technique) -> dict[str, tf.Tensor]:
        """``technique``'s flags, read in the step."""
        prefix = f"{technique.name}."
        return {name[len(prefix):]: v.read_value() for name, v in self.variables.items()
                if name.startswith(prefix)}

    def refresh(self) -> None:
        """Write what changed (eagerly: outside a step -- at a trace, after a flush or a
        restore)."""
        for name, value in self._now().items():
            if value != self._written[name]:  # an eager assign costs ~0.1 ms: on change only
                self.variables[name].assign(value)
                self._written[name] = value

    def next_values(self) -> list[np.ndarray]:
        """In the step's host call: every flag for the next step, which the graph assigns
        after the call (:meth:`assign_in_graph`). Not an eager assign from inside the host
        call: that one left, in about one 10-step fit in 40, one rank taking the other
        branch of a flag in the next step -- a collective on one rank only, a hang
        (benchmarks/results/keras_lab_notes.md, "Host flags")."""
        self._written = self._now()
        return [np.asarray(self._written[name], bool) for name in self.variables]

    def assign_in_graph(self, values: list) -> None:
        """In the step, after the host call: assign its :meth:`next_values`."""
        for v, x in zip(self.variables.values(), values):
            v.assign(tf.reshape(x, v.shape))
