"""What ``lowrank=`` alone needs of an adapter, beside the shared ports
(:mod:`hvdsync.core.ports`): how a tensor is viewed as a matrix and multiplied, and where
collectives block their caller, a round run right behind a flush (inside ``delay=``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Optional, Protocol


class Factors(Protocol):
    """Low-rank factors: the adapter says how a tensor is viewed as a matrix (``ops``)."""

    def matrix_shape(self, t: Any) -> Optional[tuple[int, int]]:
        """``(rows, cols)`` of ``t`` as a matrix; ``None`` for vectors and scalars."""
    def matrix(self, t: Any) -> Any: ...
    def from_matrix(self, m: Any, like: Any) -> Any:
        """``m`` (from :meth:`matrix`) in the shape of ``like``."""
    def matmul_all(self, a: Sequence[Any], b: Sequence[Any], transpose_a: bool = False,
                   transpose_b: bool = False) -> list:
        """``a[i] @ b[i]`` (each operand transposed where asked), at once (one multi-tensor op
        where there is one)."""
    def orthonormal_all(self, ps: Sequence[Any]) -> list:
        """An orthonormal basis of each ``p``'s columns (QR's Q, same shape; deterministic),
        matrices of a shape in one batched call."""
    def from_host(self, values: Any, like: Any) -> Any:
        """``values`` (a numpy array) as a tensor with ``like``'s dtype and device."""


class Rounds(Protocol):
    """The communicator's part (``comm``)."""

    def after_dispatch(self, fn: Callable[[Callable[[str, list], list]], Any]
                    ) -> Optional[Future]:
        """Where collectives block their caller (Keras' eager Horovod ops): run ``fn(reduce)``
        in the background thread right after the next background ``dispatch()``, in the same
        order on every rank, and return its future; ``reduce(name, tensors)`` is a blocking
        allreduce for the rounds that depend on the dispatch. ``None`` where collectives run
        asynchronously (torch): the caller starts those rounds itself, once the dispatch's have
        arrived."""


#: receiver -> what this technique adds to the shared ports there (tests/test_contracts.py)
EXTENDS = {"ops": Factors, "comm": Rounds}
