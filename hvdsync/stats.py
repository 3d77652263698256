"""Per-step and cumulative communication statistics, shared by every adapter.

``bytes_sent`` is the payload this rank handed to collectives (after compression), the
number Horovod users reason about. ``bytes_dense`` is what plain Horovod would have handed
over for the same step (every gradient, uncompressed), so ``bytes_sent / bytes_dense`` is the
fraction of traffic left. What the wire carries depends on the algorithm: a ring allreduce of
S bytes moves about 2(N-1)/N * S per rank.

Techniques add their own named counters with :meth:`SyncStats.count` (e.g. ``clipped``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LayerCounters:
    """Cumulative per-layer counts: steps the layer was sent, skipped, and bytes sent."""

    sent: int = 0
    skipped: int = 0
    bytes_sent: int = 0


@dataclass
class StepRecord:
    """What one optimizer step communicated."""

    step: int = 0
    bytes_sent: int = 0
    bytes_dense: int = 0
    collectives: int = 0
    layers_sent: int = 0
    layers_skipped: int = 0
    counters: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "counters"}
        d.update(self.counters)
        return d


class SyncStats:
    """Counters for one wrapped optimizer on one rank.

    ``last`` is the most recent finished step, ``total`` sums every finished step (its
    ``step`` field is the number of steps), ``layers`` maps layer name to
    :class:`LayerCounters`; ``backend`` names the engine that moves the bytes (``"horovod"``
    or ``"torch"``: torch.distributed).
    """

    def __init__(self, layer_names: Sequence[str], backend: str = "horovod"):
        self.backend = backend
        self.layers: dict[str, LayerCounters] = {n: LayerCounters() for n in layer_names}
        self.total = StepRecord()
        self.last = StepRecord()
        self._current = StepRecord(step=1)

    # -- recording (called by adapters during a step) ---------------------------------------
    def sent(self, layer: str, nbytes: int, collectives: int = 1) -> None:
        """Layer ``layer`` was sent this step as ``nbytes`` payload in ``collectives`` calls."""
        c = self._current
        c.bytes_sent += nbytes
        c.collectives += collectives
        c.layers_sent += 1
        lc = self.layers[layer]
        lc.sent += 1
        lc.bytes_sent += nbytes

    def skipped(self, layer: str) -> None:
        """Layer ``layer`` was not sent this step."""
        self._current.layers_skipped += 1
        self.layers[layer].skipped += 1

    def dense(self, nbytes: int) -> None:
        """Plain Horovod would have sent ``nbytes`` more this step."""
        self._current.bytes_dense += nbytes

    def control(self, nbytes: int, collectives: int = 1) -> None:
        """A control-plane collective (statistics shared between ranks) of ``nbytes``
        (``collectives=0`` when it rides along in another collective)."""
        self._current.bytes_sent += nbytes
        self._current.collectives += collectives

    def count(self, name: str, value: float = 1) -> None:
        """Add ``value`` to the technique counter ``name`` for this step."""
        self._current.counters[name] = self._current.counters.get(name, 0) + value

    def end_step(self) -> StepRecord:
        """Close the current step: fold it into ``total`` and make it ``last``."""
        c = self._current
        t = self.total
        t.step += 1
        t.bytes_sent += c.bytes_sent
        t.bytes_dense += c.bytes_dense
        t.collectives += c.collectives
        t.layers_sent += c.layers_sent
        t.layers_skipped += c.layers_skipped
        for k, v in c.counters.items():
            t.counters[k] = t.counters.get(k, 0) + v
        self.last = c
        self._current = StepRecord(step=c.step + 1)
        return c

    # -- reading ----------------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        """Plain-data snapshot (JSON-serializable)."""
        return {
            "backend": self.backend,
            "last": self.last.as_dict(),
            "total": self.total.as_dict(),
            "layers": {k: dict(v.__dict__) for k, v in self.layers.items()},
        }

    def summary(self, max_layers: int = 20) -> str:
        """A human-readable table of totals and per-layer counts."""
        t = self.total
        steps = max(t.step, 1)
        ratio = f"{t.bytes_sent / t.bytes_dense:.3f}" if t.bytes_dense else "n/a"
        lines = [
            f"hvdsync ({self.backend}): {t.step} steps, {human_bytes(t.bytes_sent)} sent "
            f"({human_bytes(t.bytes_sent / steps)}/step, {ratio} of dense), "
            f"{t.collectives / steps:.1f} collectives/step, "
            f"layers sent {t.layers_sent} / skipped {t.layers_skipped}",
        ]
        if t.counters:
            lines.append("  counters: " + ", ".join(f"{k}={v:g}" for k, v in t.counters.items()))
        width = max((len(n) for n in self.layers), default=5)
        lines.append(f"  {'layer':<{width}}  {'sent':>6}  {'skipped':>7}  {'bytes':>9}")
        for name, lc in list(self.layers.items())[:max_layers]:
            lines.append(f"  {name:<{width}}  {lc.sent:>6}  {lc.skipped:>7}  "
                         f"{human_bytes(lc.bytes_sent):>9}")
        if len(self.layers) > max_layers:
            lines.append(f"  ... {len(self.layers) - max_layers} more layers")
        return "\n".join(lines)


def human_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ``3.2 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
