"""``clip=``: per-layer gradient clipping, pipelined with the layer sends (a transform).

A layer is clipped as soon as backward has produced all its gradients and is then sent at
once, so clipping never waits for the whole backward pass or for communication (Horovod's
recipe, ``synchronize(); clip_grad_norm_(); step()``, waits for both). Rules, any combination
(a layer's limit is the smallest active one): ``value`` (clamp elements, first), ``max_norm``,
``ema`` and ``variance`` (running statistics of the layer's norm, after ``warmup``) and
``ratio`` (relative to the parameter norm, as AGC). ``mode="local"`` clips each rank's own
gradient before it is sent (values change, never which collectives run); ``"global"`` clips
the averaged gradient as each layer arrives (the same on every rank). A non-finite layer is
left as it is and the step is skipped everywhere (docs/failures.md). docs/clip.md has each
rule and what it costs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hvdsync.core.ports import Gradients, TensorOps
from hvdsync.core.stats import SyncStats
from hvdsync.core.technique import Transform
from hvdsync.techniques.clip.config import ClipConfig
from hvdsync.techniques.clip.traced import TracedClip

FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


class ClipPolicy:
    """The per-layer clip decision and its running statistics (saveable state).

    Running statistics are exponentially weighted sums of the norm and its square, one pair
    per (layer, beta) for the betas the config uses, bias-corrected like Adam's moments.
    """

    def __init__(self, config: ClipConfig, num_layers: int):
        self.config = config
        self._betas = sorted({spec[0] for spec in (config.ema, config.variance) if spec})
        self.count = [0] * num_layers  # finite norms observed per layer
        self._sums: dict[tuple[int, float], tuple[float, float]] = {}

    def norm_limit(self, layer: int) -> float:
        """The norm this layer's gradient may have now from ``max_norm`` and the adaptive
        rules (``inf``: none applies). The ``ratio`` rule needs the parameter norm, which
        adapters keep on the device: they apply ``ratio * max(param_norm, eps)`` themselves."""
        c = self.config
        limit = math.inf
        if c.max_norm is not None:
            limit = c.max_norm
        if self.count[layer] >= max(c.warmup, 1):
            if c.ema is not None:
                beta, factor = c.ema
                limit = min(limit, factor * self._moments(layer, beta)[0])
            if c.variance is not None:
                beta, k = c.variance
                mean, mean_sq = self._moments(layer, beta)
                limit = min(limit, mean + k * math.sqrt(max(mean_sq - mean * mean, 0.0)))
        # an adaptive limit of 0 (every norm seen was 0) would make a zero gradient's scale
        # 0 / 0: the smallest float32 instead (the adapters' scale is float32)
        return max(limit, FLOAT32_TINY)

    def observe(self, layer: int, grad_norm: float) -> None:
        """Fold this step's (pre-clip) norm into the running statistics; non-finite ignored."""
        if not math.isfinite(grad_norm):
            return
        for beta in self._betas:
            m, s = self._sums.get((layer, beta), (0.0, 0.0))
            self._sums[(layer, beta)] = (beta * m + (1 - beta) * grad_norm,
                                         beta * s + (1 - beta) * grad_norm * grad_norm)
        self.count[layer] += 1

    def _moments(self, layer: int, beta: float) -> tuple[float, float]:
        """Bias-corrected running mean of the norm and of its square."""
        m, s = self._sums.get((layer, beta), (0.0, 0.0))
        debias = 1.0 - beta ** self.count[layer]
        return m / debias, s / debias

    def state_dict(self) -> dict:
        return {"count": list(self.count),
                "sums": [[layer, beta, m, s] for (layer, beta), (m, s) in self._sums.items()]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["count"]) != len(self.count):
            raise ValueError(f"clip state is for {len(state['count'])} layers, "
                             f"this optimizer has {len(self.count)}")
        self.count = list(state["count"])
        self._sums = {(int(layer), float(beta)): (m, s) for layer, beta, m, s in state["sums"]}


class Clip(Transform):
    """Clips each layer's gradient by the configured rules -- before its send (``"local"``) or
    once its average has arrived (``"global"``) -- and counts what it did (``clipped``: layers
    whose gradient changed; ``nonfinite``: layers with NaN/Inf). A ready group of layers is
    clipped at once (the adapter's ``ops.clip_layers``, :class:`hvdsync.techniques.clip.ports.
    ClipKernel`); the norms go to the host once per step,
    in :meth:`end_step`."""

    name = "clip"
    traceable = True

    def __init__(self, config: ClipConfig, grads: Gradients, ops: TensorOps,
                 layer_names: list[str], stats: SyncStats):
        self.config = config
        self.reads_values = config.ratio is not None
        # local mode: each rank's limits come from its own gradients' history
        self.per_rank = ("policy",) if config.mode == "local" else ()
        self.policy = ClipPolicy(config, len(layer_names))
        self.grads = grads
        self.ops = ops
        self.layer_names = layer_names
        self.stats = stats
        self._step: list[tuple[list[int], Any]] = []  # (layers, their record)
        #: its traced form (Keras' compiled step builds it per layer)
        self.traced = TracedClip(self)

    def group_ready(self, layers: list[tuple[int, list[int]]]) -> None:
        if self.config.mode == "local":
            self._clip([li for li, _ in layers])

    def after_wait(self, layers: list[int]) -> None:
        if self.config.mode == "global":
            self._clip(layers)

    def _clip(self, layers: list[int]) -> None:
        g = self.grads
        # an empty layer (no values: a sparse gradient without rows) is neither clipped nor
        # observed
        layers = [li for li in layers if g.payload_bytes(li)]
        if not layers:
            return
        grads = g.layers(layers)
        params = ([[g.value(li, k) for k in range(len(layer))]
                   for li, layer in zip(layers, grads)] if self.config.ratio is not None else [])
        limits = [self.norm_limit(li) for li in layers]
        new, record = self.ops.clip_layers(
            grads, params, self.config, limits[0] if len(set(limits)) == 1 else limits)
        if record is None:
            return
        changed = [(li, [k], [x]) for li, layer, before in zip(layers, new, grads)
                   for k, (x, y) in enumerate(zip(layer, before))
                   if x is not y]  # (clipped in place; a sparse gradient coalesced)
        if changed:
            g.write(changed)
        self._step.append((layers, record))

    def end_step(self, ok: bool) -> None:
        if not self._step:
            return
        host = self.ops.read([record for _, record in self._step])  # one read
        records = [(li, norm, factor < 1.0)
                   for (layers, _), values in zip(self._step, host)
                   for li, norm, factor in zip(layers, values, values[len(layers):])]
        self._step.clear()
        self.record_step(records, ok)

    def norm_limit(self, li: int) -> float:
        """Layer ``li``'s limit for this step (``max_norm`` and the adaptive limits)."""
        return self.policy.norm_limit(li)

    def record_step(self, records: Sequence[tuple[int, float, bool]], ok: bool) -> None:
        """Fold a step's ``(layer, pre-clip norm, clipped?)`` into the running statistics and
        the stats counters (a tracing adapter reads them on the host and calls this too);
        ``ok``: the step was finite everywhere (a skipped step teaches the running statistics
        nothing: only its non-finite layers are counted)."""
        if not ok:
            self.stats.count("nonfinite", sum(not math.isfinite(n) for _, n, _ in records))
            return
        for li, norm, was_clipped in records:
            self.policy.observe(li, norm)
            if was_clipped:
                self.stats.count("clipped")
            if not math.isfinite(norm):
                self.stats.count("nonfinite")  # the step is skipped (the pipeline's policy)

    def state_dict(self) -> dict:
        return {"policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "policy" in state:
            self.policy.load_state_dict(state["policy"])
        else:
            self.drop_per_rank()

    def forget(self) -> None:
        self._step.clear()

    def drop_per_rank(self) -> None:
        """Local mode: the statistics start again from this rank's next gradients."""
        if self.per_rank:
            self.policy = ClipPolicy(self.config, len(self.layer_names))
