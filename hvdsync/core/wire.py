"""The wire: what a transport hands to the collectives and gets back.

- :class:`Pending`: collectives in flight, what every transport returns and every
  communicator gives (docs/design.md, "One lifecycle: roles and moments");
- :class:`Codec`: how a list of tensors is encoded for the wire, in the shape of Horovod's
  ``Compressor`` (encode into the parts that go on the wire, decode them back, and which
  collective carries them), over a few adapter primitives (:class:`CodecOps`). A new encoding
  is one class here and a line of :data:`CODECS`; it needs adapter code only for a primitive
  the ports lack.

``delay=``'s outer exchange chooses its codec by name (``compress=``); ``lowrank=``'s factors
(two rounds) and ``sparse=``'s rows are codecs of their techniques' own
(:mod:`hvdsync.techniques.lowrank.codec`, :mod:`hvdsync.techniques.sparse.codec`); Horovod's
own ``compression=`` keeps its meaning on the plain exchange."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

from hvdsync.safety.watchdog import guard


class Pending:
    """Collectives in flight. ``wait()`` finishes them and returns their result (the first
    call does the work; later calls return the same result); ``ready()`` says, without
    blocking, whether ``wait()`` would return at once. ``nbytes`` and ``collectives`` are
    what this rank handed to Horovod for it (for :class:`hvdsync.core.stats.SyncStats`)."""

    nbytes: int
    collectives: int
    what: str

    def __init__(self, wait: Optional[Callable[[], Any]] = None,
                 ready: Optional[Callable[[], bool]] = None, nbytes: int = 0,
                 collectives: int = 0, what: str = "a collective", guarded: bool = True):
        self.what = what  # for the watchdog's message
        self._wait = wait
        self._ready = ready
        self._done = wait is None
        self._result: Any = None
        self.nbytes = nbytes
        self.collectives = collectives
        self._guarded = guarded  # False: it waits for others whose wait() is guarded
        #: run before the first wait: the communicator's check of the entry tags started
        #: before this collective (hvdsync.safety.entries), which raises if the ranks entered apart
        self.before: Optional[Callable[[], None]] = None

    @classmethod
    def resolved(cls, result: Any = None) -> "Pending":
        """A pending that is already finished with ``result`` (nothing was sent)."""
        p = cls()
        p._result = result
        return p

    def wait(self) -> Any:
        if not self._done:
            self._checked()
            if self._guarded:
                with guard(self.what):
                    self._result = self._wait()
            else:
                self._result = self._wait()
            self._done = True
            self._wait = self._ready = None
        return self._result

    def _checked(self) -> None:
        """Run :attr:`before` once, ahead of the first wait."""
        if self.before is not None:
            before, self.before = self.before, None
            before()

    def wait_idle(self) -> Any:
        """:meth:`wait`, without keeping a core busy meanwhile: polls :meth:`ready` with
        short sleeps first. Horovod's torch ``synchronize()`` spins (a 4 s wait used 5.8 s
        of CPU), which on a CPU rank takes the core from the threads that move the data and
        from the other ranks of a shared host. For waits on background exchanges that can
        be polled; a pending that cannot be polled is simply waited for."""
        if not self._done and self._ready is not None:
            self._checked()
            with guard(self.what):
                self.ready_within(math.inf)
        return self.wait()

    def ready_within(self, seconds: float) -> bool:
        """Whether it becomes ready within ``seconds``, polling with short sleeps instead of
        spinning: 20 us, growing to 200 us (a step of a few ms must not lose one to a sleep
        that outlasts the exchange; longer ones poll 5000 times a second at most)."""
        deadline, sleep = time.monotonic() + seconds, 2e-5
        while not self.ready():
            if time.monotonic() > deadline:
                return False
            time.sleep(sleep)
            sleep = min(1.5 * sleep, 2e-4)
        return True

    def ready(self) -> bool:
        if self._done:
            return True
        return self._ready is not None and self._ready()

    def used(self) -> None:
        """Its result went into an update: a transport that lends memory to an exchange
        (``lowrank=``'s error feedback inside ``delay=``) commits it here. Nothing by
        default."""

    def discard(self) -> None:
        """Its result is dropped unused (a flush, a restore): what the exchange took from a
        technique's memory goes back. Nothing by default."""

    def then(self, fn: Callable[[Any], Any]) -> "Pending":
        """A pending that waits for this one and returns ``fn(result)``; same counts."""
        return Pending(lambda: fn(self.wait()), self.ready, self.nbytes, self.collectives,
                       self.what, guarded=False)  # (this one's wait() is guarded already)


def wait_all(pendings: Sequence[Pending]) -> list:
    """Every pending's :meth:`Pending.wait`, in order: their results."""
    return [p.wait() for p in pendings]


def finish_dropped(pendings: Sequence[Pending], what: str) -> list[Pending]:
    """Wait for collectives whose results are thrown away; one that fails is dropped with them
    (one ``RuntimeWarning`` for all, naming ``what``): it belonged to a world that is gone --
    Horovod Elastic restores the last commit after a rank died, and the collectives in flight
    then can only raise. Returns the ones that finished."""
    finished, failed = [], []
    for p in pendings:
        try:
            p.wait()
            finished.append(p)
        except Exception as e:  # noqa: BLE001 - its results are discarded anyway
            failed.append(e)
    if failed:
        warnings.warn(f"hvdsync: {len(failed)} collective(s) of {what} failed ({failed[0]}); "
                      "dropped with them", RuntimeWarning, stacklevel=3)
    return finished


# -- codecs: how tensors are encoded for the wire --


class CodecOps(Protocol):
    """What the codecs need of an adapter's arithmetic (``ops``), beside
    :meth:`hvdsync.core.ports.TensorOps.cast`: flat vectors, bit casts and block
    quantization. Called inside :meth:`TensorOps.fused` (one compiled call in Keras)."""

    def flat(self, tensors: Sequence[Any]) -> Any:
        """``tensors`` flattened and concatenated into one float32 vector."""
    def unflat(self, flat: Any, like: Sequence[Any]) -> list:
        """``flat`` cut into tensors shaped (and typed) like ``like``."""
    def bitcast(self, t: Any, dtype: str) -> Any:
        """``t``'s bits read as ``dtype`` (a name of the same width: ``"int16"``)."""
    def rows(self, flat: Any, size: int) -> Any:
        """``flat`` as ``size`` equal rows (a ``size x n`` matrix)."""
    def quantize_blocks(self, flat: Any, chunk: int) -> list:
        """``[codes, scale]``: int8 codes of ``flat`` and a float32 scale per ``chunk``
        values (the chunk's largest magnitude maps to 127; NaN and Inf show in the scale)."""
    def dequantize_blocks(self, codes: Any, scale: Any, chunk: int,
                          size: int | None = None) -> Any:
        """:meth:`quantize_blocks` undone: a float32 vector; with ``size``, ``codes`` and
        ``scale`` are ``size`` ranks' concatenated and the result a ``size x n`` matrix,
        rank ``r``'s values in row ``r``."""
    def average_rows(self, rows: Any, like: Sequence[Any]) -> list:
        """The mean of a ``size x n`` matrix's rows, summed in rank order (the same bits on
        every rank), cut into tensors shaped (and typed) like ``like``."""


class Codec:
    """One encoding, in the shape of Horovod's ``Compressor``: :meth:`encode` gives the parts
    that go on the wire and a context (what decoding needs); :meth:`decode` gives this rank's
    parts back (what error feedback subtracts); :meth:`average` turns what the collective gave
    into the average of the ranks' tensors. ``collective``: what carries the parts --
    ``"allreduce"`` (the wire averages them: the encoding must survive a sum), ``"sum"`` (the
    wire sums them and :meth:`average` divides) or ``"allgather"`` (every rank decodes every
    rank's parts, in rank order, so all get the same bits).
    ``exact``: decoding gives back what was encoded (nothing for error feedback to keep).

    An encoding of more than one round (``rounds > 1``: ``lowrank=``'s factors) builds each
    later round's parts from the last one's result with :meth:`next_round`; its
    :meth:`average` takes the last round's."""

    name: str = ""
    collective: str = "allreduce"
    exact: bool = False
    rounds: int = 1

    def encode(self, ops: Any, tensors: Sequence[Any]) -> tuple[list, Any]:
        """``(parts, ctx)``: what goes on the wire for ``tensors``, and what decoding needs."""
        raise NotImplementedError

    def next_round(self, ops: Any, received: Sequence[Any], ctx: Any) -> tuple[list, Any]:
        """A codec of several rounds: the next round's ``(parts, ctx)`` from what the last
        round's collective gave."""
        raise NotImplementedError(f"{self.name} has one round")

    def decode(self, ops: Any, parts: Sequence[Any], ctx: Any) -> list:
        """This rank's :meth:`encode`-d ``parts`` back (what error feedback subtracts)."""
        raise NotImplementedError

    def average(self, ops: Any, received: Sequence[Any], size: int, ctx: Any) -> list:
        """What the :attr:`collective` of ``size`` ranks gave for the (last round's) parts,
        as the average of the ranks' tensors."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AsTheyAre(Codec):
    """The tensors as they are, averaged by allreduce (the context: the tensors, whose shapes
    and dtypes decoding keeps)."""

    name, exact = "none", True

    def encode(self, ops: Any, tensors: Sequence[Any]) -> tuple[list, Any]:
        return list(tensors), tensors

    def decode(self, ops: Any, parts: Sequence[Any], ctx: Any) -> list:
        return list(parts)

    def average(self, ops: Any, received: Sequence[Any], size: int, ctx: Any) -> list:
        return [ops.cast(x, like=t) for x, t in zip(received, ctx)]


class HalfPrecision(AsTheyAre):
    """float16, averaged by allreduce (half the bytes; the sum on the wire is in float16, as
    Horovod's ``Compression.fp16``)."""

    name, exact = "fp16", False

    def encode(self, ops: Any, tensors: Sequence[Any]) -> tuple[list, Any]:
        return [ops.cast(t, "float16") for t in tensors], tensors

    def decode(self, ops: Any, parts: Sequence[Any], ctx: Any) -> list:
        return [ops.cast(x, like=t) for x, t in zip(parts, ctx)]


class BFloat16(Codec):
    """bfloat16 bits (as int16: collectives need not know bfloat16), gathered: float32's range
    in half the bytes, with no sum in low precision."""

    name, collective = "bf16", "allgather"

    def encode(self, ops: Any, tensors: Sequence[Any]) -> tuple[list, Any]:
        return [ops.bitcast(ops.cast(ops.flat(tensors), "bfloat16"), "int16")], tensors

    def _values(self, ops: Any, bits: Any) -> Any:
        return ops.cast(ops.bitcast(bits, "bfloat16"), "float32")

    def decode(self, ops: Any, parts: Sequence[Any], ctx: Any) -> list:
        return ops.unflat(self._values(ops, parts[0]), ctx)

    def average(self, ops: Any, received: Sequence[Any], size: int, ctx: Any) -> list:
        return ops.average_rows(ops.rows(self._values(ops, received[0]), size), ctx)


class Int8Blocks(Codec):
    """int8 codes with a float32 scale per ``chunk`` values, gathered: about a quarter of the
    bytes."""

    name, collective = "int8", "allgather"

    def __init__(self, chunk: int = 1024):
        self.chunk = chunk

    def encode(self, ops: Any, tensors: Sequence[Any]) -> tuple[list, Any]:
        return ops.quantize_blocks(ops.flat(tensors), self.chunk), tensors

    def decode(self, ops: Any, parts: Sequence[Any], ctx: Any) -> list:
        codes, scale = parts
        return ops.unflat(ops.dequantize_blocks(codes, scale, self.chunk), ctx)

    def average(self, ops: Any, received: Sequence[Any], size: int, ctx: Any) -> list:
        codes, scale = received
        return ops.average_rows(ops.dequantize_blocks(codes, scale, self.chunk, size), ctx)

    def __repr__(self) -> str:
        return f"Int8Blocks(chunk={self.chunk})"


#: the encodings by name (``delay=dict(compress=...)``)
CODECS: dict[str, Codec] = {c.name: c for c in (AsTheyAre(), HalfPrecision(), BFloat16(),
                                                 Int8Blocks())}
