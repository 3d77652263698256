"""The arithmetic of ``clip=`` on torch gradients, a group of layers at a time (the rules
and their running statistics are :class:`hvdsync.techniques.clip.technique.LayerClip`'s).

Clipping runs inside backward hooks, so it must not stall the host on a GPU: every decision
is a tensor op on the gradients' device; the norms go to the host once per step. And it must
not cost a kernel per tensor: a group's per-layer norms come from one multi-tensor norm, its
scales from a few ops on a vector of them, and one multi-tensor multiply applies them --
about a dozen ops for the whole group, whatever its number of layers (torch's own
``clip_grad_norm_(foreach=True)`` costs 8 for one global norm).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional, Union

import torch

from hvdsync.techniques.clip.config import ClipConfig
from hvdsync.torch.foreach import layer_norms, value_views, views_norms

_ONE: dict[torch.device, torch.Tensor] = {}
_INDEX: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    one = _ONE.get(device)
    if one is None:
        one = _ONE[device] = torch.ones((), device=device)
    return one


def _per_tensor(scale: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """A layer's scale for each of its tensors (``counts``: tensors per layer), as 0-d
    tensors for one multi-tensor multiply."""
    if all(c == 1 for c in counts):
        return list(scale.unbind())
    key = (tuple(counts), scale.device)
    index = _INDEX.get(key)
    if index is None:
        if len(_INDEX) > 256:
            _INDEX.clear()
        index = _INDEX[key] = torch.tensor([li for li, c in enumerate(counts) for _ in range(c)],
                                           device=scale.device)
    return list(scale[index].unbind())


def clip_layers(layers: list[list[torch.Tensor]], params: list[list[torch.Tensor]],
                c: ClipConfig, limits: Union[float, Sequence[float]]
                ) -> tuple[list[list[torch.Tensor]], Optional[torch.Tensor]]:
    """Clip a group of layers' gradients in place (a sparse gradient is coalesced first, so
    each row counts once in the norm). ``limits``: each layer's norm limit from ``max_norm``
    and the adaptive rules (one float for all, or one per layer; ``inf``: none); ``params``:
    the layers' parameters, read by the ``ratio`` rule only. Returns the gradients and the
    group's record (:data:`hvdsync.techniques.clip.technique.ClipLayers`): a float32 device matrix, row 0 each
    layer's pre-clip norm, row 1 a factor below 1 exactly where the layer was clipped
    (``None`` when the group holds no values)."""
    layers = [[g.coalesce() if g.is_sparse and not g.is_coalesced() else g for g in layer]
              for layer in layers]
    views, counts = value_views(layers)
    if not views:
        return layers, None
    raw = norm = views_norms(views, counts)
    if c.value is not None:
        torch._foreach_clamp_min_(views, c.value[0])
        torch._foreach_clamp_max_(views, c.value[1])
        norm = views_norms(views, counts)
    same = isinstance(limits, (int, float))
    if c.ratio is None and (math.isinf(limits) if same else all(map(math.isinf, limits))):
        scale = torch.ones_like(raw)  # no norm limit this step (an adaptive one warming up)
    else:
        bound: Union[torch.Tensor, float] = limits if same else torch.tensor(
            limits, dtype=torch.float32, device=raw.device)
        if c.ratio is not None:
            sizes = (c.ratio * layer_norms(params).clamp(min=c.eps)).to(raw.device)
            bound = sizes.clamp(max=limits) if same else torch.minimum(sizes, bound)
        # Scale only down: (1 / norm) * bound in float32, as the Keras adapter computes it (a
        # zero norm gives inf, clamped to 1). A layer whose gradient is non-finite is left
        # as it is: its norm counts as 0 here, so its scale is 1.
        safe = norm if c.value is None else norm + raw * 0  # (raw*0: NaN where raw is)
        scale = (torch.nan_to_num(safe, nan=0.0, posinf=0.0).reciprocal() * bound
                 ).clamp(max=1.0)
        torch._foreach_mul_(views, _per_tensor(scale, counts))
    if c.value is not None:  # clamping changed the layer: clipped too
        scale = scale.masked_fill((norm != raw) & torch.isfinite(raw), 0.0)
    return layers, torch.stack([raw, scale])
