"""Arithmetic over many tensors at once, for the torch adapter: each layer's norm or dot
product for a whole ready group, the step's finiteness check, clipping a group of layers
(``clip=``'s kernel, :func:`clip_layers`), the outer exchange's flat int8 coding -- a few
multi-tensor ops for all the tensors instead of a few ops per tensor (on a GPU every op is a
kernel launch: docs/design.md, "Ready groups"; the cost: docs/benchmarks.md, "Fixed cost per
step") -- and :class:`MultiTensorOps`, the part of :class:`hvdsync.torch.ops.TorchOps` that
runs them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from hvdsync.techniques.clip.config import ClipConfig


def norm_of(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``tensors`` together, as a float32 0-d tensor on their device:
    :func:`layer_norms` of one layer (the same sum of squares as a ready group's, and as the
    Keras adapter computes it, so both give the same float32: docs/design.md)."""
    return views_norms(*value_views([list(tensors)])).reshape(())


def wide_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The precision hvdsync's statistics are computed in: float64 if any of ``tensors`` is,
    else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# -- statistics of many layers at once: a few multi-tensor ops for a whole group of layers,
# not a few ops per tensor (on a GPU every op is a kernel launch; docs/benchmarks.md, "Fixed
# cost per step")
_LENGTHS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _per_layer(values: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Sums of consecutive runs of ``values`` (``counts[i]`` values for layer ``i``; 0 gives
    0): one op, or none when every layer has one value."""
    if all(c == 1 for c in counts):
        return values
    key = (tuple(counts), values.device)
    lengths = _LENGTHS.get(key)
    if lengths is None:  # made once per layout (a small cache: layouts repeat every step)
        if len(_LENGTHS) > 256:
            _LENGTHS.clear()
        lengths = _LENGTHS[key] = torch.tensor(counts, device=values.device)
    return torch.segment_reduce(values, "sum", lengths=lengths)


def _square_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's sum of squares, as one vector in the statistics' precision (float64 if
    any tensor is, else float32): one multi-tensor op and a stack."""
    dtypes = {t.dtype for t in tensors}
    wide = wide_dtype(tensors)
    if len(dtypes) == 1 and len({t.device for t in tensors}) == 1:
        if hasattr(torch, "_foreach_powsum"):  # (torch >= 2.13)
            sums = torch._foreach_powsum(tensors, 2, dtype=wide if wide not in dtypes else None)
            return torch.stack(sums)
        norms = torch.stack(torch._foreach_norm(tensors)).to(wide)
        return norms * norms
    device = tensors[0].device  # mixed dtypes or devices (rare): one at a time
    return torch.stack([torch.linalg.vector_norm(t.to(wide)).to(device) ** 2 for t in tensors])


def value_views(layers: Sequence[Sequence[torch.Tensor]]
                ) -> tuple[list[torch.Tensor], list[int]]:
    """The layers' tensors that hold values (a sparse one's values), in one list, and how many
    each layer has."""
    views, counts = [], []
    for tensors in layers:
        vs = [t._values() if t.is_sparse else t for t in tensors]
        vs = [v for v in vs if v.numel()]
        views += vs
        counts.append(len(vs))
    return views, counts


def views_norms(views: list[torch.Tensor], counts: Sequence[int]) -> torch.Tensor:
    """:func:`layer_norms` of :func:`value_views`' answer."""
    if not views:
        return torch.zeros(len(counts))
    return _per_layer(_square_sums(views), counts).sqrt().float()


def layer_norms(layers: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """Each layer's L2 norm (its tensors together; a sparse one's values) as a float32
    vector, one entry per layer (0 for a layer with no values): computed in the tensors'
    precision, rounded once at the end, as :func:`norm_of` and the Keras adapter compute a
    norm; a handful of ops for the whole group."""
    return views_norms(*value_views(layers))


def flatten_all(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``tensors`` flattened and concatenated into one vector of ``dtype`` (one op where
    they share it: ``_chunk_cat``, which needs no per-tensor view)."""
    if (hasattr(torch, "_chunk_cat") and len({t.dtype for t in tensors}) == 1
            and all(t.dim() for t in tensors) and len({t.device for t in tensors}) == 1):
        return torch._chunk_cat(tensors, 0, 1).view(-1).to(dtype)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


#: whether the torch adapter's statistics take their GPU form on a CPU too: multi-tensor
#: ops over model-sized temporaries, a few launches for a whole group. On a CPU an op costs a
#: few microseconds and a model-sized temporary more than that (no caching allocator), so
#: the default there is an op per tensor without temporaries; benchmarks/bench_fixed_cost.py
#: and tests/test_fixed_cost.py set it to count what a GPU step dispatches.
GPU_FORM_ON_CPU = False


def layer_dots(layers: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor:
    """Each layer's sum of dot products of its pairs as a float32 vector (one entry per
    layer, 0 for none), in the pairs' precision (at least float32) rounded once at the end.
    On a GPU (:data:`GPU_FORM_ON_CPU`): every product at once, flattened, then one sum per
    layer (multi-tensor ops have no signed sum, and a segmented sum is slow) -- an op per
    layer and five for the group; on a CPU a dot per tensor, reading both without a copy."""
    a = [x for pairs in layers for x, _ in pairs]
    b = [y for pairs in layers for _, y in pairs]
    if not a:
        return torch.zeros(len(layers))
    wide = wide_dtype(a + b)
    a = [t if t.dtype == wide else t.to(wide) for t in a]
    b = [t if t.dtype == wide else t.to(wide) for t in b]
    if len({t.device for t in a + b}) > 1 or not (a[0].is_cuda or GPU_FORM_ON_CPU):
        per_pair = torch.stack([torch.vdot(x.reshape(-1), y.reshape(-1).to(x.device))
                                for x, y in zip(a, b)])
        return _per_layer(per_pair, [len(pairs) for pairs in layers]).float()
    products = list(torch._foreach_mul(a, b))
    flat = flatten_all(products, wide)
    sizes = [sum(x.numel() for x, _ in pairs) for pairs in layers]
    sums = [piece.sum() for piece in flat.split(sizes)] if len(layers) > 1 else [flat.sum()]
    return torch.stack(sums).float()


def in_layer_order(n: int, parts: Sequence[tuple[Sequence[int], torch.Tensor]]
                   ) -> torch.Tensor:
    """One float32 vector of ``n`` entries from per-group vectors (``(layers, values)``:
    ``values[i]`` belongs to layer ``layers[i]``); layers in no part get 0."""
    parts = [(list(lis), v) for lis, v in parts if len(lis)]
    if len(parts) == 1 and parts[0][0] == list(range(n)):
        return parts[0][1]
    if not parts:
        return torch.zeros(n)
    values = torch.cat([v for _, v in parts]) if len(parts) > 1 else parts[0][1]
    index = torch.tensor([li for lis, _ in parts for li in lis], device=values.device)
    return torch.zeros(n, device=values.device).index_copy_(0, index, values)


_UNIT: dict[torch.device, torch.Tensor] = {}


def nonfinite_flag(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """A 1-element float32 tensor: 1.0 if any of ``tensors`` holds NaN or Inf, else 0.0 (on
    their device, without a host read; None for no values). Large finite values do not
    overflow as in a 2-norm."""
    views = [t._values() if t.is_sparse else t for t in tensors]
    views = [v for v in views if v.numel()]
    if not views:
        return None
    device = views[0].device
    if views[0].is_cuda:  # read only (GradScaler's check writes every value); NaN propagates
        top = torch.stack(torch._foreach_norm(views, float("inf"))).max()
        return (~torch.isfinite(top)).float().reshape(1)
    # CPU: GradScaler's fused check (it multiplies by 1: the values stay as they are); on the
    # LM's 54 tensors 0.13 ms, vs 0.33 for min/max per tensor and 1.2 for the inf-norm
    unit = _UNIT.get(device)
    if unit is None:
        unit = _UNIT[device] = torch.ones(1, dtype=torch.float32, device=device)
    found = torch.zeros(1, dtype=torch.float32, device=device)  # whatever the default dtype
    torch._amp_foreach_non_finite_check_and_unscale_(views, found, unit)
    return found


def quantize_blocks(flat: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """int8 codes of a float32 vector and a float32 scale per ``chunk`` values
    (:meth:`hvdsync.core.wire.CodecOps.quantize_blocks`)."""
    rows = torch.nn.functional.pad(flat, (0, -flat.numel() % chunk)).view(-1, chunk)
    scale = rows.abs().amax(dim=1) / 127.0  # NaN/Inf show in the scale
    # an all-zero chunk divides by the smallest float instead of 0 (its codes are 0
    # either way: the Keras adapter divides by 1 there)
    safe = scale.clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return [codes.view(-1)[:flat.numel()], scale]  # the padding is not sent


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, chunk: int,
                      size: Optional[int] = None) -> torch.Tensor:
    """:func:`quantize_blocks` undone: a float32 vector; with ``size``, every rank's at once
    (an allgather's), a ``size x n`` matrix with rank ``r``'s values in row ``r``."""
    if size is None:
        rows = torch.nn.functional.pad(codes.float(), (0, -codes.numel() % chunk))
        return (rows.view(-1, chunk) * scale[:, None]).view(-1)[:codes.numel()]
    n = codes.numel() // size
    rows = torch.nn.functional.pad(codes.float().view(size, n), (0, -n % chunk))
    return (rows.view(size, -1, chunk) * scale.view(size, -1, 1)).view(size, -1)[:, :n]


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into tensors shaped (and typed) like ``like`` (views where the dtype is
    ``flat``'s)."""
    pieces = flat.split([t.numel() for t in like])  # (one op for every piece)
    return [p.view(t.shape) if p.dtype == t.dtype else p.view(t.shape).to(t.dtype)
            for p, t in zip(pieces, like)]


def average_rows(rows: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The mean of the rows of a ``size x n`` matrix (a rank's values each), summed in rank
    order (the same bits on every rank), shaped like ``like``."""
    size = rows.shape[0]
    dtypes = {t.dtype for t in like}
    if len(dtypes) > 1:  # (rare) one rank at a time, tensor by tensor
        total = None
        for r in range(size):
            mine = unflatten(rows[r], like)
            total = mine if total is None else [a.add_(b) for a, b in zip(total, mine)]
        return [torch.zeros_like(t).add_(t, alpha=1.0 / size) for t in total]
    # in the tensors' precision
    rows = rows.to(next(iter(dtypes)))
    total = rows[0].clone()
    for r in range(1, size):
        total.add_(rows[r])
    return unflatten(torch.zeros_like(total).add_(total, alpha=1.0 / size), like)


# -- clip=: a group of layers clipped at once (the rules and their running statistics are
# hvdsync.techniques.clip.technique.Clip's). Clipping runs inside backward hooks, so it must
# not stall the host on a GPU: every decision is a tensor op on the gradients' device, the
# norms go to the host once per step; and it must not cost a kernel per tensor: a group's
# per-layer norms come from one multi-tensor norm, its scales from a few ops on a vector of
# them, and one multi-tensor multiply applies them -- about a dozen ops for the whole group,
# whatever its number of layers (torch's own clip_grad_norm_(foreach=True) costs 8 for one
# global norm).
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
    group's record (:meth:`hvdsync.techniques.clip.ports.ClipKernel.clip_layers`): a float32 device matrix, row 0 each
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


# -- TorchOps' arithmetic of many tensors at once ----------------------------------------------
class MultiTensorOps:
    """The multi-tensor half of :class:`hvdsync.torch.ops.TorchOps` (norms, dots, the
    finiteness check, copies and sums of many tensors, clipping, the outer exchange's
    coding)."""

    clip_layers = staticmethod(clip_layers)

    @staticmethod
    def bad(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        flag = nonfinite_flag(tensors)
        return torch.zeros(()) if flag is None else flag

    @staticmethod
    def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
        flag = nonfinite_flag(tensors)
        return flag is None or not flag.item()  # one device read

    @staticmethod
    def zero_if(flag: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        mask = flag.to(torch.bool)
        return [t.masked_fill_(mask, 0.0) for t in tensors]  # on the device: no host sync

    @staticmethod
    def clone_all(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        tensors = [t.detach() if t.requires_grad else t for t in tensors]
        return list(torch._foreach_mul(tensors, 1.0)) if tensors else []  # (one op: copies)

    @staticmethod
    def accumulate_all(accs: Sequence[torch.Tensor], xs: Sequence[torch.Tensor],
                       sign: int = 1) -> list[torch.Tensor]:
        accs = list(accs)
        if accs:
            (torch._foreach_add_ if sign > 0 else torch._foreach_sub_)(accs, list(xs))
        return accs

    @staticmethod
    def norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return norm_of(tensors)

    @staticmethod
    def dot(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return layer_dots([list(pairs)]).reshape(())  # (one layer of a group's form)

    @staticmethod
    def norms(layers: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        return layer_norms(layers)

    @staticmethod
    def dots(layers: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor:
        return layer_dots(layers)

    @staticmethod
    def in_layer_order(n: int, parts: Sequence[tuple[Sequence[int], torch.Tensor]]
                       ) -> torch.Tensor:
        return in_layer_order(n, parts)

    @staticmethod
    def concat(parts: Sequence[torch.Tensor], dtype: str = "float32") -> torch.Tensor:
        device = parts[0].device
        flat = torch.cat([p.reshape(-1).to(device) if p.dim() != 1 else p.to(device)
                          for p in parts]) if len(parts) > 1 else parts[0].reshape(-1)
        return flat.to(getattr(torch, dtype))

    @staticmethod
    def read(vectors: Sequence[torch.Tensor]) -> list[list[float]]:
        if not vectors:
            return []
        if len(vectors) == 1:  # (no op but the read)
            return [_flatten(vectors[0].tolist())]
        device = vectors[0].device
        values = torch.cat([v.reshape(-1).float().to(device) for v in vectors]).tolist()
        out, i = [], 0
        for v in vectors:
            out.append(values[i:i + v.numel()])
            i += v.numel()
        return out

    @staticmethod
    def to_host(scalars: Sequence[Any]) -> list[float]:
        if not scalars:
            return []
        ts = [s if torch.is_tensor(s) else torch.tensor(float(s)) for s in scalars]
        device = ts[0].device
        # one device read: everything on the first scalar's device, stacked
        return torch.stack([t.detach().float().reshape(()).to(device) for t in ts]).tolist()

    # -- the codecs' primitives (hvdsync.core.wire.CodecOps)
    @staticmethod
    def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return flatten_all([t.detach() if t.requires_grad else t for t in tensors],
                           torch.float32)

    @staticmethod
    def unflat(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return unflatten(flat, like)

    @staticmethod
    def bitcast(t: torch.Tensor, dtype: str) -> torch.Tensor:
        return t.view(getattr(torch, dtype))

    @staticmethod
    def rows(flat: torch.Tensor, size: int) -> torch.Tensor:
        return flat.view(size, -1)

    @staticmethod
    def quantize_blocks(flat: torch.Tensor, chunk: int) -> list[torch.Tensor]:
        return quantize_blocks(flat, chunk)

    @staticmethod
    def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, chunk: int,
                          size: Optional[int] = None) -> torch.Tensor:
        return dequantize_blocks(codes, scale, chunk, size)

    @staticmethod
    def average_rows(rows: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return average_rows(rows, like)

    @staticmethod
    def add_all(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch._foreach_add(list(a), list(b))) if a else []

    @staticmethod
    def sub_all(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch._foreach_sub(list(a), list(b))) if a else []

    @staticmethod
    def add_scaled_all(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], alpha: float
                       ) -> list[torch.Tensor]:
        return list(torch._foreach_add(list(a), list(b), alpha=alpha)) if a else []

    @staticmethod
    def assign_all(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        if targets:
            with torch.no_grad():
                torch._foreach_copy_(list(targets), list(values))


def _flatten(x: Any) -> list:
    """``Tensor.tolist()`` of any shape as one flat list."""
    if not isinstance(x, list):
        return [x]
    return [y for item in x for y in _flatten(item)] if x and isinstance(x[0], list) else x
