"""``delay=``'s config (:class:`DelayConfig`, validated) and policy (:class:`DelayPolicy`):
which outstanding global gradients a step waits for and folds in, and when the models
synchronize -- decisions on step ids every rank shares. docs/delay.md says what each field
does."""

from __future__ import annotations

from typing import Optional

from hvdsync.techniques.outer.sync import start_offsets
from hvdsync.core.stats import SyncStats
from hvdsync.techniques.delay.config import DelayConfig


class DelayPolicy:
    """Which outstanding global gradients a step must wait for, which it folds in, and when
    the parameters are averaged. Global gradients are named by the step that produced them
    (1, 2, ...), so ids and the schedule are identical on every rank; only ``ready`` differs.
    """

    def __init__(self, config: DelayConfig, stats: SyncStats):
        self.config = config
        self.stats = stats
        self.step = 0  # finished steps
        self._offsets = set(start_offsets(config.average_every, config.fragments))
        #: ids folded in by the last step (newest first), for logging and tests
        self.last_folded: list[int] = []
        #: ids the last step had to wait for (not arrived, but due: bound or drain)
        self.last_waited: list[int] = []

    @property
    def current(self) -> int:
        """Id of the step in progress (its gradient's allreduce is started under this id)."""
        return self.step + 1

    def averages_now(self) -> bool:
        """Whether the step in progress drains and then synchronizes the parameters (of a
        fragment, with ``fragments > 1``)."""
        c = self.config
        return not c.synchronous and self.current % c.average_every in self._offsets

    def plan(self, outstanding: list[int], ready: set[int]) -> tuple[list[int], list[int]]:
        """For the step in progress: ``(wait_for, fold)`` -- the outstanding ids that are not
        ready but must be waited for (the staleness bound, or a drain), and every id to fold
        in, newest first."""
        t = self.current
        drain = self.config.synchronous or self.averages_now()
        must = {j for j in outstanding if drain or t - j >= self.config.staleness}
        wait_for = sorted(j for j in must if j not in ready)
        arrived = set() if self.config.fold == "due" else set(outstanding) & ready
        fold = sorted(must | arrived, reverse=True)
        return wait_for, fold

    def finish_step(self, folded: list[int], waited_s: Optional[float],
                    waited_for: list[int],
                    still_outstanding: int) -> None:
        """Record the step: the staleness of each folded gradient, whether (and how long) it
        waited, and how many global gradients remain in flight."""
        t = self.current
        for j in folded:
            self.stats.count(f"staleness_{t - j}")
        if waited_s is not None:
            self.stats.count("waited")
            self.stats.count("wait_s", waited_s)
        self.stats.count("outstanding", still_outstanding)
        self.last_folded = list(folded)
        self.last_waited = list(waited_for)
        self.step += 1

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def staleness_histogram(counters: dict[str, float]) -> dict[int, int]:
    """``{lag in steps: global gradients folded with that lag}`` from a stats counter dict
    (e.g. ``opt.stats.total.counters``)."""
    hist = {int(k[len("staleness_"):]): int(v) for k, v in counters.items()
            if k.startswith("staleness_")}
    return dict(sorted(hist.items()))

