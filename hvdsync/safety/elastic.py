"""Horovod Elastic with hvdsync's optimizers, the part both adapters share (docs/elastic.md):
the reset loop of ``hvd.elastic.run``. The adapters (:mod:`hvdsync.torch.elastic`,
:mod:`hvdsync.keras.elastic`) give it their state objects, how to find the hvdsync
optimizers in one, how to start Horovod again and which of their errors mean a lost rank.

An hvdsync optimizer taking part has ``_leave_world()`` (finish or drop every collective it
has in flight: none may outlive the world that started it) and ``_join_world()`` (read the
rank count again). The state's ``sync()`` then makes every rank alike: rank 0's model,
optimizer and shared technique state (``checkpoint.take_shared``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

try:
    from horovod.common.elastic import notification_manager
    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
except ImportError:  # the torch.distributed backend only: no Elastic (docs/backends.md)
    notification_manager = None


def launched() -> bool:
    """Whether ``horovodrun`` started this process in elastic mode: then the setup agreement
    runs in the state's ``sync()``, not at construction (a rank joining a running job builds
    its optimizer while the others wait in ``sync()``, where its collectives would meet
    nobody)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def available() -> bool:
    """Whether Horovod (and so its elastic mode) can be imported here."""
    return notification_manager is not None


def run(func: Callable[..., Any], optimizers_of: Callable[[Any], list],
        restart: Callable[[], None], lost_rank: Callable[[BaseException], bool]
        ) -> Callable[..., Any]:
    """Horovod's ``elastic.run`` for hvdsync: ``func(state, ...)`` runs again whenever the
    ranks change -- from the last commit after a rank was lost (the state restored), from the
    present when ranks were added or removed at a commit. Unlike Horovod's, ``state.sync()``
    runs after every reset, a removal included: a rank that joins while the others wait below
    ``--min-np`` syncs, and so must they, or both sides wait for each other forever
    (horovod#3494). At each reset the state's hvdsync optimizers (``optimizers_of(state)``)
    first finish or drop what they have in flight, then Horovod starts again
    (``restart()``), then they read the new rank count. ``lost_rank(e)``: whether an
    exception other than Horovod's ``HorovodInternalError`` means a rank was lost (a
    framework's own error type for a failed collective)."""

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        optimizers = optimizers_of(state)
        notification_manager.init()
        notification_manager.register_listener(state)
        try:
            while True:
                try:  # a rank lost during the sync is a lost rank too
                    state.sync()
                    return func(state, *args, **kwargs)
                except HorovodInternalError:  # a rank lost mid-step: back to the last commit
                    state.restore()
                except HostsUpdatedInterrupt:  # at a commit: the present state is whole
                    pass
                except Exception as e:
                    if not lost_rank(e):
                        raise
                    state.restore()
                for opt in optimizers:
                    opt._leave_world()
                restart()
                for opt in optimizers:
                    opt._join_world()
                state.on_reset()
        finally:
            notification_manager.remove_listener(state)
    return wrapper
