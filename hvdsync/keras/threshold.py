"""Accumulation thresholds for Keras (technique 5; the rule lives in
:mod:`hvdsync.threshold`): local accumulations, the shared send/skip decision, and the
reconciliation of local-only updates at a layer's next sync (its variables and optimizer
slots return to the last sync point, then take one step with the integrated accumulation).

Keras differs from torch in one respect: the wrapped optimizer's ``iterations`` counter (Adam's
bias correction) is global, not per variable, so the reconciling step uses the current
iteration count.
"""

from __future__ import annotations

import tensorflow as tf

from hvdsync.keras.comm import Reducer, control_allreduce, global_norm, payload_bytes
from hvdsync.keras.techniques import EagerTechnique, Slots, StepLayout, saved_path, to_numpy
from hvdsync.stats import SyncStats
from hvdsync.threshold import ThresholdConfig, ThresholdPolicy


class EagerThreshold(EagerTechnique):
    """``acc[path]``: gradients summed since the layer last synced (only while it skips);
    ``anchor[path]``: the variable and its slots at that sync."""

    needs_values = True

    def __init__(self, config: ThresholdConfig, num_layers: int, reducer: Reducer,
                 slots: Slots, stats: SyncStats):
        self.policy = ThresholdPolicy(config, num_layers)
        self.reducer = reducer
        self.slots = slots
        self.stats = stats
        self.acc: dict[str, tf.Tensor] = {}
        self.anchor: dict[str, tuple[tf.Tensor, list[tf.Tensor]]] = {}

    def before_apply(self, layout: StepLayout, grads: list, values: list) -> list:
        relative = self.policy.config.relative
        n = len(layout.names)
        acc_norms, param_norms = [0.0] * n, [0.0] * n
        norms = []
        for li, positions in layout.layers:
            current = []
            for pos in positions:
                key = layout.key(pos)
                if key in self.acc:
                    self.acc[key] = self.acc[key] + grads[pos]
                current.append(self.acc.get(key, grads[pos]))
                self.stats.dense(payload_bytes(grads[pos]))
            norms.append(global_norm(current))
            if relative:  # parameters as of the last sync: identical on every rank
                norms.append(global_norm(
                    [self.anchor[layout.key(p)][0] if layout.key(p) in self.anchor else values[p]
                     for p in positions]))
        values_ = tf.stack(norms).numpy().tolist() if norms else []  # one device read
        per = 2 if relative else 1
        for k, (li, _) in enumerate(layout.layers):
            acc_norms[li] = values_[per * k]
            if relative:
                param_norms[li] = values_[per * k + 1]
        shared = control_allreduce(acc_norms + (param_norms if relative else []),
                                   "hvdsync.control.threshold", self.reducer.process_set,
                                   self.stats)
        send = self.policy.decide(shared[:n], shared[n:] if relative else None)
        out = list(grads)
        sending: list[tuple[str, list]] = []
        sent_positions: list[list[int]] = []
        for li, positions in layout.layers:
            name = layout.names[li]
            if send[li]:
                for pos in positions:
                    key = layout.key(pos)
                    acc = self.acc.pop(key, None)
                    if acc is not None:
                        out[pos] = acc
                    anchor = self.anchor.pop(key, None)
                    if anchor is not None:  # back to the sync point, then one step
                        layout.variables[pos].assign(anchor[0])
                        self.slots.restore(key, anchor[1])
                sending.append((name, [out[p] for p in positions]))
                sent_positions.append(positions)
            else:
                for pos in positions:
                    key = layout.key(pos)
                    if key not in self.acc:
                        self.acc[key] = grads[pos]
                    if key not in self.anchor:
                        self.anchor[key] = (tf.identity(values[pos]), self.slots.snapshot(key))
                self.stats.skipped(name)
        self.reducer.record_sent(sending, self.stats)
        for positions, reduced in zip(sent_positions,
                                      self.reducer.reduce_layers(sending, "threshold")):
            for pos, r in zip(positions, reduced):
                out[pos] = r
        return out

    def forget(self) -> None:
        self.acc.clear()
        self.anchor.clear()

    def state_dict(self, ids: dict[str, str]) -> dict:
        return {"policy": self.policy.state_dict(),
                "acc": {ids[k]: to_numpy(v) for k, v in self.acc.items()},
                "anchor": {ids[k]: [to_numpy(v), [to_numpy(s) for s in slots]]
                           for k, (v, slots) in self.anchor.items()}}

    def load_state_dict(self, state: dict, paths: dict[str, str]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.forget()
        for k, v in state["acc"].items():
            self.acc[saved_path(k, paths, "threshold state")] = tf.constant(v)
        for k, (v, slots) in state["anchor"].items():
            self.anchor[saved_path(k, paths, "threshold state")] = (
                tf.constant(v), [tf.constant(s) for s in slots])
