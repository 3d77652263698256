"""``delay=``'s config (:class:`DelayConfig`, validated; the presets ``"diloco"`` and
``"streaming"``): docs/delay.md says what each field does."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from hvdsync.core.config import coerce_config
from hvdsync.core.wire import CODECS

STATE_MODES = ("local", "average")


#: when a global gradient is folded in (:attr:`DelayConfig.fold`)
FOLD_RULES = ("arrived", "due")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"delay {name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class DelayConfig:
    """Local updates with stale global gradients and/or an outer synchronization every K
    steps (docs/delay.md).

    Args:
        staleness: the most steps a global gradient may lag the step that folds it in
            (``0``: synchronous). Only with ``exchange_gradients``.
        average_every: K -- synchronize the parameters across ranks every this many steps
            (per fragment; ``1`` with ``exchange_gradients``: synchronous). DiLoCo's H.
        optimizer_state: ``"local"`` (each rank keeps its own momentum / moments) or
            ``"average"`` (averaged with the parameters; plain K-step averaging only).
        exchange_gradients: send every step's gradient and fold the stale global gradient
            in. ``False``: a step sends nothing but the outer synchronization (local SGD,
            DiLoCo).
        outer_lr: the outer optimizer's learning rate on the pseudo-gradient (``1`` with
            ``outer_momentum=0``: plain model averaging; DiLoCo: ``0.7``).
        outer_momentum: its momentum (DiLoCo: ``0.9``).
        nesterov: whether that momentum is Nesterov's (DiLoCo: ``True``).
        fragments: the model in this many runs of layers (balanced by bytes), synchronized at
            staggered steps (Streaming DiLoCo); at most one per layer (a model with fewer
            layers gets one fragment per layer).
        overlap: tau -- a fragment's exchange is merged this many steps after it starts; the
            inner steps go on meanwhile (``0``: the step waits for it).
        mix: Streaming DiLoCo's alpha: after the outer update a fragment's parameters become
            ``(1 - mix) * synchronized + mix * local`` (``0``: the synchronized ones).
        compress: the outer exchange's encoding, a name in :data:`hvdsync.core.wire.CODECS`:
            ``"none"``, ``"fp16"``, ``"bf16"`` or ``"int8"`` (a scale per 1024 values).
        error_feedback: what compression lost joins the rank's next pseudo-gradient.
        fold: when a global gradient is folded in (only with ``exchange_gradients``):
            ``"arrived"`` -- as soon as it has arrived on this rank, at the latest when the
            bound makes it due (the fewest stale steps; which step folds it differs between
            ranks and runs); ``"due"`` -- exactly when the bound makes it due, ``staleness``
            steps after its own (the same steps on every rank and every run: what a traced
            step can build, Keras' compiled train function); ``"auto"`` -- ``"due"`` in an
            adapter that traces its step (Keras), else ``"arrived"`` (torch).
    """

    staleness: int = 2
    average_every: int = 8
    optimizer_state: str = "local"
    exchange_gradients: bool = True
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = True
    fragments: int = 1
    overlap: int = 0
    mix: float = 0.0
    compress: str = "none"
    error_feedback: bool = True
    fold: str = "auto"

    def __post_init__(self) -> None:
        _int_at_least("staleness", self.staleness, 0)
        _int_at_least("average_every", self.average_every, 1)
        _int_at_least("fragments", self.fragments, 1)
        _int_at_least("overlap", self.overlap, 0)
        if self.optimizer_state not in STATE_MODES:
            raise ValueError(f"delay optimizer_state must be one of {STATE_MODES}, got "
                             f"{self.optimizer_state!r}")
        for name in ("exchange_gradients", "nesterov", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"delay {name} must be True or False, got "
                                f"{getattr(self, name)!r}")
        _number_in("outer_lr", self.outer_lr, 0.0, None, low_open=True)
        _number_in("outer_momentum", self.outer_momentum, 0.0, 1.0, high_open=True)
        _number_in("mix", self.mix, 0.0, 1.0)
        if self.fold not in ("auto",) + FOLD_RULES:
            raise ValueError(f"delay fold must be one of {('auto',) + FOLD_RULES}, got "
                             f"{self.fold!r}")
        if self.compress not in CODECS:
            raise ValueError(f"delay compress must be one of {tuple(CODECS)}, got "
                             f"{self.compress!r}")
        if self.fragments > self.average_every:
            raise ValueError(f"delay fragments={self.fragments} needs average_every >= "
                             f"fragments (each fragment synchronizes at its own step of the "
                             f"K={self.average_every} cycle)")
        if self.overlap >= self.average_every:
            raise ValueError(f"delay overlap={self.overlap} must be < average_every="
                             f"{self.average_every} (a fragment's exchange is merged before "
                             "its next one starts)")
        if self.outer and self.optimizer_state == "average":
            raise ValueError("delay optimizer_state='average' is for plain K-step averaging; "
                             "the outer synchronization keeps each rank's optimizer state "
                             "(as DiLoCo does)")

    @property
    def outer(self) -> bool:
        """Whether the K-step synchronization runs the outer synchronization
        (:class:`hvdsync.techniques.outer.technique.OuterSync`) rather than plain parameter averaging."""
        return (not self.exchange_gradients or self.outer_lr != 1.0 or self.outer_momentum != 0
                or self.fragments > 1 or self.overlap > 0 or self.compress != "none")

    @property
    def synchronous(self) -> bool:
        """Every step uses its own global gradient: the replicas never diverge."""
        return self.exchange_gradients and (self.staleness == 0 or self.average_every == 1)

    def resolved(self) -> "DelayConfig":
        """This config with ``fold="auto"`` as an eager step runs it: ``"arrived"`` (a traced
        step or the two-level mode has resolved it before: :mod:`hvdsync.core.rules`)."""
        return self if self.fold != "auto" else dataclasses.replace(self, fold="arrived")

    @classmethod
    def diloco(cls, **overrides: Any) -> "DelayConfig":
        """DiLoCo's recipe: local steps only, Nesterov outer SGD (lr 0.7, momentum 0.9)."""
        base = dict(exchange_gradients=False, average_every=32, outer_lr=0.7,
                    outer_momentum=0.9, nesterov=True)
        return cls(**{**base, **overrides})

    @classmethod
    def streaming(cls, **overrides: Any) -> "DelayConfig":
        """hvdsync's recommended local-step preset (docs/delay.md, measured in
        docs/benchmarks.md): DiLoCo streamed in fragments, each exchange overlapping the next
        inner steps, int8 with error feedback."""
        return cls.diloco(**{**STREAMING, **overrides})

    @classmethod
    def coerce(cls, value: Any) -> Optional["DelayConfig"]:
        """``None``, a :class:`DelayConfig`, a dict of its fields, ``True`` (defaults), a
        number meaning ``staleness``, or a preset name: ``"diloco"``, ``"streaming"``."""
        if value is True:
            return cls()
        if value is False:
            return None
        if isinstance(value, str):
            presets = {"diloco": cls.diloco, "streaming": cls.streaming}
            if value not in presets:
                raise ValueError(f"delay preset must be one of {sorted(presets)}, got {value!r}")
            return presets[value]()
        return coerce_config(cls, value, "delay", "staleness")


#: the fields :meth:`DelayConfig.streaming` sets on top of DiLoCo's
STREAMING = dict(average_every=8, fragments=4, overlap=1, mix=0.5, compress="int8")


def _number_in(name: str, value: Any, low: float, high: Optional[float],
               low_open: bool = False, high_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"delay {name} must be a number, got {value!r}")
    bad = value < low or (low_open and value == low) or (
        high is not None and (value > high or (high_open and value == high)))
    if bad:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"delay {name} must be in {lo}{low:g}, "
                         f"{'inf' if high is None else f'{high:g}'}{hi}, got {value!r}")
