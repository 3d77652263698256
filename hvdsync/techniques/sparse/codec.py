"""``sparse=``'s wire encodings, codecs in the shape of every encoding
(:class:`hvdsync.core.wire.Codec`) over an adapter's row primitives
(:class:`hvdsync.techniques.sparse.ports.RowSparse`, passed as ``rows``): a row-sparse
gradient's distinct rows gathered (:class:`GatheredRows`), or scattered into its dense shape
and summed (:class:`ScatteredRows`). Which one a gradient takes each step is the protocol's
choice (:mod:`hvdsync.techniques.sparse.protocol`, docs/sparse.md); both the eager exchange and
Keras' traced one encode through these. A codec describes one parameter (its dense ``shape``
and its ``sparse_dim`` leading sparse dimensions); the exchange groups several into one
collective. ``size`` in :meth:`average` is what the ranks' sum is divided by: the ranks for
an average, 1 for ``op=Sum``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hvdsync.core.wire import Codec


class GatheredRows(Codec):
    """Each rank's distinct rows, values and int64 index bit-cast into columns of the value
    dtype (Horovod's ``compression=`` applied to the values), gathered: every rank sums every
    rank's rows into a coalesced sparse gradient."""

    name, collective, exact = "rows", "allgather", True

    def __init__(self, shape: Sequence[int], sparse_dim: int):
        self.shape, self.sparse_dim = tuple(shape), sparse_dim

    def encode(self, rows: Any, tensors: Sequence[Any]) -> tuple[list, list]:
        packed = [rows.pack(g) for g in tensors]
        return [p for p, _ in packed], [ctx for _, ctx in packed]

    def decode(self, rows: Any, parts: Sequence[Any], ctx: Sequence[Any]) -> list:
        return self.average(rows, parts, 1, ctx)

    def average(self, rows: Any, received: Sequence[Any], size: int,
                ctx: Sequence[Any]) -> list:
        return [rows.unpack_summed(x, c, self.shape, self.sparse_dim, size)
                for x, c in zip(received, ctx)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.shape}, {self.sparse_dim})"


class ScatteredRows(GatheredRows):
    """Each rank's rows scattered into the dense shape with a "present" column (ones where a
    row is), summed on the wire (where the gathered rows of every rank would be larger); the
    rows any rank had come back as a coalesced sparse gradient."""

    name, collective = "scattered_rows", "sum"

    def encode(self, rows: Any, tensors: Sequence[Any]) -> tuple[list, list]:
        scattered = [rows.scatter(g, self.shape) for g in tensors]
        return [b for b, _ in scattered], [ctx for _, ctx in scattered]

    def average(self, rows: Any, received: Sequence[Any], size: int,
                ctx: Sequence[Any]) -> list:
        return [rows.present_rows(x, c, self.shape, self.sparse_dim, size)
                for x, c in zip(received, ctx)]


#: the route names of :mod:`hvdsync.techniques.sparse.protocol` -> their codec class
ROUTE_CODECS = {"gather": GatheredRows, "dense": ScatteredRows}
