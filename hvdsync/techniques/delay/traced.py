"""``delay=``'s traced step (Keras' compiled train function): the eager step's arithmetic in
the order a graph can run it. Step ``t`` exchanges ``g_{t-1}`` beside its own backward into
the correction ``G_{t-1} - g_{t-1}``, due ``staleness`` steps later; a drain exchanges ``G_t``
in the step. :class:`TracedDelay` is what a Delay composes for it (``delay.traced``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional


class TracedDelay:
    """The traced form of :class:`hvdsync.techniques.delay.technique.Delay`, a step that
    updates locally (:data:`hvdsync.core.rules.UPDATES_LOCALLY`): a tracing
    adapter builds :meth:`trace_local` in place of ``layer_ready``/``start``/``send_rest``,
    counts what it sends with :meth:`traced_traffic`, and calls :meth:`end_local_step` on the
    host in place of ``end_step``. On its owner's state, memory and ``_zeroed`` /
    ``_count_nonfinite``, which the eager step uses too. delay= is the only technique whose step
    updates locally, so this shape is declared here rather than in the core."""

    def __init__(self, owner: Any):
        self.owner = owner
        #: whether its steps exchange anything (``False``: local steps, which send nothing
        #: until the synchronization after an update)
        self.sends_in_step = owner.config.exchange_gradients

    def trace_local(self, layers: list[tuple[int, list[int], list]],
                    reduce: Callable[[int, str, list], list], flags: dict[str, Any]
                    ) -> tuple[list[list], Any]:
        """A traced step (the eager step's arithmetic, in the order a graph can run it):
        each layer's gradients to apply, and a device count of the non-finite local
        gradients replaced by zeros (per layer exchanging, else one check for the step: the
        eager step's count). Local steps: this rank's gradients. Exchanging: step ``t``
        exchanges ``g_{t-1}`` (kept from the last step: the collective needs nothing of this
        step, so it runs beside its backward) into the correction ``G_{t-1} - g_{t-1}``,
        due ``staleness`` steps after ``t-1``; the update is ``g_t`` plus the correction due
        now -- on a drain ``G_t`` (exchanged in the step) plus every correction held.
        ``reduce(li, name, tensors)`` gives their average over ranks (layer ``li``'s)."""
        ops = self.owner.ops
        if not self.owner.config.exchange_gradients:
            flat = [x for _, _, xs in layers for x in xs]
            zeroed, bad = self.owner._zeroed(flat)
            it = iter(zeroed)
            return [[next(it) for _ in xs] for _, _, xs in layers], bad
        if not layers:
            return [], ops.zero()
        bads = [ops.bad(xs) for _, _, xs in layers]  # per layer, as the eager step counts
        bad = sum(bads[1:], bads[0])
        # one branch for the step: a non-finite layer is rare, its zeros cost the others nothing
        checked = ops.cond(bad > 0, lambda: [ops.zero_if(b, xs) for b, (_, _, xs)
                                             in zip(bads, layers)],
                           lambda: [list(xs) for _, _, xs in layers])
        layers = [(li, ks, xs) for (li, ks, _), xs in zip(layers, checked)]
        return self._fold_traced(layers, reduce, flags), bad

    def _fold_traced(self, layers: list[tuple[int, list[int], list]],
                     reduce: Callable[[int, str, list], list], flags: dict[str, Any]
                     ) -> list[list]:
        ops = self.owner.ops
        keys = [[self.owner.grads.key(li, k) for k in ks] for li, ks, _ in layers]
        memory = self.owner._memory
        held = (None if self.owner.config.synchronous
                else [[memory["held"].read(key) for key in ks] for ks in keys])
        exchanges = (self._exchanges_traced if self.owner.compressor is None
                     else self.owner.compressor.trace_in_delay)
        late, own = exchanges([(li, ks) for li, ks, _ in layers], held,
                              [xs for _, _, xs in layers], reduce, flags)
        if held is None:  # synchronous: each step folds its own
            return own
        # per layer, due[i]: the correction due i steps from now (just exchanged: staleness-1)
        due = [[[memory[f"due{i}"].read(key) for key in ks]
                for i in range(1, self.owner.config.staleness)] + [new]
               for ks, new in zip(keys, late)]

        def drain() -> tuple[list, list]:
            totals, emptied = [], []
            for (li, _, xs), total, corrections in zip(layers, own, due):
                for correction in corrections:
                    total = [ops.add(a, b) for a, b in zip(total, correction)]
                totals.append(total)
                emptied.append([[ops.zeros_like(x) for x in xs] for _ in corrections[1:]])
            return totals, emptied

        def step() -> tuple[list, list]:
            return ([[ops.add(x, c) for x, c in zip(xs, corrections[0])]
                     for (_, _, xs), corrections in zip(layers, due)],
                    [corrections[1:] for corrections in due])
        updates, later = ops.cond(flags["drain"], drain, step)
        for ks, (_, _, xs), rest in zip(keys, layers, later):
            for key, x in zip(ks, xs):  # (read after a drain only where this step was none)
                memory["held"].write(key, x, True)
            for i, corrections in enumerate(rest, start=1):
                for key, x in zip(ks, corrections):
                    memory[f"due{i}"].write(key, x, True)
        return updates

    def _exchanges_traced(self, layers: list[tuple[int, list[int]]],
                          held: Optional[list[list]], own: list[list],
                          reduce: Callable[[int, str, list], list], flags: dict[str, Any]
                          ) -> tuple[list[list], list[list]]:
        """A traced step's exchanges (plain; ``lowrank=``'s are
        :meth:`hvdsync.techniques.lowrank.in_delay.LowRankInDelay.trace_in_delay`): per layer the correction
        ``G - g`` of the ``held`` gradients (the last step's: zeros unless
        ``flags["exchange_held"]``; ``None``: synchronous, none) and the average of ``own``
        (this step's: zeros unless ``flags["drain"]``; synchronous: always). One branch for
        every layer, not one per layer: a branch costs the step its own dispatch, and these
        run at the step's start (the exchange) or after backward."""
        ops = self.owner.ops
        names = [f"hvdsync.{self.owner.layer_names[li]}.delay" for li, _ in layers]

        def averages(which: str, tensors: list[list]) -> list[list]:
            return [reduce(li, f"{name}.{which}", xs)
                    for (li, _), name, xs in zip(layers, names, tensors)]

        def zeros(tensors: list[list]) -> list[list]:
            return [[ops.zeros_like(x) for x in xs] for xs in tensors]
        if held is None:
            return [], averages("own", own)
        late = ops.cond(flags["exchange_held"], lambda: [
            [ops.accumulate(G, h, sign=-1) for G, h in zip(avg, hs)]
            for avg, hs in zip(averages("held", held), held)], lambda: zeros(held))
        return late, ops.cond(flags["drain"], lambda: averages("own", own), lambda: zeros(own))

    def traced_traffic(self, li: int, tensors: list, wire_bytes: Callable[[Any], int],
                       flags: dict[str, Any]) -> Optional[tuple[Any, Any]]:
        """Counted at the gradient's step, as the eager step counts it: ``lowrank=``'s
        figures, or ``None`` (the plain exchange's)."""
        if self.owner.compressor is None:
            return None
        return self.owner.compressor.delay_traffic(li, tensors, wire_bytes, flags["own_compressed"])

    def end_local_step(self, bad: int) -> None:
        """Closes the traced step, on the host after its update: ``bad``, the count that
        :meth:`trace_local` built."""
        self.owner._bad = 0
        self.owner._count_nonfinite(int(bad))
        if self.owner.compressor is not None:  # (it closes its step as in the eager one)
            self.owner.compressor.end_step(True)
