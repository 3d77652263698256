"""Applying :mod:`hvdsync.clipping` decisions to torch gradients, one layer at a time.

Clipping runs inside backward hooks, so it must not stall the host on a GPU: every decision
is made with tensor ops on the gradient's device. The few numbers the host needs (each
layer's norm for the running statistics, what was clipped) are read once per step, in
:meth:`LayerClipper.end_step`, after the step's communication has been waited for anyway.
"""

from __future__ import annotations

import math
import warnings

import torch

from hvdsync.clipping import ClipConfig, ClipPolicy
from hvdsync.stats import SyncStats
from hvdsync.torch.util import norm_of


def _dense_view(p: torch.Tensor) -> torch.Tensor:
    """The gradient values to clip in place (a sparse gradient is coalesced first, so each
    row counts once in the norm)."""
    if p.grad.is_sparse:
        if not p.grad.is_coalesced():
            p.grad = p.grad.coalesce()
        return p.grad._values()
    return p.grad


class LayerClipper:
    """Clips one layer's gradients in place by the configured rules and counts what it did
    (``clipped``: layers whose gradient changed; ``nonfinite``: layers with NaN/Inf)."""

    def __init__(self, config: ClipConfig, num_layers: int, layer_names: list[str],
                 stats: SyncStats):
        self.config = config
        self.policy = ClipPolicy(config, num_layers)
        self.layer_names = layer_names
        self.stats = stats
        # (layer, pre-clip norm, clipped?) per clipped layer this step, still on the device.
        self._step: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._warned_nonfinite = False

    def clip(self, layer: int, params: list[torch.Tensor]) -> None:
        c = self.config
        grads = [_dense_view(p) for p in params]
        if not grads or all(g.numel() == 0 for g in grads):
            return
        raw_norm = norm_of(grads)
        norm = raw_norm
        if c.value is not None:
            for g in grads:
                g.clamp_(*c.value)
            norm = norm_of(grads)
        fixed = self.policy.norm_limit(layer)  # max_norm and adaptive rules (host floats)
        limit: torch.Tensor | float = fixed
        if c.ratio is not None:
            param_norm = norm_of([p.detach() for p in params])
            limit = (c.ratio * param_norm.clamp(min=c.eps)).clamp(max=fixed)
        finite = torch.isfinite(raw_norm)
        if math.isfinite(fixed) or c.ratio is not None:
            # Scale only down (a zero norm gives inf, clamped to 1); leave non-finite alone.
            scale = torch.where(finite, (limit / norm).clamp(max=1.0), 1.0)
            torch._foreach_mul_(grads, scale)
        else:
            scale = torch.ones((), device=norm.device)
        clipped = (scale < 1.0) | (norm != raw_norm)
        if c.nonfinite == "zero":
            if grads[0].is_cuda:  # no host sync: a masked fill on the device
                for g in grads:
                    g.masked_fill_(~finite, 0.0)
            elif not bool(finite):
                for g in grads:
                    g.zero_()
        self._step.append((layer, raw_norm, clipped & finite))

    def end_step(self) -> None:
        """Read this step's norms once: update running statistics and the stats counters."""
        if not self._step:
            return
        layers = [layer for layer, _, _ in self._step]
        norms = torch.stack([n for _, n, _ in self._step]).tolist()
        clipped = torch.stack([c for _, _, c in self._step]).tolist()
        self._step.clear()
        for layer, norm, was_clipped in zip(layers, norms, clipped):
            self.policy.observe(layer, norm)
            if was_clipped:
                self.stats.count("clipped")
            if not math.isfinite(norm):
                self.stats.count("nonfinite")
                if not self._warned_nonfinite:
                    self._warned_nonfinite = True
                    what = "sent as zeros" if self.config.nonfinite == "zero" else "sent unchanged"
                    warnings.warn(f"hvdsync: non-finite gradient in layer "
                                  f"{self.layer_names[layer]!r} ({what}, clip "
                                  f"nonfinite={self.config.nonfinite!r}); counted in stats as "
                                  "'nonfinite', further warnings suppressed", RuntimeWarning,
                                  stacklevel=2)
