"""Simulated ranks: N threads of one process that run the torch adapter as N ranks would.

:func:`hvdsync.testing.run_threads` starts them; this module is what they talk to: the torch
backend's own code (:mod:`hvdsync.torch.c10d`) over a process group made of threads instead
of Gloo, so the core's lifecycle -- every technique and composition, memories, flush,
checkpoints, non-finite values, ranks that disagree -- is tested in seconds, with no launcher.
It is not a stand-in for real ranks (parity, launchers, crashes and timing stay with
:func:`hvdsync.testing.run_ranks`). One rank runs at a time; each keeps its own random state;
collectives pair by order and are checked alike on every rank; sums are exact, in rank
order; a first poll finds a collective in flight; and no wait outlasts the world's
``timeout``. docs/testing.md, "How the simulation stays honest".
"""

from __future__ import annotations

import random
import threading
import traceback
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as _real_dist

from hvdsync.testing.rank_errors import RanksFailed, SimulationError
from hvdsync.torch.c10d.runtime import Runtime, running_on

NAME = "simulated"


class _Slot:
    """The k-th collective of every rank: what each brought, and the result's readiness."""

    def __init__(self, seq: int):
        self.seq = seq
        self.kind: Optional[tuple] = None  # (name, op, root, shapes, dtypes) of the first rank
        self.first_rank = -1
        self.inputs: dict[int, Any] = {}  # rank -> (tensors, outputs), until computed
        self.arrived: set[int] = set()
        self.polled_by: set[int] = set()
        self.complete = False
        self.done = threading.Event()
        self.error: Optional[str] = None


class _Work:
    """A started simulated collective (c10d's ``Work``): ``wait()`` and ``is_completed()``."""

    def __init__(self, world: "World", slot: _Slot):
        self.world, self.slot = world, slot

    def is_completed(self) -> bool:
        # a rank that polls lets the others run meanwhile (they hold what it waits for)
        return self.slot.done.is_set() or self.world.poll(self.slot)

    def wait(self, timeout: Any = None) -> bool:
        self.world.wait_for(self.slot)
        return True


class World:
    """N simulated ranks (threads) and the collectives between them."""

    def __init__(self, size: int, timeout: float = 120.0):
        if size < 1:
            raise ValueError(f"a world needs at least one rank, got {size}")
        self.size, self.timeout = size, float(timeout)
        self.turn = threading.Lock()
        self.slots: dict[int, _Slot] = {}
        self.next_seq = [0] * size
        self.failed: Optional[str] = None
        self.rng: list[tuple] = []  # per rank, while it does not hold the turn (run sets it)

    # -- the turn and each rank's random state -------------------------------------------
    def rank(self) -> int:
        return _CURRENT.rank

    def take_turn(self) -> None:
        self.turn.acquire()
        _set_rng_state(self.rng[self.rank()])

    def give_turn(self) -> None:
        self.rng[self.rank()] = _rng_state()
        self.turn.release()

    # -- collectives ----------------------------------------------------------------------
    def start(self, name: str, tensors: list[torch.Tensor], op: Any = None,
              root: Optional[int] = None, outputs: Optional[list[torch.Tensor]] = None) -> _Work:
        """This rank's part of its next collective; the last rank to arrive computes it."""
        if self.failed:
            raise SimulationError(self.failed)
        r = self.rank()
        seq = self.next_seq[r]
        self.next_seq[r] += 1
        slot = self.slots.setdefault(seq, _Slot(seq))
        kind = (name, str(op), root, [tuple(t.shape) for t in tensors],
                [t.dtype for t in tensors])
        if slot.kind is None:
            slot.kind, slot.first_rank = kind, r
        elif slot.kind != kind and slot.error is None:
            slot.error = (f"collective #{seq} differs between ranks: rank {slot.first_rank} "
                          f"started {_describe(slot.kind)}, rank {r} {_describe(kind)}")
        slot.inputs[r] = (tensors, outputs)
        slot.arrived.add(r)
        if len(slot.arrived) == self.size:
            if slot.error is None:
                _compute(name, op, root, slot.inputs, self.size)
                slot.complete = True
            slot.inputs.clear()  # the tensors are the ranks' again
            del self.slots[seq]
            slot.done.set()
        if slot.error is not None:
            raise SimulationError(slot.error)
        return _Work(self, slot)

    def wait_for(self, slot: _Slot) -> None:
        if not slot.done.is_set():
            self.give_turn()
            try:
                finished = slot.done.wait(self.timeout)
            finally:
                self.take_turn()
            if not finished:
                missing = sorted(set(range(self.size)) - slot.arrived)
                self.fail(f"rank {self.rank()} waited {self.timeout:g} s for collective "
                          f"#{slot.seq} ({_describe(slot.kind)}); rank(s) {missing} never "
                          "started it")
        if not slot.complete:
            raise SimulationError(slot.error or self.failed or "the collective was abandoned")

    def poll(self, slot: _Slot) -> bool:
        """Whether ``slot`` completes within a moment, the turn given up meanwhile. A rank's
        first look always finds it in flight, as a network that takes time would: what is
        folded in when it arrives (``delay=``) is not decided by the simulation's schedule."""
        if self.rank() not in slot.polled_by:
            slot.polled_by.add(self.rank())
            return False
        self.give_turn()
        try:
            slot.done.wait(0.002)
        finally:
            self.take_turn()
        return slot.done.is_set()

    def fail(self, why: str) -> None:
        """End every rank's waits (a rank raised, or a collective never completed)."""
        if self.failed is None:
            self.failed = why
        for slot in list(self.slots.values()):
            slot.done.set()

    # -- running ranks ----------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None
            ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every simulated rank; the results in rank order."""
        from hvdsync.torch import c10d, engine
        kwargs = kwargs or {}
        results: list[Any] = [None] * self.size
        errors: dict[int, str] = {}
        saved = _rng_state()
        self.rng = [saved] * self.size  # as processes started alike

        def body(r: int) -> None:
            _CURRENT.world, _CURRENT.rank = self, r
            with engine.on_this_thread(NAME, c10d), running_on(RUNTIME):
                self.take_turn()
                try:
                    results[r] = fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 -- reported with the rank
                    errors[r] = "".join(traceback.format_exception(e))
                    self.fail(f"rank {r} raised {type(e).__name__}: {e}")
                finally:
                    self.give_turn()

        threads = [threading.Thread(target=body, args=(r,), name=f"hvdsync-rank{r}",
                                    daemon=True) for r in range(self.size)]
        try:
            for t in threads:
                t.start()
            for t in threads:  # every wait is bounded by the timeout: no join hangs on one
                t.join()
        finally:
            _set_rng_state(saved)
        if errors:
            raise RanksFailed(f"simulated ranks failed: {self.failed}\n" + "\n".join(
                f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return results


def _rng_state() -> tuple:
    """This process's random state: torch's, numpy's and :mod:`random`'s."""
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


def _describe(kind: Optional[tuple]) -> str:
    if kind is None:
        return "nothing"
    name, op, root, shapes, dtypes = kind
    extra = (f" op={op}" if op != "None" else "") + (f" root={root}" if root is not None else "")
    return f"{name}{extra} of shapes {shapes} {[str(d) for d in dtypes]}"


_REDUCE = {
    str(_real_dist.ReduceOp.SUM): lambda a, b: a.add_(b),
    str(_real_dist.ReduceOp.MIN): lambda a, b: torch.minimum(a, b, out=a),
    str(_real_dist.ReduceOp.MAX): lambda a, b: torch.maximum(a, b, out=a),
    str(_real_dist.ReduceOp.PRODUCT): lambda a, b: a.mul_(b),
}


def _compute(name: str, op: Any, root: Optional[int], inputs: dict, size: int) -> None:
    if name == "all_reduce":
        total = inputs[0][0][0].clone()
        for r in range(1, size):
            _REDUCE[str(op)](total, inputs[r][0][0])
        for r in range(size):
            inputs[r][0][0].copy_(total)
    elif name == "all_gather":
        for r in range(size):
            for j, out in enumerate(inputs[r][1]):
                out.copy_(inputs[j][0][0])
    elif name == "reduce_scatter":  # each rank's output: its equal part of the reduced input
        total = inputs[0][0][0].clone()
        for r in range(1, size):
            _REDUCE[str(op)](total, inputs[r][0][0])
        for r in range(size):
            out = inputs[r][1][0]
            out.copy_(total[r * out.numel():(r + 1) * out.numel()])
    elif name == "broadcast":
        value = inputs[root][0][0].clone()
        for r in range(size):
            inputs[r][0][0].copy_(value)
    elif name != "barrier":
        raise SimulationError(f"no simulated collective {name!r}")


class _Dist:
    """The part of ``torch.distributed`` that :mod:`hvdsync.torch.c10d` calls, on the world
    of the calling thread (the global group only: ``group`` is always ``None`` here)."""

    ReduceOp = _real_dist.ReduceOp

    @staticmethod
    def _world() -> World:
        world = _CURRENT.world
        if world is None:
            raise SimulationError("no simulated world on this thread (use run_threads)")
        return world

    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group=None) -> int:
        return self._world().rank()

    def get_world_size(self, group=None) -> int:
        return self._world().size

    def all_reduce(self, tensor, op=_real_dist.ReduceOp.SUM, group=None, async_op=False):
        return self._sync(self._world().start("all_reduce", [tensor], op=op), async_op)

    def all_gather(self, outputs, tensor, group=None, async_op=False):
        if len(outputs) != self._world().size:
            raise SimulationError("all_gather needs one output per rank")
        return self._sync(self._world().start("all_gather", [tensor], outputs=list(outputs)),
                          async_op)

    def reduce_scatter_single(self, output, input, op=_real_dist.ReduceOp.SUM, group=None,
                              async_op=False):
        return self._sync(self._world().start("reduce_scatter", [input], op=op,
                                              outputs=[output]), async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        return self._sync(self._world().start("broadcast", [tensor], root=src), async_op)

    def barrier(self, group=None, async_op=False):
        return self._sync(self._world().start("barrier", []), async_op)

    @staticmethod
    def _sync(work: _Work, async_op: bool):
        if async_op:
            return work
        work.wait()
        return None


class _Current(threading.local):
    """A rank thread's world and rank (set when :meth:`World.run` starts the thread)."""
    world: Optional[World] = None
    rank: int = -1


_CURRENT = _Current()


#: the simulated ranks' runtime of :mod:`hvdsync.torch.c10d` (its code, over :class:`_Dist`)
RUNTIME = Runtime(_Dist(), joins=False)


def run(fn: Callable[..., Any], np: int, args: tuple = (), kwargs: Optional[dict] = None,
        timeout: float = 60.0) -> list[Any]:
    """Run ``fn`` on ``np`` simulated ranks; see :func:`hvdsync.testing.run_threads`."""
    return World(np, timeout).run(fn, args, kwargs)
