"""``delay=``'s K-step synchronization by plain averaging (post-local SGD): :class:`Averaging`,
and what both synchronizations save of a rank's own replica (:func:`rank_values`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from hvdsync.core.ports import Communicator, Gradients, TensorOps
from hvdsync.core.stats import SyncStats
from hvdsync.core.technique import SYNC, Technique


class Averaging(Technique):
    """Plain K-step averaging of the parameters (and, with ``optimizer_state="average"``, of
    the optimizer state shaped like them) after the update of every K-th step."""

    name = "outer"
    keyword = "delay"
    role = SYNC
    traceable = True
    scale_sensitive = False  # it reads parameters, never gradients

    def beside_join(self, by_name: bool) -> Optional[str]:
        return ("the parameter averaging averages every rank's parameters, and a rank in "
                "hvd.join() would enter the average as if it had trained")

    def __init__(self, config: Any, grads: Gradients, ops: TensorOps, comm: Communicator,
                 layer_names: list[str], stats: SyncStats, finished_steps: Callable[[], int]):
        self.config, self.grads, self.ops, self.comm = config, grads, ops, comm
        self.layer_names, self.stats, self.finished_steps = layer_names, stats, finished_steps
        #: each rank keeps its own optimizer state: saved with its parameters (``local``)
        self.per_rank = ("local",) if config.optimizer_state == "local" else ()
        self._due = False  # this step averages after its update

    def before_optimizer_step(self) -> None:
        """Whether the step just finished (its schedule counted) averages after its
        update."""
        self._due = self.finished_steps() % self.config.average_every == 0
        if self._due:
            self.stats.count("averaged")
            self.stats.control(*self._size())

    def after_optimizer_step(self) -> None:
        if self._due:
            self._due = False
            self.comm.average(self._averaged())

    def flush_replicas(self) -> int:
        """Average the replicas now, unless the last step just did."""
        if self.finished_steps() % self.config.average_every == 0:
            return 0
        self.stats.control(*self._size())
        self.comm.average(self._averaged())
        return 0

    def _averaged(self) -> list[tuple[str, list]]:
        """Per layer and dtype, what is averaged: the parameters, then (``"average"``) their
        optimizer state shaped like them, in a fixed order."""
        groups = []
        with_state = self.config.optimizer_state == "average"
        for li, name in enumerate(self.layer_names):
            by_dtype: dict[str, list] = {}
            for x in self.grads.replica_tensors(li, with_state):
                by_dtype.setdefault(self.ops.dtype_key(x), []).append(x)
            groups += [(f"hvdsync.average.{name}.{d}", xs) for d, xs in by_dtype.items()]
        return groups

    def _size(self) -> tuple[int, int]:
        """Bytes and collectives of one averaging."""
        if self.comm.size == 1:
            return 0, 0
        groups = self._averaged()
        return sum(self.ops.nbytes(x) for _, xs in groups for x in xs), len(groups)

    def state_dict(self) -> dict:
        """Per rank, where each rank keeps its own optimizer state: its parameters and that
        state (``local``)."""
        return {"local": rank_values(self.grads, len(self.layer_names))} if self.per_rank else {}

    def load_state_dict(self, state: dict) -> None:
        self._due = False
        if "local" in state:
            restore_rank_values(self.grads, self.ops, len(self.layer_names), state["local"])

    def discard(self) -> int:
        """An averaging due after this step's update is called off (a restore, or the world
        changes)."""
        self._due = False
        return 0

    def forget(self) -> None:
        self._due = False

    def drop_per_rank(self) -> None:
        """Nothing to drop: ``local`` is the parameters as they are."""


def rank_values(g: Gradients, layers: int) -> dict:
    """This rank's parameters and the optimizer state shaped like them, per layer, to save:
    they differ between ranks while a checkpoint's model and optimizer state are one rank's."""
    out = {}
    for li in range(layers):
        key = g.param_keys(li)[0]
        out[key] = [g.to_saved(key, x) for x in g.replica_tensors(li, True)]
    return out


def restore_rank_values(g: Gradients, ops: TensorOps, layers: int, saved: dict) -> None:
    """Put back what :func:`rank_values` saved on this rank, where it was saved."""
    for li in range(layers):
        key = g.param_keys(li)[0]
        values = saved.get(key)
        targets = g.replica_tensors(li, True)
        if values is not None and len(values) == len(targets):
            for x, v in zip(targets, values):
                ops.assign(x, g.from_saved(key, v))
