"""What ``delay=``'s transport alone needs of an adapter, beside the shared ports
(:mod:`hvdsync.core.ports`): zeros in place of this rank's non-finite local gradient, and the
loss scaler told of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class LocalSteps(Protocol):
    """The arithmetic's part (``ops``)."""

    def zero_if(self, flag: Any, tensors: Sequence[Any]) -> list:
        """``tensors``, or zeros like them where the device ``flag`` (``ops.bad``) is 1."""


class Overflow(Protocol):
    """The gradients' port's part (``grads``)."""

    def kept_nonfinite(self) -> None:
        """This rank's non-finite local gradients went as zeros this step (the step is not
        skipped everywhere, as a non-finite exchange would be): a loss scaler backs off."""


#: receiver -> what this technique adds to the shared ports there (tests/test_contracts.py)
EXTENDS = {"ops": LocalSteps, "grads": Overflow}
