"""What ``delay=`` may call on the technique it carries (``lowrank=``: the rulebook's
:data:`hvdsync.core.rules.CARRIED`), declared once, so that delay reaches it through an
interface and the contract test (tests/test_contracts.py) sees every call, as it does the
ports' (docs/design.md, "One lifecycle: roles and moments").

A technique that ``delay=`` carries runs its exchange inside delay's: each step's global
gradient is the compressed one, folded in up to ``staleness`` steps later. lowrank's
``LowRank`` is :class:`Carryable`; its carried form, ``LowRankInDelay``, is the
:class:`CarriedCompressor`. Another compressor would implement the same two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol

from hvdsync.core.wire import Pending


class CarriedCompressor(Protocol):
    """The compression ``delay=`` runs its exchanges through (eager and traced)."""

    def exchange(self, li: int, ks: list[int], grads: list, step: int, lag: int,
                 name: str) -> Pending:
        """Eager: start the exchange of layer ``li``'s gradients for global step ``step``;
        the pending gives the rank-averaged (decompressed) gradients."""

    def end_step(self, ok: bool) -> None:
        """The step is over (``ok``: finite on every rank): commit what it decided."""

    def delay_flags(self) -> dict[str, Any]:
        """Traced: the flags delay's next traced step passes in (which exchanges are
        compressed, their ring slots)."""

    def trace_in_delay(self, layers: list[tuple[int, list[int]]], held: Optional[list[list]],
                       own: list[list], reduce: Callable[[int, str, list], list],
                       flags: dict[str, Any]) -> tuple[list[list], list[list]]:
        """Traced: delay's exchanges of a step (of ``held``, the last step's gradients, and
        of ``own``, this step's), built with ``reduce``; their results."""

    def delay_traffic(self, li: int, tensors: list, wire_bytes: Callable[[Any], int],
                      compressed: Any) -> tuple[Any, Any]:
        """Traced: the bytes and collectives of one layer's exchange in a step."""

    def discard_in_delay(self, held: Optional[dict[str, Any]] = None) -> None:
        """Traced: delay dropped its exchanges in flight (a flush); what they took goes back
        to the compressor's memory."""


class Carryable(Protocol):
    """A technique ``delay=`` may carry, before it is carried."""

    def in_delay(self, staleness: int, finished_steps: Callable[[], int]) -> CarriedCompressor:
        """Its form inside ``delay=`` (a technique that takes its place in the step pipeline):
        each global gradient is folded in at most ``staleness`` steps after its step;
        ``finished_steps()``: delay's count."""
