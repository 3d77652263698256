"""What ``clip=`` alone needs of an adapter, beside the shared ports (:mod:`hvdsync.core.ports`):
its arithmetic for a group of layers, which each adapter writes itself (Keras builds it into
the compiled function), and which layers hold values at all."""

from __future__ import annotations

from typing import Any, Protocol, Union

from hvdsync.techniques.clip.config import ClipConfig


class ClipKernel(Protocol):
    """The arithmetic's part (``ops``)."""

    def clip_layers(self, layers: list, params: list, config: ClipConfig,
                    limits: Union[float, list]) -> tuple[list, Any]:
        """A group of layers clipped: ``layers``, each layer's gradients (device values);
        ``limits``, each layer's ``max_norm`` and adaptive limit as a float, ``inf`` where
        none applies (one float when all are alike); the ``ratio`` rule applied inside, from
        ``params``. Returns the clipped layers and a float32 device matrix: row 0 each
        layer's pre-clip norm, row 1 a factor below 1 exactly where the layer was clipped
        (``None``: the group holds no values)."""


class Payloads(Protocol):
    """The gradients' part (``grads``)."""

    def payload_bytes(self, li: int) -> int:
        """The bytes of layer ``li``'s gradients as they stand (a sparse one's rows; 0: no
        values -- nothing to clip or observe)."""


#: receiver -> what this technique adds to the shared ports there (tests/test_contracts.py)
EXTENDS = {"ops": ClipKernel, "grads": Payloads}
