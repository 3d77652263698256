"""``lowrank=``: low-rank gradient compression (PowerSGD-style), as a transport.

A weight matrix ``M`` (``n x m``) is sent as two thin factors, in two rounds of its codec
(:class:`hvdsync.techniques.lowrank.codec.PowerFactors`): every rank applies ``P Q^T`` and
keeps ``E = M - P Q^T`` (its error feedback) for a later step. docs/lowrank.md says what is
compressed, how it composes and what it costs.

:class:`LowRankBase` is the memory every mode keeps (``Q``, ``E``, the step count) and how it
is saved. The modes: :class:`hvdsync.techniques.lowrank.in_step.LowRank` in the step pipeline
(eager and traced) and :class:`hvdsync.techniques.lowrank.in_delay.LowRankInDelay` inside
``delay=``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hvdsync.core.ports import Communicator, Gradients, TensorOps
from hvdsync.core.technique import Transport, refill
from hvdsync.techniques.lowrank.config import LowRankConfig
from hvdsync.techniques.lowrank.factors import rank_of, seeded_q


class LowRankBase(Transport):
    """What every mode of ``lowrank=`` keeps: ``q[key]``, the last ``Q`` of a parameter
    (shared: every rank has the same), ``err[key]``, this rank's error feedback (both as the
    adapter's matrices; keys are :meth:`Gradients.key`), and the count of finished steps."""

    name = "lowrank"
    per_rank = ("err",)
    traceable = True
    traced_with = ("clip", "plain", "delay", "outer", "sparse", "threshold", "select")

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
