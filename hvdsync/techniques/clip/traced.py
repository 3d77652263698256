"""``clip=``'s traced form (Keras' compiled train function, :mod:`hvdsync.keras.traced_step`):
each layer clipped in the graph as it is built, before its send (``mode="local"``) or as its
average arrives (``"global"``), and one host call after the step that folds the norms into the
running statistics. :class:`TracedClip` is what a Clip composes for it (``clip.traced``); clip
is the only transform with a traced form, so its shape is declared here rather than in the core.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class TracedClip:
    """The traced form of :class:`hvdsync.techniques.clip.technique.Clip`, on its owner's
    config, limits, kernel (``ops.clip_layers``) and :meth:`~Clip.record_step`, which the
    eager step uses too."""

    #: how many float32 values a record of :meth:`trace_layer` holds: the pre-clip norm, and a
    #: factor below 1 where the layer was clipped
    record_size = 2

    def __init__(self, owner: Any):
        self.owner = owner

    def applies(self, arrived: bool) -> bool:
        """Whether :meth:`trace_layer` changes a layer at that moment (``arrived``: once its
        average has arrived, else before it is sent)."""
        return arrived == (self.owner.config.mode == "global")

    def trace_layer(self, li: int, tensors: list, params: list, arrived: bool,
                    host_scalar: Callable[[Callable[[], float]], Any]) -> tuple[list, Any]:
        """Layer ``li``'s gradients ``tensors`` clipped where :meth:`applies`, and a device
        record of :attr:`record_size` float32 values (``None``: nothing at that moment).
        ``params``: the layer's parameter values; ``host_scalar(fn)``: a float32 device scalar
        that ``fn()`` gives on the host as the step runs."""
        o, c = self.owner, self.owner.config
        if not self.applies(arrived) or not tensors:
            return tensors, None
        # an adaptive limit changes every step: read on the host as the step runs
        adaptive = c.ema is not None or c.variance is not None
        limit = host_scalar(lambda: o.norm_limit(li)) if adaptive else o.norm_limit(li)
        clipped, record = o.ops.clip_layers([tensors], [params], c, limit)
        return clipped[0], record

    def record(self, records: list[tuple[int, list[float]]], ok: bool) -> None:
        """On the host after a traced step: ``(layer, record)`` for each layer where
        :meth:`trace_layer` ran (an average's only where the layer was sent); ``ok``: the
        step was finite everywhere."""
        self.owner.record_step([(li, norm, factor < 1.0) for li, (norm, factor) in records], ok)
