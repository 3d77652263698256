"""What ``select=`` alone needs of an adapter, beside the shared ports
(:mod:`hvdsync.core.ports`): withholding a layer from the update, the dot products its
hypernet scores, the square of a vector."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Withhold(Protocol):
    """The gradients' port's part (``grads``)."""

    def withhold(self, li: int, k: int) -> None:
        """Parameter ``k`` of layer ``li`` (and its optimizer state) does not move in this
        step's update (torch: its gradient dropped; Keras: put back after the update)."""


class Scores(Protocol):
    """The arithmetic's part (``ops``)."""

    def mul(self, a: Any, b: Any) -> Any:
        """``a * b`` (elementwise) as a new tensor."""
    def dots(self, layers: Sequence[Sequence[tuple[Any, Any]]]) -> Any:
        """Each layer's dot product of its pairs (``ops.dot``), as one float32 device
        vector."""


#: receiver -> what this technique adds to the shared ports there (tests/test_contracts.py)
EXTENDS = {"grads": Withhold, "ops": Scores}
