"""Selected layer pushes for Keras (technique 4; the rules live in :mod:`hvdsync.select`).

Memory: ``residual[path]`` holds what this rank computed for a variable and has not pushed yet.
A layer chosen for this step sends ``g + residual``; a layer not chosen adds ``g`` to its
residual and is not updated this step: Keras applies every gradient of a step in one call, so
the layer's variables and optimizer slots are put back to their values from before the update
right after it (identically on every rank). The wrapped optimizer's ``iterations`` counter is
global and still advances.
"""

from __future__ import annotations

import tensorflow as tf

from hvdsync.keras.comm import Reducer, control_allreduce, global_norm, payload_bytes
from hvdsync.keras.techniques import EagerTechnique, Slots, StepLayout, saved_path, to_numpy
from hvdsync.select import LayerSelector, SelectConfig
from hvdsync.stats import SyncStats


class EagerSelect(EagerTechnique):
    needs_values = True

    def __init__(self, config: SelectConfig, num_layers: int, reducer: Reducer, slots: Slots,
                 stats: SyncStats):
        self.selector = LayerSelector(config, num_layers)
        self.reducer = reducer
        self.slots = slots
        self.stats = stats
        self.residual: dict[str, tf.Tensor] = {}
        self._restore: list[tuple[int, tf.Tensor, list[tf.Tensor]]] = []
        #: the last step's per-layer local scores, rank-averaged scores, residual norms and
        #: (hypernet) alpha -- for logging and plots
        self.last: dict[str, list[float]] = {}

    def before_apply(self, layout: StepLayout, grads: list, values: list) -> list:
        n = len(layout.names)
        mask = list(self.selector.selected)
        dots = [0.0] * n
        dot_tensors: list[tf.Tensor] = []
        out = list(grads)
        pushing: list[tuple[str, list]] = []
        pushed_positions: list[list[int]] = []
        for li, positions in layout.layers:
            name = layout.names[li]
            if self.selector.hypernet is not None:
                # dL/dalpha_l at alpha = 1 for the loss with the layer's weights scaled by alpha
                dot_tensors.append(tf.add_n([tf.reduce_sum(tf.cast(grads[p], tf.float32)
                                                           * tf.cast(values[p], tf.float32))
                                             for p in positions]))
            for p in positions:
                self.stats.dense(payload_bytes(grads[p]))
            if mask[li]:
                layer = []
                for p in positions:
                    r = self.residual.pop(layout.key(p), None)
                    layer.append(grads[p] if r is None else grads[p] + r)
                pushing.append((name, layer))
                pushed_positions.append(positions)
            else:
                for p in positions:
                    key = layout.key(p)
                    r = self.residual.get(key)
                    self.residual[key] = grads[p] if r is None else r + grads[p]
                    out[p] = tf.zeros_like(grads[p])
                    self._restore.append((p, tf.identity(values[p]), self.slots.snapshot(key)))
                self.stats.skipped(name)
        self.reducer.record_sent(pushing, self.stats)
        for positions, reduced in zip(pushed_positions,
                                      self.reducer.reduce_layers(pushing, "select")):
            for p, r in zip(positions, reduced):
                out[p] = r
        # Agree on the next step's layers (one control-plane allreduce).
        norm_tensors = []
        for li, positions in layout.layers:
            rs = [self.residual[layout.key(p)] for p in positions if layout.key(p) in self.residual]
            norm_tensors.append(global_norm(rs))
        host = tf.stack(dot_tensors + norm_tensors).numpy().tolist()  # one device read
        norms = [0.0] * n
        for k, (li, _) in enumerate(layout.layers):
            if dot_tensors:
                dots[li] = host[k]
            norms[li] = host[len(dot_tensors) + k]
        local = self.selector.local_scores(dots, norms)
        shared = control_allreduce(local, "hvdsync.select.scores", self.reducer.process_set,
                                   self.stats)
        self.selector.pushed(mask)
        self.selector.choose(shared)
        self.stats.count("residual_norm", sum(x * x for x in norms) ** 0.5)
        self.last = {"local_scores": local, "scores": shared, "residual_norms": norms}
        if self.selector.hypernet is not None:
            self.last["alpha"] = self.selector.prev_alpha.tolist()
        return out

    def after_apply(self, layout: StepLayout) -> None:
        """Undo this step's update of the layers that were not pushed."""
        for p, value, slots in self._restore:
            layout.variables[p].assign(value)
            self.slots.restore(layout.key(p), slots)
        self._restore = []

    def forget(self) -> None:
        self.residual.clear()
        self._restore = []

    def state_dict(self, ids: dict[str, str]) -> dict:
        return {"selector": self.selector.state_dict(),
                "residual": {ids[k]: to_numpy(v) for k, v in self.residual.items()}}

    def load_state_dict(self, state: dict, paths: dict[str, str]) -> None:
        self.selector.load_state_dict(state["selector"])
        self.forget()
        for k, v in state["residual"].items():
            self.residual[saved_path(k, paths, "select residual")] = tf.constant(v)
