"""Technique 2: overlap compute with communication -- update with the local gradient at once,
fold in the global (averaged) gradient when it arrives, average the models every K steps.

Step ``t`` of every rank:

1. backward starts the allreduce of the local gradient ``g_t`` layer by layer, in the
   background (the same collectives on every rank, whatever each one's timing);
2. the update does not wait for it. It uses ``d_t = g_t + sum_j (G_j - g_j)`` over the global
   gradients ``G_j`` (``j <= t``) that have arrived on this rank and were not used yet,
   newest first: each arrived global gradient *replaces* its step's local contribution, so
   every global gradient is used exactly once. If ``G_t`` itself has arrived, ``d_t = G_t +
   ...``: a step whose own reduction is back in time is a synchronous step;
3. a global gradient may lag the step that folds it in by at most ``staleness`` steps: a step
   waits for the ones that would exceed the bound (``staleness=0``: every step waits for its
   own, i.e. synchronous training, equal to Horovod);
4. every ``average_every``-th step (K) waits for every outstanding global gradient, folds them
   in, steps, and then averages the parameters across ranks with one allreduce per layer.

Which global gradients have arrived differs between ranks; it only decides what is *added
locally*, never which collectives run (DESIGN.md's rule): the gradient allreduce runs every
step and the parameter averaging on the step counter, identically on every rank.

Why replicas stay close: for plain SGD every rank's parameters are ``theta_0 - lr * (sum of
folded G_j + sum of its own unfolded g_j)``, so after a drain (step 4) they are identical even
before averaging; momentum and Adam apply the corrections at a later step than a synchronous
run would, which is the drift the periodic averaging removes. ``average_every=1`` drains every
step, so like ``staleness=0`` it is synchronous training (and needs no parameter averaging).

Optimizer state (momentum buffers, Adam moments): ``optimizer_state="local"`` (default) keeps
each rank's own -- it is built from the same global gradients, only folded in at different
steps, and averaging it would cost one more model-sized allreduce per moment every K steps;
``"average"`` averages every floating-point state tensor shaped like its parameter together
with the parameters, so after an averaging step the replicas are identical, state included.
Scalar state (Adam's step count) is the same on every rank either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hvdsync.config import coerce_config
from hvdsync.stats import SyncStats

STATE_MODES = ("local", "average")


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"delay {name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class DelayConfig:
    """Local updates with stale global gradients; see the module docstring.

    Args:
        staleness: the most steps a global gradient may lag the step that folds it in
            (``0``: synchronous).
        average_every: average the parameters across ranks every this many steps (K), after
            waiting for every outstanding global gradient (``1``: synchronous).
        optimizer_state: ``"local"`` (each rank keeps its own momentum / moments) or
            ``"average"`` (averaged with the parameters).
    """

    staleness: int = 2
    average_every: int = 8
    optimizer_state: str = "local"

    def __post_init__(self) -> None:
        _int_at_least("staleness", self.staleness, 0)
        _int_at_least("average_every", self.average_every, 1)
        if self.optimizer_state not in STATE_MODES:
            raise ValueError(f"delay optimizer_state must be one of {STATE_MODES}, got "
                             f"{self.optimizer_state!r}")

    @property
    def synchronous(self) -> bool:
        """Every step uses its own global gradient: the replicas never diverge."""
        return self.staleness == 0 or self.average_every == 1

    @classmethod
    def coerce(cls, value: Any) -> Optional["DelayConfig"]:
        """``None``, a :class:`DelayConfig`, a dict of its fields, ``True`` (defaults), or a
        number meaning ``staleness``."""
        if value is True:
            return cls()
        if value is False:
            return None
        return coerce_config(cls, value, "delay", "staleness")


class DelayPolicy:
    """Which outstanding global gradients a step must wait for, which it folds in, and when
    the parameters are averaged. Global gradients are named by the step that produced them
    (1, 2, ...), so ids and the schedule are identical on every rank; only ``ready`` differs.
    """

    def __init__(self, config: DelayConfig, stats: SyncStats):
        self.config = config
        self.stats = stats
        self.step = 0  # finished steps
        #: ids folded in by the last step (newest first), for logging and tests
        self.last_folded: list[int] = []

    @property
    def current(self) -> int:
        """Id of the step in progress (its gradient's allreduce is started under this id)."""
        return self.step + 1

    def averages_now(self) -> bool:
        """Whether the step in progress drains and then averages the parameters."""
        c = self.config
        return not c.synchronous and self.current % c.average_every == 0

    def plan(self, outstanding: list[int], ready: set[int]) -> tuple[list[int], list[int]]:
        """For the step in progress: ``(wait_for, fold)`` -- the outstanding ids that are not
        ready but must be waited for (the staleness bound, or a drain), and every id to fold
        in, newest first."""
        t = self.current
        drain = self.config.synchronous or self.averages_now()
        must = {j for j in outstanding if drain or t - j >= self.config.staleness}
        wait_for = sorted(j for j in must if j not in ready)
        fold = sorted(must | (set(outstanding) & ready), reverse=True)
        return wait_for, fold

    def finish_step(self, folded: list[int], waited_s: Optional[float],
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
