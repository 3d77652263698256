"""``lowrank=``'s arithmetic, the same in every mode: a parameter's rank, the seeded first ``Q``,
the projection ``P Q^T`` and its residual, and one P and one Q round built at once."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from hvdsync.core.ports import TensorOps
from hvdsync.techniques.lowrank.config import LowRankConfig

def rank_of(ops: TensorOps, config: LowRankConfig, t: Any) -> int:
    """The rank a parameter shaped like ``t`` is compressed to (0: it goes plain: not a
    matrix, or the factors would not shrink it by ``min_compression``)."""
    shape = ops.matrix_shape(t)
    if shape is None:
        return 0
    n, m = shape
    r = min(config.rank, n, m)
    return 0 if r * (n + m) * config.min_compression > n * m else r


def seeded_q(seed: int, key: str, cols: int, rank: int) -> np.ndarray:
    """A matrix's first Q, drawn on the host: the same numbers in every adapter, on every
    rank."""
    seed = (seed * 1_000_003 + zlib.crc32(key.encode())) % 2**31
    return np.random.default_rng(seed).standard_normal((cols, rank))


def project(ops: TensorOps, m: Any, p: Any, q: Any) -> tuple[Any, Any]:
    """From a matrix ``M`` (this rank's, error feedback included), its orthonormal ``P`` and
    the rank-averaged ``Q``: what is delivered, ``P Q^T``, and what this rank still owes,
    ``M - P Q^T``."""
    approx = ops.matmul(p, q, transpose_b=True)
    return approx, ops.accumulate(ops.clone(m), approx, sign=-1)


def two_rounds(ops: TensorOps, layers: list[tuple[list, list, list, list]],
               reduce: Callable[[str, list], list], label: str
               ) -> tuple[list[list], list, list]:
    """One P and one Q round over ``layers``, built at once (a traced step; the eager modes
    run the same arithmetic spread over the step): per layer ``(gradients, matrices, warm Qs,
    other dense gradients)`` -- its compressed parameters' gradients, their matrices (error
    feedback included) and the Q each starts from, then the parameters that ride plain in
    the P round. Returns per layer what is delivered (its compressed parameters, then the
    rest), the new Qs and the residuals (``M - P Q^T``), both in the matrices' order."""
    sent = []
    for _, ms, qs, dense in layers:
        sent += [ops.matmul(m, q) for m, q in zip(ms, qs)] + list(dense)
    arrived = iter(reduce(f"hvdsync.lowrank.P.{label}", sent))
    orth, rest = [], []
    for _, ms, _, dense in layers:
        orth += [ops.orthonormal(next(arrived)) for _ in ms]
        rest.append([next(arrived) for _ in dense])
    ms = [m for _, layer_ms, _, _ in layers for m in layer_ms]
    new_q = list(reduce(f"hvdsync.lowrank.Q.{label}",
                        [ops.matmul(m, p, transpose_a=True) for m, p in zip(ms, orth)]))
    projected = iter([project(ops, m, p, q) for m, p, q in zip(ms, orth, new_q)])
    residuals, delivered = [], []
    for (xs, _, _, _), dense in zip(layers, rest):
        approx = [next(projected) for _ in xs]
        residuals += [r for _, r in approx]
        delivered.append([ops.from_matrix(a, x) for (a, _), x in zip(approx, xs)] + dense)
    return delivered, new_q, residuals


def round_label(names: list[str]) -> str:
    """A round's name from its layers' names (the first, or the first..the last)."""
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
