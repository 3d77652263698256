"""``lowrank=``: low-rank gradient compression (PowerSGD-style) inside the layer pipeline (a
transport).

A layer's weight matrix ``M`` (``n x m``; conv kernels are viewed as matrices, the adapter
says how) is sent as two thin factors instead of ``n * m`` numbers. Per step and parameter,
with ``Q`` (``m x r``) kept from the last step (warm start) and ``E`` this rank's error
feedback (what earlier steps' compression left out)::

    M = grad + E                      this rank's gradient plus what it still owes
    P = allreduce(M Q)                started in backward, the moment the layer is ready
    P = orthonormal(P)                the same on every rank (same input)
    Q = allreduce(M^T P)              started as soon as P has arrived
    grad <- P Q^T                     identical on every rank: the replicas stay identical
    E <- M - P Q^T                    nothing is lost: it goes in a later step

so a layer costs ``r (n + m)`` numbers in two rounds instead of ``n m`` in one. ``P Q^T`` is
the projection of the rank-averaged ``M`` on the span of ``P``: with ``r >= min(n, m)`` it is
the plain average (up to rounding), and error feedback makes the sum of what is delivered
plus the ranks' averaged residual equal the sum of the averaged gradients, step after step.

What goes plain (the next transport): vectors (biases, norms), row-sparse gradients, matrices
the factors would not shrink by ``min_compression`` (``r (n + m) * min_compression > n m``),
and every layer during the first ``warmup_steps`` steps (the first steps move the model
most; PowerSGD's ``start_powerSGD_iter``). How it differs from DDP's PowerSGD hook, and why:
docs/lowrank.md.

Composition: ``clip=`` clips before (a transform); ``threshold=``/``select=`` decide which
layers go, and a layer that goes is compressed (what it kept back joins its gradient first);
``fp16`` (``compression=``) carries the factors in half precision. A step that is non-finite
on any rank commits neither ``E`` nor ``Q`` (the step is skipped everywhere).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Optional

from hvdsync.config import coerce_config
from hvdsync.technique import Communicator, Gradients, Pending, TensorOps, Transport


@dataclass(frozen=True)
class LowRankConfig:
    """Low-rank compression of weight matrices; see the module docstring.

    ``rank``: columns of the factors (higher: closer to the plain average, more bytes).
    ``warmup_steps``: steps sent plain before compression starts. ``min_compression``: a
    matrix is compressed only when its factors are at least this many times smaller than it
    (``0``: every matrix, whatever the rank). ``seed``: of the first ``Q`` (the same on every
    rank).
    """

    rank: int = 4
    warmup_steps: int = 10
    min_compression: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "warmup_steps", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"lowrank {name} must be an int, got {type(v).__name__} {v!r}")
        if self.rank < 1:
            raise ValueError(f"lowrank rank must be >= 1, got {self.rank}")
        if self.warmup_steps < 0:
            raise ValueError(f"lowrank warmup_steps must be >= 0, got {self.warmup_steps}")
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


class _Layer:
    """One layer's compression in flight this step."""

    def __init__(self, li: int, ks: list[int], ms: list, p: Pending):
        self.li, self.ks, self.ms, self.p = li, ks, ms, p
        self.q: Optional[Pending] = None  # the Q round
        self.result: Optional[Pending] = None  # the Q round, then the gradient delivered


class LowRankCompression(Transport):
    """Owns the compressible matrices after warm-up; per layer: P round, then Q round.

    ``q[key]`` is the last ``Q`` of a parameter (shared: every rank has the same), ``err[key]``
    this rank's error feedback (both as the adapter's matrices). Keys are
    :meth:`Gradients.key`.
    """

    name = "lowrank"
    per_rank = ("err",)

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
        self._new_step()

    def _new_step(self) -> None:
        self._waiting: list[_Layer] = []  # P in flight, Q not started yet (in layer order)
        self._started: list[_Layer] = []
        self._new_q: dict[str, Any] = {}
        self._new_err: dict[str, Any] = {}

    # -- which parameters -------------------------------------------------------------------
    def rank_for(self, li: int, k: int) -> int:
        """The rank parameter ``k`` of layer ``li`` is compressed to (0: it goes plain)."""
        r = self._rank.get((li, k))
        if r is None:
            shape = self.ops.matrix_shape(self.grads.value(li, k))
            r = 0
            if shape is not None:
                n, m = shape
                r = min(self.config.rank, n, m)
                if r * (n + m) * self.config.min_compression > n * m:
                    r = 0
            self._rank[(li, k)] = r
        return r

    def owns(self, li: int, k: int) -> bool:
        return (self.step >= self.config.warmup_steps and self.rank_for(li, k) > 0
                and not self.grads.is_row_sparse(li, k))

    # -- the step ---------------------------------------------------------------------------
    def start(self, li: int, ks: list[int]) -> Optional[Pending]:
        """Start the layer's P round (its Q round starts once P has arrived)."""
        g, ops = self.grads, self.ops
        ms, ps = [], []
        for k in ks:
            key = g.key(li, k)
            m = ops.matrix(g.get(li, k))
            if key in self.err:
                m = ops.add(m, self.err[key])
            q = self.q.get(key)
            if q is None:
                q = self.q[key] = ops.random_matrix(
                    ops.matrix_shape(m)[1], self.rank_for(li, k),
                    (self.config.seed * 1_000_003 + zlib.crc32(key.encode())) % 2**31, m)
            ms.append(m)
            ps.append(ops.matmul(m, q))
        layer = _Layer(li, ks, ms,
                       self.comm.allreduce(f"hvdsync.lowrank.P.{self.layer_names[li]}", ps))
        self._waiting.append(layer)
        self._advance()
        return None

    def _advance(self) -> None:
        """Start the Q round of every waiting layer whose P has arrived, in layer order."""
        while self._waiting and self._waiting[0].p.ready():
            self._start_q(self._waiting.pop(0))

    def _start_q(self, layer: _Layer) -> None:
        g, ops = self.grads, self.ops
        ps = [ops.orthonormal(p) for p in layer.p.wait()]
        qs = [ops.matmul(m, p, transpose_a=True) for m, p in zip(layer.ms, ps)]
        pending = self.comm.allreduce(f"hvdsync.lowrank.Q.{self.layer_names[layer.li]}", qs)

        def deliver(qs_avg: list) -> None:
            for k, m, p, q in zip(layer.ks, layer.ms, ps, qs_avg):
                key = g.key(layer.li, k)
                approx = ops.matmul(p, q, transpose_b=True)
                self._new_q[key] = q
                self._new_err[key] = ops.accumulate(ops.clone(m), approx, sign=-1)
                g.set(layer.li, k, ops.from_matrix(approx, g.get(layer.li, k)))
        layer.q, layer.result = pending, pending.then(deliver)
        self._started.append(layer)

    def flush(self) -> dict[int, Pending]:
        """Every P is in flight: start the Q rounds still to start (each waits for its P)."""
        if self._waiting:
            self.comm.flush()  # queued P rounds go now (Keras)
            while self._waiting:
                self._start_q(self._waiting.pop(0))
            self.comm.flush()  # and the Q rounds
        for layer in self._started:  # both rounds count (Keras knows them after flush)
            layer.result.nbytes = layer.p.nbytes + layer.q.nbytes
            layer.result.collectives = layer.p.collectives + layer.q.collectives
        return {layer.li: layer.result for layer in self._started}

    def end_step(self, ok: bool) -> None:
        """Commit the step's Q and residuals when it was finite on every rank."""
        if ok:  # a skipped step does not count (warm-up ends as if it never happened)
            self.q.update(self._new_q)
            self.err.update(self._new_err)
            self.step += 1
        self._new_step()

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Shared: the step count and each matrix's Q. Per rank: the residuals (``err``)."""
        g = self.grads
        return {"step": self.step, "q": {k: g.to_saved(k, v) for k, v in self.q.items()},
                "err": {k: g.to_saved(k, v) for k, v in self.err.items()}}

    def load_state_dict(self, state: dict) -> None:
        g = self.grads
        self._new_step()
        self.step = int(state["step"])
        self.q = {k: g.from_saved(k, v) for k, v in state["q"].items()}
        self.err = {k: g.from_saved(k, v) for k, v in state.get("err", {}).items()}

    def forget(self) -> None:
        """Start over: no residuals, fresh Q (every rank alike)."""
        self.q.clear()
        self.err.clear()
        self._new_step()

    def drop_per_rank(self) -> None:
        """Drop this rank's residuals; Q is shared and stays."""
        self.err.clear()

    def status(self) -> dict:
        compressed = sorted({self.layer_names[li] for (li, _), r in self._rank.items() if r})
        return {"step": self.step, "compressing": self.step >= self.config.warmup_steps,
                "layers": compressed, "residual_norm": float(self.ops.to_host(
                    [self.ops.norm(list(self.err.values()))])[0]) if self.err else 0.0}
