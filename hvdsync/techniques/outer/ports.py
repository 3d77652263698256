"""What ``delay=``'s synchronization of the models alone needs of an adapter, beside the
shared ports (:mod:`hvdsync.core.ports`) and the codecs' (:mod:`hvdsync.core.wire`): writing
parameters, fused calls; the replicas' tensors; averaging and gathering between ranks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hvdsync.core.wire import Pending


class OuterOps(Protocol):
    """The arithmetic (``ops``)."""

    def assign(self, target: Any, value: Any) -> None:
        """Write ``value`` into a parameter (or state tensor) of
        :meth:`Gradients.replica_tensors`."""
    def add_scaled_all(self, a: Sequence[Any], b: Sequence[Any], alpha: float) -> list:
        """``a + alpha * b`` pairwise, as new tensors."""
    def assign_all(self, targets: Sequence[Any], values: Sequence[Any]) -> None:
        """:meth:`assign` pairwise."""
    def fused(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` -- arithmetic of these ops over lists of tensors (``None`` for an absent
        one), with no host read, no branch on a tensor's value and no collective -- as the
        adapter runs it best: one compiled call where every op costs a dispatch of its own
        (Keras, eager: 50-150 us an op), as it is where ops are cheap (torch). Wrap once,
        call often: a compiled form is kept per call structure. Worth it for dozens of ops a
        call (a traced call's argument handling costs ~0.3 ms in Keras), not for a few."""


class Replicas(Protocol):
    """The gradients' port's part (``grads``)."""

    def replica_tensors(self, li: int, with_state: bool) -> list:
        """Layer ``li``'s parameters (and, ``with_state``, the optimizer state shaped like
        them), as the tensors to average or assign."""


class Averages(Protocol):
    """The communicator's part (``comm``)."""

    def average(self, groups: list[tuple[str, list]]) -> tuple[int, int]: ...
    def allgather_async(self, name: str, tensors: list) -> Pending:
        """Start gathering every rank's 1-d ``tensors`` (same length on every rank); the
        pending's ``wait()`` gives, per tensor, the ranks' pieces concatenated in rank order."""


#: receiver -> what this technique adds to the shared ports there (tests/test_contracts.py)
EXTENDS = {"ops": OuterOps, "grads": Replicas, "comm": Averages}
