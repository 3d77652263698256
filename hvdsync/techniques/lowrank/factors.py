"""``lowrank=``'s choices, the same in every mode: a parameter's rank, the seeded first ``Q``,
and one P and one Q round of its codec (:mod:`hvdsync.techniques.lowrank.codec`) built at
once."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from hvdsync.core.ports import TensorOps
from hvdsync.techniques.lowrank.codec import FACTORS
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


def two_rounds(ops: TensorOps, layers: list[tuple[list, list, list, list]],
               reduce: Callable[[str, list], list], label: str
               ) -> tuple[list[list], list, list]:
    """One P and one Q round of :data:`FACTORS` over ``layers``, built at once (a traced step;
    the eager modes run the same rounds spread over the step): per layer ``(gradients,
    matrices, warm Qs, other dense gradients)`` -- its compressed parameters' gradients,
    their matrices (error feedback included) and the Q each starts from, then the parameters
    that ride plain in the P round. Returns per layer what is delivered (its compressed
    parameters, then the rest), the new Qs and the residuals (``M - P Q^T``), both in the
    matrices' order."""
    ms = [m for _, layer_ms, _, _ in layers for m in layer_ms]
    ps, ctx = FACTORS.encode(ops, ms, [q for _, _, qs, _ in layers for q in qs])
    at = iter(ps)
    sent = []  # per layer: its P, then what rides plain
    for _, layer_ms, _, dense in layers:
        sent += [next(at) for _ in layer_ms] + list(dense)
    arrived = iter(reduce(f"hvdsync.lowrank.P.{label}", sent))
    p_avg, rest = [], []
    for _, layer_ms, _, dense in layers:
        p_avg += [next(arrived) for _ in layer_ms]
        rest.append([next(arrived) for _ in dense])
    qs_local, ctx = FACTORS.next_round(ops, p_avg, ctx)
    new_q = list(reduce(f"hvdsync.lowrank.Q.{label}", qs_local))
    approx = FACTORS.average(ops, new_q, 0, ctx)
    residuals = FACTORS.residual(ops, approx, ctx)
    delivered, at = [], iter(approx)
    for (xs, _, _, _), dense in zip(layers, rest):
        delivered.append([ops.from_matrix(next(at), x) for x in xs] + dense)
    return delivered, new_q, residuals


def round_label(names: list[str]) -> str:
    """A round's name from its layers' names (the first, or the first..the last)."""
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
