"""What ``sparse=`` alone needs of an adapter, beside the shared ports
(:mod:`hvdsync.core.ports`): its row-sparse gradients' primitives and two grouped
collectives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hvdsync.core.wire import Pending


class RowSparse(Protocol):
    """Row-sparse gradients (``sparse=``: torch's sparse COO tensors, Keras'
    ``IndexedSlices``), the primitives hvdsync/techniques/sparse/exchange.py is built on. A packed row
    is the row's values, then its int64 index bit-cast into columns of the value dtype (an
    allgather copies bytes); a scattered gradient is its dense rows with a "present" column
    of ones where a row is."""

    def coalesce(self, g: Any) -> tuple[Any, int]:
        """``g`` with duplicate rows summed, and how many rows that removed."""
    def layout(self, g: Any) -> tuple[int, int]:
        """``(distinct rows, sparse dimensions)`` of a row-sparse ``g``."""
    def row_count(self, g: Any) -> int:
        """The rows ``g`` holds (after the exchange: distinct)."""
    def empty(self, like: Any, sparse_dim: int) -> Any:
        """A row-sparse gradient with no rows for the parameter ``like``."""
    def as_rows(self, g: Any, sparse_dim: int) -> Any:
        """A dense ``g`` as a row-sparse one."""
    def pack(self, g: Any) -> tuple[Any, Any]:
        """``g``'s packed rows in the value dtype they travel in (after the adapter's
        compression), and what :meth:`unpack_summed` needs to undo it."""
    def unpack_summed(self, gathered: Any, ctx: Any, shape: tuple, sparse_dim: int,
                      divide_by: int) -> Any:
        """Every rank's packed rows as one gradient, duplicate rows summed, ``/ divide_by``."""
    def scatter(self, g: Any, shape: tuple) -> tuple[Any, Any]:
        """``g``'s rows scattered into the dense ``shape`` (flattened per row), the present
        column after them, in the dtype they travel in; and what undoes it."""
    def present_rows(self, summed: Any, ctx: Any, shape: tuple, sparse_dim: int,
                     divide_by: int) -> Any:
        """The rows of a summed :meth:`scatter` that some rank had, ``/ divide_by``."""
    def codes(self, codes: Sequence[int], like: Any) -> Any:
        """``[1, w]``: the int64 ``codes``, to travel first in a grouped allgather of tensors
        like ``like`` (``None``: alone): bit-cast into its dtype where a group takes one
        dtype (Keras), as int64 where it may mix them (torch)."""
    def codes_of(self, gathered: Any, size: int) -> list[list[int]]:
        """Every rank's codes from a gathered :meth:`codes`."""
    def dtype_key(self, t: Any) -> str: ...
    def nbytes(self, t: Any) -> int: ...


class RowCollectives(Protocol):
    """The communicator's part (``comm``)."""

    #: whether the reduction averages (``1 / size``) rather than sums (``sparse=`` divides
    #: its sums by the ranks then)
    averages: bool
    def gather_rows(self, name: str, tensors: list) -> Pending:
        """One grouped allgather of 2-d ``tensors`` of one dtype whose row counts differ
        between ranks (``sparse=``); ``wait()`` gives each one's rows in rank order. Its
        ``collectives``: 1 where this rank runs it, 0 where another rank of its node runs it
        for this one (``between="nodes"``): its bytes are then not this rank's."""
    def sum_rows(self, name: str, tensors: list) -> Pending:
        """One grouped allreduce (a sum) of ``tensors`` (``sparse=``'s dense route);
        ``collectives`` as :meth:`gather_rows`'."""


#: receiver -> what this technique adds to the shared ports there (tests/test_contracts.py)
EXTENDS = {"rows": RowSparse, "comm": RowCollectives}
