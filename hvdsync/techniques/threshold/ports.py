"""What ``threshold=`` alone needs of an adapter, beside the shared ports
(:mod:`hvdsync.core.ports`): ``flush()``'s update of the layers it keeps back."""

from __future__ import annotations

from typing import Any, Protocol


class SyncUpdate(Protocol):
    """The gradients' port's part (``grads``)."""

    def update_only(self, grads: dict[str, Any]) -> None:
        """Outside a step: one update of the wrapped optimizer with ``grads`` (by key) for
        those parameters only; every other parameter and its state stay as they are, and no
        step is counted (``flush()`` of layers a decider kept back)."""


#: receiver -> what this technique adds to the shared ports there (tests/test_contracts.py)
EXTENDS = {"grads": SyncUpdate}
