"""Technique 5: accumulation thresholds -- communicate a layer only when what it has
accumulated is large enough.

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
