"""Per-step and cumulative communication statistics, shared by every adapter.

``bytes_sent`` is the payload this rank handed to collectives (after compression), the
number Horovod users reason about. ``bytes_dense`` is what plain Horovod would have handed
over for the same step (every gradient, uncompressed), so ``bytes_sent / bytes_dense`` is the
fraction of traffic left. What the wire carries depends on the algorithm: a ring allreduce of
S bytes moves about 2(N-1)/N * S per rank.

Techniques add their own named counters with :meth:`SyncStats.count` (e.g. ``clipped``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
        #: the techniques' keywords on and the ranks, for :meth:`summary` (:meth:`describe`)
        self.techniques: list[str] = []
        #: how the ranks are laid out in nodes with ``between="nodes"`` ("": flat)
        self.levels = ""
        self._world_size: Callable[[], int] = lambda: 1
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

    def end_step(self, dense: int = 0, sent: Sequence[tuple[str, int, int]] = (),
                 skipped: Sequence[str] = ()) -> StepRecord:
        """Close the current step: fold it into ``total`` and make it ``last``. The step
        pipeline hands over what it recorded as it went (:meth:`dense`, and per layer
        :meth:`sent` as ``(layer, bytes, collectives)`` and :meth:`skipped`) in this one
        call."""
        if dense:
            self.dense(dense)
        for layer, nbytes, collectives in sent:
            self.sent(layer, nbytes, collectives)
        for layer in skipped:
            self.skipped(layer)
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

    def describe(self, techniques: Sequence[str], world_size: Callable[[], int]) -> None:
        """What :meth:`summary` names: the techniques on (their keywords) and the ranks now."""
        self.techniques = list(techniques)
        self._world_size = world_size

    def summary(self, max_layers: int = 20) -> str:
        """A table for people: what ran, what was sent against plain Horovod's dense bytes,
        ``delay=``'s local steps and synchronizations, every counter with what it means, and
        the layers."""
        t, size = self.total, self._world_size()
        steps = max(t.step, 1)
        on = ", ".join(f"{name}=" for name in self.techniques) or "nothing (plain averaging)"
        rows = [("steps", f"{t.step}")]
        dense = f"plain Horovod's {human_bytes(t.bytes_dense)} (dense, uncompressed)"
        if size == 1:
            rows.append(("bytes sent", f"nothing exchanged on one rank; {dense}"))
        else:
            ratio = f" = {t.bytes_sent / t.bytes_dense:.3f} of" if t.bytes_dense else ", against"
            rows += [("bytes sent", f"{human_bytes(t.bytes_sent)} "
                                    f"({human_bytes(t.bytes_sent / steps)} a step){ratio} {dense}"),
                     ("collectives", f"{t.collectives / steps:.1f} a step")]
        if t.layers_sent or t.layers_skipped:
            rows.append(("layers", f"sent {t.layers_sent}, kept back {t.layers_skipped} "
                                   "(layer-steps)"))
        if "delay" in self.techniques:
            rows.append(("delay=", _delay_line(t)))
        lines = [f"hvdsync on {self.backend}, {size} rank{'s' * (size != 1)}; techniques: {on}"]
        if self.levels:
            lines.append(self.levels)
            inside = t.counters.get("bytes_intra_node", 0)
            rows.insert(2, ("inside the node", f"{human_bytes(inside / steps)} a step, full "
                                               "precision ('bytes sent': between nodes)"))
        lines += _aligned(rows, right=())
        if t.counters:
            lines.append("counters (this rank, every step):")
            lines += _aligned([(k, f"{v:g}", meaning(k)) for k, v in sorted(t.counters.items())])
        lines.append("per layer:")
        lines += _aligned([("layer", "sent", "kept back", "bytes sent")] + [
            (name, f"{lc.sent}", f"{lc.skipped}", human_bytes(lc.bytes_sent))
            for name, lc in list(self.layers.items())[:max_layers]], right=(1, 2, 3))
        if len(self.layers) > max_layers:
            lines.append(f"  ... {len(self.layers) - max_layers} more layers")
        return "\n".join(lines)


#: what each technique counter counts (``staleness_<n>``: see :func:`meaning`)
COUNTERS = {
    "clipped": "layers whose gradient norm was above clip='s limit (scaled down)",
    "nonfinite": "layers with a NaN/Inf gradient on this rank",
    "nonfinite_steps": "steps skipped on every rank: a NaN/Inf gradient on some rank",
    "ready_groups": "groups of layers clipped, measured and sent together (group_mb)",
    "residual_norm": "select=: norm of what this rank's kept-back layers hold, summed",
    "sparse_gather": "sparse gradients sent as their rows (grouped allgather)",
    "sparse_dense": "sparse gradients sent dense (fewer bytes than their rows)",
    "sparse_none": "sparse gradients with no row on any rank (nothing sent)",
    "sparse_gather_equal": "row gathers whose counts were equal on every rank",
    "sparse_duplicate_rows": "rows summed locally before sending (repeated lookups)",
    "averaged": "delay=: parameter averagings across ranks",
    "waited": "delay=: steps that waited for a global gradient",
    "wait_s": "delay=: seconds those waits took",
    "outstanding": "delay=: global gradients still in flight, summed over steps",
    "discarded": "delay=: global gradients dropped (a reset, a rank that joined)",
    "outer_started": "delay=: outer synchronizations started",
    "outer_merged": "delay=: outer synchronizations merged into the model",
    "outer_bytes": "delay=: bytes those outer synchronizations sent",
    "outer_nonfinite": "delay=: outer synchronizations dropped for a NaN/Inf",
    "entry_tags": "checks that every rank is in the same call (a step, flush, save)",
    "bytes_intra_node": "between='nodes': bytes reduced inside the node (full precision)",
}


def meaning(counter: str) -> str:
    """What ``counter`` counts, for people."""
    if counter.startswith("staleness_"):
        return f"delay=: global gradients applied {counter[len('staleness_'):]} steps late"
    return COUNTERS.get(counter, "")


def _delay_line(t: StepRecord) -> str:
    c = t.counters
    parts = [f"{t.step} local steps"]
    if c.get("averaged"):
        parts.append(f"{c['averaged']:g} parameter averagings")
    if c.get("outer_started"):
        parts.append(f"{c['outer_started']:g} outer synchronizations "
                     f"({c.get('outer_merged', 0):g} merged)")
    return ", ".join(parts)


def _aligned(rows: Sequence[tuple[str, ...]], right: tuple[int, ...] = (1,)) -> list[str]:
    """Rows as indented columns: each as wide as its widest cell; ``right``-aligned columns
    (numbers) but the last, which runs on."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        if len(r) > 1 and (len(r) - 1) not in right:
            cells[-1] = r[-1]  # (the last column runs on: no padding)
        out.append(("  " + "  ".join(cells)).rstrip())
    return out


def human_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ``3.2 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
