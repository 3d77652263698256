"""``lowrank=``'s wire encoding: a matrix as PowerSGD's two thin factors, a codec of two rounds
in the shape of every encoding (:class:`hvdsync.core.wire.Codec`). Every mode of ``lowrank=``
(in the step pipeline, inside ``delay=``, eager and traced) runs its rounds through
:data:`FACTORS`; what they differ in is when the rounds go and what memory they keep."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from hvdsync.core.wire import Codec


class PowerFactors(Codec):
    """A matrix ``M`` (``n x m``, this rank's, error feedback included) as factors of rank
    ``r``, in two allreduce rounds: ``P = M Q`` from the ``Q`` it starts from (the last one,
    or a seeded one: the same on every rank); then, ``P`` averaged and orthonormalized,
    ``Q = M^T P``. The average is ``P Q^T`` (the same on every rank), and ``M - P Q^T`` is what
    this rank has not delivered (:meth:`residual`). Both rounds may be summed on the wire:
    given a shared ``Q`` (then a shared ``P``) the factors of the ranks' sum are the sums of
    their factors. Multi-tensor throughout: the matrices of a round go together."""

    name, collective, rounds = "lowrank", "allreduce", 2

    def encode(self, ops: Any, tensors: Sequence[Any],
               start: Optional[Sequence[Any]] = None) -> tuple[list, Any]:
        """The P round: ``M Q`` for each matrix and the ``Q`` it starts from (``start``);
        the context is the matrices."""
        ms = list(tensors)
        return (ops.matmul_all(ms, list(start)) if ms else []), ms

    def next_round(self, ops: Any, received: Sequence[Any], ctx: Any) -> tuple[list, Any]:
        """The Q round from the averaged ``P``: ``M^T P`` of ``P`` orthonormalized; the
        context is then the matrices and their ``P``."""
        ps = ops.orthonormal_all(list(received)) if received else []
        return (ops.matmul_all(ctx, ps, transpose_a=True) if ps else []), (ctx, ps)

    def average(self, ops: Any, received: Sequence[Any], size: int, ctx: Any) -> list:
        """``P Q^T`` from the averaged ``Q`` (the Q round's ``received``)."""
        _, ps = ctx
        return ops.matmul_all(ps, list(received), transpose_b=True) if ps else []

    def residual(self, ops: Any, averaged: Sequence[Any], ctx: Any) -> list:
        """``M - P Q^T``: what this rank still owes (its error feedback)."""
        ms, _ = ctx
        return ops.sub_all(ms, list(averaged)) if ms else []

    def decode(self, ops: Any, parts: Sequence[Any], ctx: Any) -> list:
        raise NotImplementedError("lowrank's factors decode only as the rank average: "
                                  "average(), and residual() for the error feedback")


#: the one instance every mode uses (it keeps no state)
FACTORS = PowerFactors()
