"""Every rank enters hvdsync's collectives from the same place, or all of them say so.

hvdsync's collectives come from a few entry points: the training step, ``flush()`` and the
saves. A call made on some ranks only (``if hvd.rank() == 0: opt.flush()``) would meet the
other ranks' next step: a hang under Horovod, wrongly paired tensors under torch.distributed.
So each entry tells the others what this rank is doing and its step, in a small control round
(one allreduce of ``2 x ranks`` values), and ranks that entered differently all raise
:class:`~hvdsync.safety.agreement.RanksDisagree`, naming what each side called. A step sends its tag
with its first collective and checks it at the first wait after it (or when
:data:`IN_FLIGHT` are out); ``flush()`` and saves check theirs before waiting for anything.
docs/failures.md, "A call made on some ranks only", has the costs measured.
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any, Optional

from hvdsync.safety import watchdog
from hvdsync.safety.agreement import RanksDisagree

#: what each entry point is, as the error names it
KINDS = {0: "hvd.join() (Horovod's joined rank sends zeros), or gone (a rank whose process "
            "ended reads as zeros too)", 1: "a training step",
         2: "flush()", 3: "save_checkpoint / save_model",
         4: "the optimizer's construction or a restore check",
         5: "a collective of the script's own (hvd.allreduce, hvd.barrier...)"}
CODE = {"step": 1, "flush": 2, "save": 3, "start": 4, "script": 5}
#: the fix the error names, the first that applies in this order
FIX = {0: "if that rank's process ended, its own output says why; if it waits in hvd.join(), "
       "call flush() and saves after hvd.join() has returned, on every rank",
       2: "call flush() on every rank", 3: "call save_checkpoint / save_model on every rank "
       "(rank 0 writes the file)"}
#: tags in flight at most: local steps (delay=) let ranks run apart between synchronizations,
#: and a tag must not hold a rank back that the technique lets go on
IN_FLIGHT = 16


class Entries:
    """The entry tags of one communicator, over ``process_set`` (its ``rank()`` and
    ``size()``). ``start(values, name, what)`` starts a control round (the average of a
    vector over the ranks; ``what``: for the watchdog) and returns its pending."""

    def __init__(self, process_set: Any, start: Callable[[list[float], str, str], Any],
                 grace_s: float = 0.0):
        self.process_set = process_set
        self._start = start
        #: how long a rank that found the ranks apart waits before it raises, so that ranks
        #: that check later (Keras' compiled step: on TensorFlow's executor) raise the same
        #: error before this one's exit shuts Horovod down under them
        self.grace_s = grace_s
        self.kind, self.step = CODE["start"], 0
        self._tagged = False  # this entry's tag is in flight (or was checked)
        self._seq = 0
        self._out: deque[tuple[int, Any]] = deque()  # (seq, pending) not yet checked
        #: why a step cannot go on beside a rank in ``hvd.join()`` (a joined rank takes part
        #: in it with zero gradients: hvdsync.torch.joined), or ``None`` where it can
        self.beside_join: Optional[str] = "this adapter's steps do not take part in hvd.join()"
        self._joined_round = False  # the next step's tag was paired by hvd.join()'s loop
        self.name_after([])

    def name_after(self, layer_names: list[str]) -> None:
        """Tell this optimizer's tags apart from another's (Horovod pairs collectives by
        name): by its layers, which every rank has alike (hvdsync.safety.agreement)."""
        self._identity = zlib.crc32("|".join(layer_names).encode())
        self._names = [f"hvdsync.entry.{self._identity:08x}.{i}" for i in range(IN_FLIGHT + 1)]

    def names(self) -> list[str]:
        """Every name a tag of this optimizer can have (one per slot in flight)."""
        return self._names

    def reset(self) -> None:
        """Horovod Elastic changed the world: tags in flight belonged to the old one, and
        every rank -- one that joins now too -- starts counting them again, at setup."""
        self._out.clear()
        self._seq, self._tagged = 0, False
        self.kind, self.step = CODE["start"], 0

    def begin(self, kind: str, step: int) -> None:
        """An entry point begins on this rank (``kind``: a key of :data:`CODE`)."""
        self.kind, self.step, self._tagged = CODE[kind], step, False
        if self._joined_round and kind == "step":  # its tag was the join loop's round
            self._seq, self._tagged, self._joined_round = self._seq + 1, True, False
        watchdog.entered(KINDS[self.kind], step)

    def joined_round(self) -> None:
        """This rank is in ``hvd.join()``, whose loop just paired with the others' step tags:
        it takes that step with them (zero gradients), and sends no tag of its own."""
        self._joined_round = True

    def identity(self) -> int:
        """This optimizer's tags, as one number (from :meth:`name_after`)."""
        return self._identity

    def before(self, what: str = "a collective") -> int:
        """Called by the communicator before it starts a collective (``what``: for the
        watchdog's messages): the entry's tag goes first (once per entry). Returns the tag's
        number, which a wait passes to :meth:`settle`."""
        if not self._tagged and self.process_set.size() > 1:
            while len(self._out) >= IN_FLIGHT:
                self._check(*self._out.popleft())
            rank, size = self.process_set.rank(), self.process_set.size()
            values = [0.0] * (2 * size)
            values[2 * rank], values[2 * rank + 1] = self.kind, self.step
            self._seq += 1
            self._out.append((self._seq, self._start(
                values, self.names()[self._seq % (IN_FLIGHT + 1)],
                f"the ranks' entry tags (before {what})")))
            self._tagged = True
            if self.kind != CODE["step"]:
                # checked before anything else starts: of two ranks that entered apart, one
                # (in flush or a save) starts nothing more, so no tensors are paired wrongly
                self.settle()
        return self._seq

    def now(self, what: str = "a collective") -> None:
        """A collective that blocks (``what``) follows: the entry's tag first, checked at
        once (nothing on one rank)."""
        self.settle(self.before(what), what)

    def settle(self, upto: Optional[int] = None, what: Optional[str] = None) -> None:
        """Check every tag up to number ``upto`` (all: ``None``), before a wait for ``what``
        (for the watchdog's messages); raises :class:`RanksDisagree` on every rank if any
        rank entered otherwise."""
        while self._out and (upto is None or self._out[0][0] <= upto):
            seq, pending = self._out.popleft()
            if what is not None:
                pending.what = f"the ranks' entry tags (before {what})"
            self._check(seq, pending)

    def _check(self, seq: int, pending: Any) -> None:
        shared = [round(v * self.process_set.size()) for v in pending.wait_idle()]
        kinds, steps = shared[0::2], shared[1::2]
        if len(set(kinds)) > 1:
            if set(kinds) == {0, CODE["step"]} and self.beside_join is None:
                return  # a rank in hvd.join() takes part with zero gradients
            if self.grace_s:
                time.sleep(self.grace_s)
            raise RanksDisagree(describe(kinds, steps, self.beside_join))


def describe(kinds: list[int], steps: list[int], beside_join: Optional[str] = None) -> str:
    """The error for ranks that entered differently (per rank: a :data:`KINDS` code and its
    step; ``beside_join``: why a step cannot go on beside a joined rank, if known)."""
    sides = {k: [r for r, x in enumerate(kinds) if x == k] for k in kinds}
    said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: "
                     f"{KINDS.get(k, k)} (step {steps[rs[0]]})" for k, rs in sides.items())
    fixes = dict(FIX)
    if beside_join is not None:
        fixes[0] = (f"if that rank's process ended, its own output says why; if it waits in "
                    f"hvd.join(), hvdsync's optimizer cannot step beside it here: "
                    f"{beside_join}; give every rank as many batches (a DistributedSampler "
                    "with drop_last=True)")
    fix = next((fixes[k] for k in fixes if k in sides), "make every rank take the same steps")
    return (f"hvdsync: the ranks called different collectives -- {said}. Each would wait for "
            f"the others forever (or, on torch.distributed, pair the wrong tensors): {fix}. "
            "See docs/failures.md.")
