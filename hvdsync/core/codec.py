"""How a list of tensors travels between ranks: one :class:`Codec` per encoding, in the shape
of Horovod's ``Compressor`` (encode into the parts that go on the wire, decode them back, and
which collective carries them), over a few adapter primitives (:class:`CodecOps`). A new
encoding is one class here and a line of :data:`CODECS`; it needs adapter code only for a
primitive the ports lack.

The context Horovod's compressor returns is, here, the tensors themselves (``like``): the caller
keeps them, and their shapes and dtypes are what decoding needs. ``delay=``'s outer exchange
chooses its codec by name (``compress=``); Horovod's own ``compression=`` keeps its meaning on
the plain exchange."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


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
    """One encoding. ``collective``: what carries the parts -- ``"allreduce"`` (the wire
    averages them: the encoding must survive a sum) or ``"allgather"`` (every rank decodes every
    rank's parts and averages them in rank order, so all get the same bits). ``exact``: decoding
    gives back what was encoded (nothing for error feedback to keep)."""

    name: str = ""
    collective: str = "allreduce"
    exact: bool = False

    def encode(self, ops: Any, tensors: Sequence[Any]) -> list:
        """The parts that go on the wire for ``tensors``."""
        raise NotImplementedError

    def decode(self, ops: Any, parts: Sequence[Any], like: Sequence[Any]) -> list:
        """This rank's :meth:`encode`-d ``parts`` back, shaped like ``like`` (what error
        feedback subtracts)."""
        raise NotImplementedError

    def average(self, ops: Any, received: Sequence[Any], size: int,
                like: Sequence[Any]) -> list:
        """What the :attr:`collective` of ``size`` ranks gave for the parts, as the average of
        the ranks' tensors, shaped like ``like``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AsTheyAre(Codec):
    """The tensors as they are, averaged by allreduce."""

    name, exact = "none", True

    def encode(self, ops: Any, tensors: Sequence[Any]) -> list:
        return list(tensors)

    def decode(self, ops: Any, parts: Sequence[Any], like: Sequence[Any]) -> list:
        return list(parts)

    def average(self, ops: Any, received: Sequence[Any], size: int,
                like: Sequence[Any]) -> list:
        return [ops.cast(x, like=t) for x, t in zip(received, like)]


class HalfPrecision(AsTheyAre):
    """float16, averaged by allreduce (half the bytes; the sum on the wire is in float16, as
    Horovod's ``Compression.fp16``)."""

    name, exact = "fp16", False

    def encode(self, ops: Any, tensors: Sequence[Any]) -> list:
        return [ops.cast(t, "float16") for t in tensors]

    def decode(self, ops: Any, parts: Sequence[Any], like: Sequence[Any]) -> list:
        return [ops.cast(x, like=t) for x, t in zip(parts, like)]


class BFloat16(Codec):
    """bfloat16 bits (as int16: collectives need not know bfloat16), gathered: float32's range
    in half the bytes, with no sum in low precision."""

    name, collective = "bf16", "allgather"

    def encode(self, ops: Any, tensors: Sequence[Any]) -> list:
        return [ops.bitcast(ops.cast(ops.flat(tensors), "bfloat16"), "int16")]

    def _values(self, ops: Any, bits: Any) -> Any:
        return ops.cast(ops.bitcast(bits, "bfloat16"), "float32")

    def decode(self, ops: Any, parts: Sequence[Any], like: Sequence[Any]) -> list:
        return ops.unflat(self._values(ops, parts[0]), like)

    def average(self, ops: Any, received: Sequence[Any], size: int,
                like: Sequence[Any]) -> list:
        return ops.average_rows(ops.rows(self._values(ops, received[0]), size), like)


class Int8Blocks(Codec):
    """int8 codes with a float32 scale per ``chunk`` values, gathered: about a quarter of the
    bytes."""

    name, collective = "int8", "allgather"

    def __init__(self, chunk: int = 1024):
        self.chunk = chunk

    def encode(self, ops: Any, tensors: Sequence[Any]) -> list:
        return ops.quantize_blocks(ops.flat(tensors), self.chunk)

    def decode(self, ops: Any, parts: Sequence[Any], like: Sequence[Any]) -> list:
        codes, scale = parts
        return ops.unflat(ops.dequantize_blocks(codes, scale, self.chunk), like)

    def average(self, ops: Any, received: Sequence[Any], size: int,
                like: Sequence[Any]) -> list:
        codes, scale = received
        return ops.average_rows(ops.dequantize_blocks(codes, scale, self.chunk, size), like)

    def __repr__(self) -> str:
        return f"Int8Blocks(chunk={self.chunk})"


#: the encodings by name (``delay=dict(compress=...)``)
CODECS: dict[str, Codec] = {c.name: c for c in (AsTheyAre(), HalfPrecision(), BFloat16(),
                                                 Int8Blocks())}
