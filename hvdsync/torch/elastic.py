"""Horovod Elastic with hvdsync's optimizer: training goes on when ranks are lost or added.

The names are Horovod's (``run``, ``TorchState``, ``ElasticSampler``). What hvdsync adds:
``TorchState`` (Horovod's class; hvdsync registers how it handles hvdsync's optimizer, so
``horovod.torch.elastic.TorchState`` works too) carries each optimizer's technique state --
``commit()`` keeps it with this rank's own memory, a reset restores it, and ``sync()``, after
every reset on every rank, checks every rank is set up alike, then broadcasts rank 0's model,
optimizer and shared technique state (per-rank memory cannot follow a changed world: it is
dropped, with a warning). ``run`` finishes or drops every collective the optimizers have in
flight before Horovod resets, makes them read the new rank count, and syncs after every
reset so ranks removed below ``--min-np`` and added back cannot deadlock (horovod#3494).
docs/elastic.md has the recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hvdsync.safety import elastic as _core

try:
    from horovod.torch.elastic import ElasticSampler, TorchState  # noqa: F401 - Horovod's names
    from horovod.torch.elastic import state as _horovod_state
    from horovod.torch.mpi_ops import init as _init
    from horovod.torch.mpi_ops import shutdown as _shutdown
except ImportError:  # the torch.distributed backend only: no Elastic (docs/backends.md)
    _horovod_state = None


def _optimizers(state: Any) -> list:
    from hvdsync.torch.optimizer import _DistributedOptimizer
    return [v for v in vars(state).values() if isinstance(v, _DistributedOptimizer)]


def _restart() -> None:
    _shutdown()
    _init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``elastic.run``: ``func(state, ...)`` runs again whenever the ranks change
    (:func:`hvdsync.safety.elastic.run`: it syncs after every reset, a removal included, and first
    makes the state's hvdsync optimizers finish or drop what they have in flight). A lost
    rank surfaces in torch as Horovod's ``HorovodInternalError``."""
    require_horovod()
    return _core.run(func, _optimizers, _restart, lost_rank=lambda e: False)


def require_horovod() -> None:
    """Raise, naming the alternative, unless this process runs on Horovod's engine."""
    from hvdsync.torch import engine
    if _horovod_state is None or engine.active_name() != "horovod":
        raise RuntimeError("hvdsync: Horovod Elastic needs Horovod (scripts/install_horovod.sh) "
                           "and horovodrun; on torch.distributed (torchrun) use torchrun "
                           "--max-restarts with checkpoints (docs/elastic.md)")


def install() -> None:
    """Make Horovod's ``TorchState`` handle hvdsync's optimizer with
    :class:`OptimizerHandler` (once; nothing without Horovod)."""
    if _horovod_state is None:
        return
    from hvdsync.torch.optimizer import _DistributedOptimizer
    registry = _horovod_state.get_handler_registry()
    if all(handler is not OptimizerHandler for _, handler in registry):
        _horovod_state.set_handler_registry([(_DistributedOptimizer, OptimizerHandler),
                                             *registry])


if _horovod_state is not None:
    class OptimizerHandler(_horovod_state.OptimizerStateHandler):
        """How ``TorchState`` commits, restores and syncs an hvdsync optimizer: save and
        restore are Horovod's (``state_dict()`` holds the technique state); ``sync()`` reads
        the rank count, checks every rank is set up alike and broadcasts rank 0's optimizer
        and shared technique state (hvdsync's ``broadcast_optimizer_state``)."""

        def sync(self) -> None:
            from hvdsync.torch import broadcast_optimizer_state
            opt = self.value
            opt._join_world()  # (run() did; Horovod's own run, if a script uses it, did not)
            if opt.process_set.included():
                opt._agree()
            broadcast_optimizer_state(opt, root_rank=0)
