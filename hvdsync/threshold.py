"""``threshold=``: accumulation thresholds -- communicate a layer only when what it has
accumulated is large enough (a decider).

Each rank adds every step's gradient of a layer to a local accumulation. Once per step all
ranks share, in **one** small control-plane allreduce, every layer's accumulation norm
(averaged over ranks), and with ``relative=True`` its parameter norm; from those identical numbers every rank takes the
same decision per layer:

* **send** when the averaged accumulation norm reaches the threshold (``threshold``, or
  ``threshold * ||theta_l||`` with ``relative=True``), or when the layer has been skipped
  ``max_skip`` steps in a row, or on every ``sync_every``-th step (all layers). The layer's
  accumulation is allreduced (averaged) and the model is updated with it;
* **skip** otherwise: nothing is sent and the layer is updated with this rank's own gradient.

``scope="global"`` takes one decision for the whole model from the norm of all layers'
accumulations together.

Reconciling local updates (why replicas agree after a sync): a layer's parameters and its
optimizer state (momentum buffer, Adam moments, step count) are remembered at its last sync,
when they were identical on every rank. Local-only updates are provisional: on the layer's
next sync the parameters and optimizer state go back to that point and take **one**
optimizer step with the rank-averaged *sum* of all gradients accumulated since -- the
integrated accumulation. That step is the same computation on every rank, so afterwards the
layer is identical everywhere. For plain SGD it equals applying every rank's every gradient
(``theta - lr * sum_t mean_r g``), as synchronous SGD does; for momentum SGD and Adam the k
accumulated steps count as one optimizer step with their summed gradient. A threshold of 0
sends every layer every step: exactly Horovod's behaviour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from hvdsync.config import coerce_config
from hvdsync.technique import Communicator, Decider, Gradients, TensorOps

SCOPES = ("layer", "global")


def _optional_positive_int(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"threshold {name} must be None or an int >= 1, got {value!r}")


@dataclass(frozen=True)
class ThresholdConfig:
    """When to communicate an accumulated layer; see the module docstring."""

    threshold: float
    relative: bool = False
    scope: str = "layer"
    max_skip: Optional[int] = None
    sync_every: Optional[int] = None

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"threshold must be a number, got {type(t).__name__} {t!r}")
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"threshold must be a finite number >= 0, got {t}")
        object.__setattr__(self, "threshold", float(t))
        if not isinstance(self.relative, bool):
            raise TypeError(f"threshold relative must be True or False, got {self.relative!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"threshold scope must be one of {SCOPES}, got {self.scope!r}")
        _optional_positive_int("max_skip", self.max_skip)
        _optional_positive_int("sync_every", self.sync_every)

    @classmethod
    def coerce(cls, value: Any) -> Optional["ThresholdConfig"]:
        """``None``, a :class:`ThresholdConfig`, a dict of its fields, or a number."""
        return coerce_config(cls, value, "threshold", "threshold")


class ThresholdPolicy:
    """The per-step send/skip decision (identical on every rank given identical inputs) and
    its state: consecutive skips per layer and the step counter."""

    def __init__(self, config: ThresholdConfig, num_layers: int):
        self.config = config
        self.skipped_for = [0] * num_layers
        self.step = 0

    def decide(self, acc_norms: list[float],
               param_norms: Optional[list[float]] = None) -> list[bool]:
        """Which layers to send this step, from rank-averaged norms (shared values only);
        ``param_norms`` is needed only with ``relative=True``."""
        c = self.config
        if c.relative and param_norms is None:
            raise ValueError("a relative threshold needs the layers' parameter norms")
        if param_norms is None:
            param_norms = [1.0] * len(acc_norms)
        self.step += 1
        n = len(acc_norms)
        if c.sync_every is not None and self.step % c.sync_every == 0:
            send = [True] * n
        elif c.scope == "global":
            total = math.sqrt(sum(x * x for x in acc_norms))
            limit = c.threshold * (math.sqrt(sum(x * x for x in param_norms))
                                   if c.relative else 1.0)
            forced = c.max_skip is not None and max(self.skipped_for, default=0) >= c.max_skip
            send = [total >= limit or forced] * n
        else:
            send = []
            for norm, pnorm, skipped in zip(acc_norms, param_norms, self.skipped_for):
                limit = c.threshold * (pnorm if c.relative else 1.0)
                send.append(norm >= limit or (c.max_skip is not None and skipped >= c.max_skip))
        self.skipped_for = [0 if s else k + 1 for s, k in zip(send, self.skipped_for)]
        return send

    def state_dict(self) -> dict:
        return {"skipped_for": list(self.skipped_for), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        if len(state["skipped_for"]) != len(self.skipped_for):
            raise ValueError(f"threshold state is for {len(state['skipped_for'])} layers, "
                             f"this optimizer has {len(self.skipped_for)}")
        self.skipped_for = list(state["skipped_for"])
        self.step = int(state["step"])


class AccumulationThreshold(Decider):
    """Per-layer local accumulation, the shared send/skip decision, and reconciliation.

    ``acc[key]`` holds the gradients of a parameter summed since its layer last synced
    (present only while the layer skips: a layer sent every step costs no copy).
    ``anchor[key]`` holds the parameter and its optimizer state as they were at that sync
    (taken when the first local-only update is about to happen), restored right before the
    layer's next sync. Keys are :meth:`Gradients.key` (a parameter's position).
    """

    name = "threshold"
    reads_values = True  # sync points snapshot the parameters
    per_rank = ("acc", "anchor", "local")

    def __init__(self, config: ThresholdConfig, grads: Gradients, ops: TensorOps,
                 comm: Communicator, num_layers: int):
        self.policy = ThresholdPolicy(config, num_layers)
        self.grads = grads
        self.ops = ops
        self.comm = comm
        self.num_layers = num_layers
        self.acc: dict[str, Any] = {}
        self.anchor: dict[str, Any] = {}
        self._candidate: dict[str, Any] = {}
        self._ok = True

    def decision(self, li: int) -> Optional[bool]:
        return None  # needs every layer's accumulation: decided after backward

    def decide(self, parts: dict[int, list[int]], local_bad: list) -> dict[int, bool]:
        """Agree on what to send from every layer's accumulation norm including this step's
        gradient (one control-plane allreduce, which also carries whether any rank's
        gradient is non-finite: then nothing is sent and nothing is accumulated)."""
        relative = self.policy.config.relative
        g, ops = self.grads, self.ops
        acc_norms, param_norms = [], []
        self._candidate = {}  # the accumulation with this step's gradient, not yet committed
        for li in range(self.num_layers):
            current, values = [], []
            for k in parts.get(li, []):
                if g.is_row_sparse(li, k):
                    raise ValueError("threshold= needs dense gradients: pass sparse=True (row-"
                                     "sparse layers then take the sparse exchange every step) "
                                     "or sparse_as_dense=True")
                key, grad = g.key(li, k), g.get(li, k)
                cand = ops.add(self.acc[key], grad) if key in self.acc else grad
                self._candidate[key] = cand
                current.append(cand)
                if relative:  # parameters as of the last sync: identical on every rank
                    values.append(self.anchor[key]["value"] if key in self.anchor
                                  else g.value(li, k))
            acc_norms.append(ops.norm(current))
            if relative:
                param_norms.append(ops.norm(values))
        host = ops.to_host(acc_norms + param_norms + list(local_bad))  # one device read
        n, m = self.num_layers, len(acc_norms) + len(param_norms)
        shared = self.comm.control(host[:m] + [float(any(host[m:]))],
                                   "hvdsync.control.threshold")
        self._ok = shared[-1] == 0 and all(math.isfinite(x) for x in shared[:m])
        if not self._ok:  # skipped everywhere: the policy does not count this step either
            return {li: False for li in parts}
        send = self.policy.decide(shared[:n], shared[n:m] if relative else None)
        return {li: send[li] for li in parts}

    def on_send(self, li: int, ks: list[int]) -> None:
        """The layer syncs now: its gradient becomes the accumulation, and its parameters and
        optimizer state return to the last sync point if they moved locally since."""
        for k in ks:
            key = self.grads.key(li, k)
            self.acc.pop(key, None)
            self.grads.set(li, k, self._candidate.pop(key))
            anchor = self.anchor.pop(key, None)
            if anchor is not None:
                self.grads.restore(key, anchor)

    def on_skip(self, li: int, ks: list[int]) -> None:
        """The layer stays local this step: keep its gradient, remember the sync point."""
        if not self._ok:
            return  # a non-finite step: nothing of it is kept
        for k in ks:
            key = self.grads.key(li, k)
            cand = self._candidate.pop(key)
            self.acc[key] = cand if key in self.acc else self.ops.clone(cand)
            if key not in self.anchor:
                self.anchor[key] = self.grads.snapshot(key)

    def settle(self, data_ok: bool, local_bad: list) -> bool:
        return self._ok and data_ok

    def state_dict(self) -> dict:
        """Shared: the skip counters and step. Per rank: the unsent accumulations, the sync
        points (parameters and optimizer state) of layers that are skipping, and where this
        rank's local steps have taken those parameters (``local``: replicas differ there, so
        a model saved by one rank does not hold the others')."""
        g = self.grads
        return {"policy": self.policy.state_dict(),
                "acc": {k: g.to_saved(k, v) for k, v in self.acc.items()},
                "anchor": {k: g.to_saved(k, v) for k, v in self.anchor.items()},
                "local": {k: g.to_saved(k, g.snapshot(k)) for k in self.anchor}}

    def load_state_dict(self, state: dict) -> None:
        """Without the per-rank part (another rank's checkpoint), the layers continue from the
        parameters loaded with the model and forget what they had not sent."""
        g = self.grads
        self.policy.load_state_dict(state["policy"])
        self.acc = {k: g.from_saved(k, v) for k, v in state.get("acc", {}).items()}
        self.anchor = {k: g.from_saved(k, v) for k, v in state.get("anchor", {}).items()}
        for k, snap in state.get("local", {}).items():
            g.restore(k, g.from_saved(k, snap))

    def forget(self) -> None:
        """Drop unsent accumulations and sync points (after restoring a checkpoint that has
        none they would roll layers back to values from before it)."""
        self.acc.clear()
        self.anchor.clear()

    def status(self) -> dict:
        return {"step": self.policy.step, "skipped_for": list(self.policy.skipped_for)}
