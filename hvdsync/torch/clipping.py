"""The arithmetic of ``clip=`` on torch gradients, one layer at a time (the rules and their
running statistics are :class:`hvdsync.clipping.LayerClip`'s).

Clipping runs inside backward hooks, so it must not stall the host on a GPU: every decision
is a tensor op on the gradient's device; the norms go to the host once per step.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from hvdsync.clipping import ClipConfig
from hvdsync.torch.backend import norm_of


def clip_layer(grads: list[torch.Tensor], params: list[torch.Tensor], c: ClipConfig,
               limit: float) -> tuple[list[torch.Tensor], Optional[torch.Tensor],
                                      Optional[torch.Tensor]]:
    """Clip one layer's gradients in place (a sparse gradient is coalesced first, so each row
    counts once in the norm). Returns the gradients, the pre-clip norm and whether the layer
    was clipped (device values; ``None`` for an empty layer)."""
    grads = [g.coalesce() if g.is_sparse and not g.is_coalesced() else g for g in grads]
    views = [g._values() if g.is_sparse else g for g in grads]
    if not views or all(v.numel() == 0 for v in views):
        return grads, None, None
    raw_norm = norm_of(views)
    norm = raw_norm
    if c.value is not None:
        for v in views:
            v.clamp_(*c.value)
        norm = norm_of(views)
    bound: torch.Tensor | float = limit
    if c.ratio is not None:
        bound = (c.ratio * norm_of(params).clamp(min=c.eps)).clamp(max=limit)
    finite = torch.isfinite(raw_norm)
    if math.isfinite(limit) or c.ratio is not None:
        # Scale only down (a zero norm gives inf, clamped to 1); leave non-finite alone.
        # (1 / norm) * bound in float32, as the Keras adapter computes it: the same scale
        scale = torch.where(finite, (norm.reciprocal() * bound).clamp(max=1.0), 1.0)
        torch._foreach_mul_(views, scale)
    else:
        scale = torch.ones((), device=norm.device)
    clipped = (scale < 1.0) | (norm != raw_norm)
    return grads, raw_norm, clipped & finite
