"""Steps to Horovod's target, as the bench bed measured them (the advisor's one input that is
not modelled: docs/at-scale.md).

Steps depend on how many replicas drift apart between averagings (``delay=``, ``"streaming"``,
post-local SGD): :data:`BY_REPLICAS` holds the factors measured at more than one replica count;
:func:`steps_factor` reads a count between them on a line in log2(replicas), and beyond the
largest extends that line (never downwards: more replicas are never credited with fewer steps).
A per-step technique's factor is its 2-rank one (:data:`MEASURED_STEPS`) at any size.
"""

from __future__ import annotations

import math
from typing import Optional

#: a two-level row's technique name (``between="nodes"``): the flat one's and this
SUFFIX = ", nodes"

#: steps to reach Horovod's quality, relative to Horovod (measured: the bench bed's 3-seed
#: cells, benchmarks/results/suite*.md; "-": never measured or did not reach the target there)
MEASURED_STEPS: dict[str, dict[str, tuple[Optional[float], str]]] = {
    "transformer": {
        "horovod": (1.0, "baseline"), "horovod fp16": (1.00, "suite_lm_outer_np2"),
        "hvdsync": (1.00, "suite_lm_np2"), "hvdsync clip": (None, "not measured"),
        "hvdsync threshold": (1.85, "suite_lm_np2 (with fp16)"),
        "hvdsync select": (1.42, "suite_lm_np2 (with fp16)"),
        "hvdsync lowrank": (1.70, "suite_lm_lowrank_np2"),
        "hvdsync delay": (1.38, "suite_lm_np2 (with fp16)"),
        "hvdsync streaming": (1.17, "suite_lm_outer_np2, _rerun"),
        "ddp+powersgd": (1.66, "suite_lm_np2"), "ddp post-local sgd": (1.45, "suite_lm_np2"),
    },
    "cnn": {
        "horovod": (1.0, "baseline"), "horovod fp16": (1.04, "suite_cnn_outer_np2"),
        "hvdsync": (1.01, "suite_quick, 1 seed"), "hvdsync clip": (1.00, "suite_quick, 1 seed"),
        "hvdsync threshold": (None, "did not reach the target (suite_cnn_np4)"),
        "hvdsync select": (None, "did not reach the target (suite_cnn_np4)"),
        "hvdsync lowrank": (None, "not measured"),
        "hvdsync delay": (1.17, "suite_quick, 1 seed"),
        "hvdsync streaming": (1.23, "suite_cnn_outer_np2"),
        "ddp+powersgd": (1.60, "suite_cnn_np4"),
        "ddp post-local sgd": (1.48, "suite_cnn_outer_np2"),
    },
    "mlp": {
        "horovod": (1.0, "baseline"), "horovod fp16": (1.01, "suite (digits, 4 ranks)"),
        "hvdsync": (1.06, "suite"), "hvdsync clip": (0.67, "suite"),
        "hvdsync threshold": (1.25, "suite"), "hvdsync select": (0.88, "suite"),
        "hvdsync lowrank": (None, "not measured"), "hvdsync delay": (1.35, "suite"),
        "hvdsync streaming": (None, "not measured"),
        "ddp+powersgd": (1.08, "suite"), "ddp post-local sgd": (None, "not measured"),
    },
    "embedding": {
        "horovod": (1.0, "baseline"), "horovod fp16": (1.15, "suite_zipf_np2"),
        "hvdsync": (0.94, "suite_zipf_np2"), "hvdsync sparse": (1.23, "suite_zipf_np2"),
        "hvdsync clip": (None, "1 seed only"), "hvdsync threshold": (None, "1 seed only"),
        "hvdsync select": (None, "1 seed only"), "hvdsync lowrank": (None, "not measured"),
        "hvdsync delay": (None, "1 seed only"), "hvdsync streaming": (None, "not measured"),
        "ddp+powersgd": (1.44, "suite_zipf_np2"), "ddp post-local sgd": (2.15, "suite_zipf_np2"),
    },
}

#: the techniques whose replicas drift apart between averagings (their factor depends on how
#: many), as the advisor and the bench name them
LOCAL_STEPS = ("hvdsync delay", "hvdsync streaming", "ddp post-local sgd")

#: family -> technique -> replicas -> (steps to Horovod's target relative to Horovod, source);
#: a two-level technique's replicas are its nodes (benchmarks/results/suite*.md)
BY_REPLICAS: dict[str, dict[str, dict[int, tuple[float, str]]]] = {
    "transformer": {
        "hvdsync streaming": {2: (1.17, "suite_lm_outer_np2, _rerun"),
                              4: (1.40, "suite_lm_nodes_2x2")},
        "ddp post-local sgd": {2: (1.45, "suite_lm_np2"), 4: (1.90, "suite_lm_nodes_2x2")},
        "hvdsync streaming, nodes": {2: (1.04, "suite_lm_nodes_2x2")},
        "ddp post-local sgd, nodes": {2: (1.34, "suite_lm_nodes_2x2")},
    },
}


def _per_doubling(points: dict[int, tuple[float, str]]) -> Optional[float]:
    """The factor's growth per doubling of replicas between the two largest measured counts."""
    if len(points) < 2:
        return None
    a, b = sorted(points)[-2:]
    return (points[b][0] - points[a][0]) / (math.log2(b) - math.log2(a))


def _on_the_line(points: dict[int, tuple[float, str]], replicas: int,
                 slope: Optional[float] = None) -> tuple[float, str]:
    """The factor at ``replicas`` from measured ``points``: exact where measured, linear in
    log2(replicas) between them and beyond the last (``slope`` per doubling where only one
    point is measured)."""
    if replicas in points:
        return points[replicas]
    slope = _per_doubling(points) if len(points) > 1 else slope
    near = min(points, key=lambda r: abs(math.log2(r) - math.log2(replicas)))
    factor, source = points[near]
    if replicas > near:
        factor += max(slope or 0.0, 0.0) * (math.log2(replicas) - math.log2(near))
    return factor, f"{source} at {near} replicas, extended to {replicas}"


def steps_factor(measured: dict[str, tuple[Optional[float], str]], family: str,
                 technique: str, replicas: int) -> tuple[Optional[float], str]:
    """Steps to Horovod's target for ``technique`` (a flat or two-level row's name) with
    ``replicas`` replicas: on :data:`BY_REPLICAS`' line where it measured the technique (a
    two-level one measured at one count: with the flat one's growth), otherwise the family's
    flat factor (``measured``, from 2-rank cells)."""
    curves = BY_REPLICAS.get(family, {})
    flat_name = technique.removesuffix(SUFFIX)
    flat = curves.get(flat_name)
    if technique in curves:
        return _on_the_line(curves[technique], replicas, flat and _per_doubling(flat))
    if flat_name in LOCAL_STEPS and flat is not None:
        return _on_the_line(flat, replicas)
    return measured.get(flat_name, (None, "not measured"))
