"""``hvd.join()`` beside hvdsync's optimizer: a rank out of data takes part in the others' steps
with zero gradients, as Horovod's joined rank does in its optimizer's allreduces, and every
replica is the same once ``join`` returns (docs/backends.md, "join").

* torch.distributed (c10d pairs by order): the joined rank's loop
  (:mod:`hvdsync.torch.c10d.joining`) meets each step's entry tag and runs that step of the
  optimizer with zero gradients (``_DistributedOptimizer._step_joined``): every collective,
  the techniques' decisions (taken from averages every rank shares) and the update.
* Horovod (pairs by name): Horovod's own join answers every allreduce of a step with zeros and
  runs no Python, so the joined rank's replica and state stay where it joined.

When ``join`` returns after uneven data, every rank takes the last-joined rank's parameters,
optimizer state and shared technique state (:func:`_catch_up`; per-rank memory is dropped,
warned).
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Optional

import torch

from hvdsync.safety.watchdog import guard
from hvdsync.torch import engine
from hvdsync.torch.saving import broadcast_optimizer_state

#: hvdsync's optimizers in this process, in the order they were made (alike on every rank)
_OPTIMIZERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_made = 0


def register(optimizer: Any) -> None:
    """``optimizer`` (hvdsync's) takes part in steps while a rank is in ``hvd.join()``."""
    global _made
    _made += 1
    _OPTIMIZERS[_made] = optimizer


def refusal(techniques: list, process_set: Any, two_levels: bool, by_name: bool
            ) -> Optional[str]:
    """Why a step of an optimizer with ``techniques`` cannot go on beside a rank in
    ``hvd.join()`` (``by_name``: Horovod's engine), or ``None``."""
    if two_levels:
        return "between='nodes' reduces inside each node first, which hvd.join() does not answer"
    if process_set.size() != engine.ops().size():
        return "hvd.join() joins every rank, this optimizer synchronizes a process set"
    return next((why for why in (t.beside_join(by_name) for t in techniques) if why), None)


def join(device: int = -1) -> int:
    """Horovod's ``hvd.join()``: this rank is out of data; it takes part in the others'
    collectives until every rank has joined, and returns the rank that joined last. With
    hvdsync's ``DistributedOptimizer``, the others' steps go on (this rank takes part with
    zero gradients), and when it returns after uneven data every rank holds the last-joined
    rank's parameters, optimizer state and shared technique state (docs/backends.md,
    ``join``; ``delay=`` and ``between="nodes"`` refuse, and ``sparse=`` on Horovod).
    ``device``: Horovod's, unused on CPU."""
    ops = engine.ops()
    torch_engine = engine.active_name() == "torch"
    if torch_engine:
        last = ops.join(device, step_with=_step_with)
    else:
        _wait_for_started(ops)
        last = ops.join(device)
    for _, optimizer in sorted(_OPTIMIZERS.items()):
        if optimizer._closed is None:
            _catch_up(optimizer, last, torch_engine)
    return last


def _wait_for_started(ops: Any) -> None:
    """Horovod: wait until every collective this process started has completed. Horovod
    counts a collective ready once every rank not joined has started it, so one this rank
    started and then joined with would reach a rank that has not started it yet, and Horovod
    0.28 crashes there (a segmentation fault: a response for a name it does not hold). Such a
    collective is a later step's on the others (``delay=``'s global gradient in flight, a
    script's own ``_async`` call); it completes once they start it. Polled, not synchronized:
    its owner still reads its result."""
    from horovod.torch import mpi_ops
    started = list(mpi_ops._handle_map)  # (Horovod's handles not yet synchronized)
    with guard("hvd.join(): this rank's collectives in flight"):
        for handle in started:
            while not ops.poll(handle):
                time.sleep(0.001)


def _step_with(identity: int, step: int) -> bool:
    """The torch engine's joined rank meets step ``step`` of the optimizer whose tags are
    ``identity``: take it with zero gradients (``False``: no such optimizer here)."""
    for _, optimizer in sorted(_OPTIMIZERS.items(), reverse=True):  # the newest first
        entries = optimizer._comm.entries
        if (entries.identity() == identity and entries.beside_join is None
                and optimizer._closed is None):
            optimizer._step_joined(step)
            return True
    return False


def _catch_up(optimizer: Any, last: int, torch_engine: bool) -> None:
    """After the join, on every rank: where some rank took steps without data of its own,
    every rank takes the rank ``last``'s parameters, optimizer state and shared technique
    state (per-rank memory is dropped, warned: a held-back layer's local steps and sync point
    are a rank's own). A joined rank is behind there: on Horovod it ran none of the steps,
    on the torch engine it stepped with a learning rate the script's schedule left behind.
    Every rank starts its entry tags afresh (on Horovod a joined rank sent none meanwhile,
    and their names follow the count)."""
    ops, entries = engine.ops(), optimizer._comm.entries
    entries.reset()
    if entries.beside_join is not None or optimizer.process_set.size() == 1:
        return
    steps, joined_steps = optimizer.stats.total.step, optimizer._steps_joined
    optimizer._steps_joined = 0
    most, least, joined_most = ops.allreduce(
        torch.tensor([steps, -steps, joined_steps]), op=ops.Max,
        name="hvdsync.join.steps").tolist()
    if not (joined_most if torch_engine else most != -least):
        return  # every rank took every step with data of its own
    ops.broadcast_parameters(sorted(((n, p) for p, n in optimizer._parameter_names.items()),
                                    key=lambda named: named[0]), root_rank=last)
    broadcast_optimizer_state(optimizer, last)  # with the shared technique state
    optimizer.stats.total.step = most
