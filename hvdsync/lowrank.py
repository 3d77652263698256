"""``lowrank=``: low-rank gradient compression (PowerSGD-style), as a transport.

A weight matrix ``M`` (``n x m``) is sent as two thin factors: ``P = allreduce((grad + E) Q)``,
orthonormalized, then ``Q = allreduce(M^T P)``; every rank applies ``P Q^T`` and keeps
``E = M - P Q^T`` (its error feedback) for a later step. docs/lowrank.md says what is
compressed, how it composes and what it costs.

This module holds the config, the arithmetic every mode shares (:func:`rank_of`,
:func:`seeded_q`, :func:`project`, :func:`two_rounds`) and :class:`LowRankBase`, the memory
every mode keeps (``Q``, ``E``, the step count) and how it is saved. The modes:
:class:`hvdsync.lowrank_pipeline.LowRankCompression` in the step pipeline (eager and traced)
and :class:`hvdsync.lowrank_delay.DelayedLowRank` inside ``delay=``.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from hvdsync.config import coerce_config
from hvdsync.ports import Communicator, Gradients, TensorOps
from hvdsync.technique import Transport, refill


@dataclass(frozen=True)
class LowRankConfig:
    """Low-rank compression of weight matrices (docs/lowrank.md).

    Args:
        rank: columns of the factors (higher: closer to the plain average, more bytes).
        warmup_steps: steps sent plain before compression starts.
        min_compression: a matrix is compressed only when its factors are at least this many
            times smaller than it (``0``: every matrix, whatever the rank).
        seed: of the first ``Q`` (the same on every rank).
        bucket_bytes: consecutive layers (in backward order) share their P and Q rounds until
            their factors reach this many bytes -- fewer collectives, each a little later;
            ``0``: every layer has its own rounds (as in Keras' compiled step beside a
            decider, whose branches send one layer each).
    """

    rank: int = 4
    warmup_steps: int = 10
    min_compression: float = 2.0
    seed: int = 0
    bucket_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "warmup_steps", "seed", "bucket_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"lowrank {name} must be an int, got {type(v).__name__} {v!r}")
        if self.rank < 1:
            raise ValueError(f"lowrank rank must be >= 1, got {self.rank}")
        if self.warmup_steps < 0:
            raise ValueError(f"lowrank warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.bucket_bytes < 0:
            raise ValueError(f"lowrank bucket_bytes must be >= 0, got {self.bucket_bytes}")
        c = self.min_compression
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) \
                or c < 0:
            raise ValueError(f"lowrank min_compression must be a finite number >= 0, got {c!r}")

    @classmethod
    def coerce(cls, value: Any) -> Optional["LowRankConfig"]:
        """``None``, a :class:`LowRankConfig`, a dict of its fields, or an int (the rank)."""
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return coerce_config(cls, value, "lowrank", "rank")


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


class LowRankBase(Transport):
    """What every mode of ``lowrank=`` keeps: ``q[key]``, the last ``Q`` of a parameter
    (shared: every rank has the same), ``err[key]``, this rank's error feedback (both as the
    adapter's matrices; keys are :meth:`Gradients.key`), and the count of finished steps."""

    name = "lowrank"
    per_rank = ("err",)
    traceable = True
    traced_with = ("clip", "plain", "delay", "sparse", "threshold", "select")

    def __init__(self, config: LowRankConfig, grads: Gradients, ops: TensorOps,
                 comm: Communicator, layer_names: list[str]):
        self.config = config
        self.grads = grads
        self.ops = ops
        self.comm = comm
        self.layer_names = layer_names
        self.step = 0  # finished steps
        self.q: dict[str, Any] = {}
        self.err: dict[str, Any] = {}
        self._rank: dict[tuple[int, int], int] = {}  # (li, k) -> rank used, 0: goes plain

    def rank_for(self, li: int, k: int) -> int:
        """The rank parameter ``k`` of layer ``li`` is compressed to (0: it goes plain)."""
        r = self._rank.get((li, k))
        if r is None:
            r = self._rank[(li, k)] = rank_of(self.ops, self.config, self.grads.value(li, k))
        return r

    def _initial_q(self, key: str, li: int, k: int, m: Any) -> Any:
        """The matrix's last Q, or the seeded first one (the same on every rank)."""
        q = self.q.get(key)
        if q is None:
            q = self.q[key] = self.ops.from_host(
                seeded_q(self.config.seed, key, self.ops.matrix_shape(m)[1],
                         self.rank_for(li, k)), m)
        return q

    def _seeded_memory(self, params: dict[str, Any]) -> tuple[dict, dict]:
        """For a traced step, per compressible parameter: its seeded Q and a zero ``E`` (host
        arrays; adding a zero ``E`` changes no bit)."""
        q, err = {}, {}
        for key, p in params.items():
            r = rank_of(self.ops, self.config, p)
            if r:
                n, m = self.ops.matrix_shape(p)
                q[key] = seeded_q(self.config.seed, key, m, r)
                err[key] = np.zeros((n, m))
        return q, err

    def _restart(self) -> None:
        """Nothing in flight any more (a checkpoint was loaded, or memory forgotten)."""

    def _owed(self) -> dict[str, Any]:
        """By key, what this rank's compression has not delivered yet."""
        return dict(self.err)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Shared: the step count and each matrix's Q. Per rank: the residuals (``err``)."""
        g = self.grads
        return {"step": self.step, "q": {k: g.to_saved(k, v) for k, v in self.q.items()},
                "err": {k: g.to_saved(k, v) for k, v in self.err.items()}}

    def load_state_dict(self, state: dict) -> None:
        g = self.grads
        self._restart()
        self.step = int(state["step"])
        # in place: the mappings may be a traced step's variables (use_memory)
        refill(self.q, {k: g.from_saved(k, v) for k, v in state["q"].items()})
        refill(self.err, {k: g.from_saved(k, v) for k, v in state.get("err", {}).items()})

    def forget(self) -> None:
        """Start over: no residuals, fresh Q (every rank alike)."""
        self.q.clear()
        self.err.clear()
        self._restart()

    def drop_per_rank(self) -> None:
        """Drop this rank's residuals; Q is shared and stays."""
        self.err.clear()

    def status(self) -> dict:
        """``residual_norm``: of what this rank still owes (:meth:`_owed`)."""
        compressed = sorted({self.layer_names[li] for (li, _), r in self._rank.items() if r})
        owed = list(self._owed().values())
        return {"step": self.step, "compressing": self.step >= self.config.warmup_steps,
                "layers": compressed, "residual_norm": float(self.ops.to_host(
                    [self.ops.norm(owed)])[0]) if owed else 0.0}
