"""The traced form that transports share: what a tracing adapter (Keras' compiled train
function, :mod:`hvdsync.keras.graph`) builds into the step in place of the eager moments,
for a transport with rounds of its own (``lowrank=``, ``sparse=``): :class:`TracedRounds`. A
traced form only one technique has is that technique's object (``technique.traced``: clip's
:class:`~hvdsync.techniques.clip.traced.TracedClip`, delay's step that updates locally,
:class:`~hvdsync.techniques.delay.traced.TracedDelay`). The plain exchange has none: the
adapter builds its one collective per layer itself. docs/design.md, "One lifecycle: roles and
moments".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional


class TracedRounds:
    """A traced step that exchanges through this transport's own rounds: the adapter asks
    :meth:`traced_groups`, builds each group's :meth:`trace_exchange`, then
    :meth:`trace_commit` once, and on the host :meth:`end_traced_step` in place of
    ``end_step``. A transport that deciders govern (not in :data:`hvdsync.core.rules.UNDECIDED`)
    has its rounds built inside a decider's branch, and its staged memory must leave that
    branch: it also has ``staged`` and ``restage`` (``lowrank=``'s,
    :class:`hvdsync.techniques.lowrank.in_step.LowRank`)."""

    name: str

    def traced_groups(self, one_layer_each: bool = False) -> list[list[int]]:
        """The layers whose exchange :meth:`trace_exchange` builds, by group (the layers of
        one group share their collectives), in sending order; called at trace time with the
        step's (symbolic) gradients in the adapter's ``Gradients``. ``one_layer_each``: the
        layers go where a decider's plan says, each in its own branch, so every group must be
        one layer (a transport whose groups only share collectives splits them)."""
        raise NotImplementedError

    def trace_exchange(self, layers: list[tuple[int, list[int]]],
                       reduce: Callable[[str, list], list],
                       plain: Callable[[int, list], list], flags: dict[str, Any],
                       count: Optional[Callable[[int, Any, int], None]] = None
                       ) -> dict[int, list]:
        """Build one group's exchange (:meth:`traced_groups`; ``layers``: its layers in the
        step, each ``(li, ks)``, their gradients in the adapter's ``Gradients``):
        ``reduce(name, tensors)`` averages over ranks (one collective), ``plain(li,
        tensors)`` is a layer's plain exchange (both count what they send); ``flags``:
        ``host_flags()`` as device values; ``count(li, nbytes, collectives)`` records what a
        collective of the transport's own sent for layer ``li`` where it runs (``nbytes`` a
        device scalar where sizes are known at run time only). Returns each layer's
        gradients to apply; what the memory should become waits for :meth:`trace_commit`."""
        raise NotImplementedError(f"{self.name} has no traced exchange")

    def trace_commit(self, ok: Any) -> Optional[list]:
        """Build the step's memory update, once a step (after every exchange): what the
        step's :meth:`trace_exchange` calls computed becomes the memory where ``ok`` (a device
        boolean, the same on every rank: the step was finite everywhere) holds. Returns what
        :meth:`end_traced_step` reads on the host, if anything (device values the host call
        must wait for: it reads them outside the graph's view)."""
        raise NotImplementedError(f"{self.name} has no traced exchange")

    def end_traced_step(self, ok: bool) -> None:
        """Closes a traced step that exchanged through :meth:`trace_exchange`, in place of
        :meth:`end_step` (``ok``: the step was finite on every rank)."""
        raise NotImplementedError(f"{self.name} has no traced exchange")
