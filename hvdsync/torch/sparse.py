"""Sparse grouped allgather for torch (technique 3; the rules live in :mod:`hvdsync.sparse`).

Row-sparse gradients are torch sparse COO tensors (``nn.Embedding(sparse=True)``,
``nn.EmbeddingBag(sparse=True)``). A gradient with ``c`` distinct rows travels as one
``[c, k + row]`` tensor in the (compressed) value dtype: ``k`` columns carry the int64
indices bit for bit, ``row`` the row's values -- one allgather per gradient instead of
Horovod's two, and all gradients of the step in one grouped call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from horovod.torch.mpi_ops import Average, allgather, grouped_allgather_async, \
    grouped_allreduce_async_, synchronize

from hvdsync.sparse import ABSENT, DENSE, SparseConfig, SparseRoute, choose_route, \
    gradient_layouts
from hvdsync.stats import SyncStats
from hvdsync.torch.comm import GradientAllreduce, Pending

_INDEX_BYTES = 8  # torch sparse indices are int64


class SparseExchange:
    """Moves the sparse gradients of one step: :meth:`share_layouts` (the counts collective),
    then :meth:`start` (one grouped allgather, plus one grouped allreduce for gradients routed
    dense). Uses ``dense``'s compression, op and scale factors."""

    def __init__(self, config: SparseConfig, dense: GradientAllreduce, stats: SyncStats):
        self.config = config
        self.dense = dense
        self.stats = stats
        self.size = dense.process_set.size()
        self._layout: dict[torch.Tensor, tuple[str, list[int], int]] = {}

    # -- stage 1 ----------------------------------------------------------------------------
    def share_layouts(self, params: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Sum local duplicate rows, then agree with every rank on each parameter's gradient
        layout and per-rank row counts (one allgather of ``2 x len(params)`` int64)."""
        codes: list[int] = []
        for _, p in params:
            g = p.grad
            if g is None:
                codes += [ABSENT, 0]
            elif g.is_sparse:
                before = g._nnz()
                if not g.is_coalesced():
                    p.grad = g = g.coalesce()
                self.stats.count("sparse_duplicate_rows", before - g._nnz())
                codes += [g._nnz(), g.sparse_dim()]
            else:
                codes += [DENSE, 0]
        local = torch.tensor([codes], dtype=torch.int64)
        if self.size == 1:
            rows = local.tolist()
        else:
            rows = allgather(local, name="hvdsync.sparse.layouts",
                             process_set=self.dense.process_set).tolist()
            self.stats.control(local.numel() * _INDEX_BYTES)
        names = [n for n, _ in params]
        layouts = gradient_layouts([r[0::2] for r in rows], names)
        self._layout = {}
        for i, ((name, p), layout) in enumerate(zip(params, layouts)):
            sparse_dims = {r[2 * i + 1] for r in rows if r[2 * i] >= 0}
            if len(sparse_dims) > 1:
                raise RuntimeError(f"the sparse gradient of {name!r} has different sparse_dim "
                                   f"on different ranks: {sorted(sparse_dims)}")
            counts = [max(r[2 * i], 0) for r in rows]
            self._layout[p] = (layout, counts, sparse_dims.pop() if sparse_dims else 0)

    def is_sparse(self, p: torch.Tensor) -> bool:
        """Whether some rank has a sparse gradient for ``p`` this step (after
        :meth:`share_layouts`)."""
        return self._layout.get(p, ("dense",))[0] == "sparse"

    def empty_gradient(self, p: torch.Tensor) -> torch.Tensor:
        """A sparse gradient with no rows, for a rank on which ``p`` was not used while others
        have rows: it takes part in the collectives with zero rows."""
        s = self._layout[p][2]
        return torch.sparse_coo_tensor(torch.empty(s, 0, dtype=torch.int64, device=p.device),
                                       p.new_empty((0, *p.shape[s:])), p.shape,
                                       is_coalesced=True)

    # -- stages 2 and 3 ---------------------------------------------------------------------
    def start(self, items: Sequence[tuple[int, torch.Tensor]]) -> dict[int, Pending]:
        """Start sending ``(layer index, parameter)`` sparse gradients, in a fixed order.
        Returns one :class:`Pending` per layer; waiting on it writes the reduced, coalesced
        gradient into ``p.grad``."""
        pendings: dict[int, Pending] = {}
        gather: list[tuple[int, torch.Tensor]] = []
        dense: list[tuple[int, torch.Tensor]] = []
        for li, p in items:
            pendings.setdefault(li, Pending())
            route = self._route(p)
            self.stats.count(f"sparse_{route.route}")
            if route.route == "gather" and route.equal_counts:
                self.stats.count("sparse_gather_equal")
            if route.route == "gather":
                gather.append((li, p))
            elif route.route == "dense":
                dense.append((li, p))
            else:  # no rows anywhere: the reduced gradient is empty, nothing to send
                p.grad = self.empty_gradient(p)
        if self.size > 1:
            if gather:
                self._start_gather(gather, pendings)
            if dense:
                self._start_dense(dense, pendings)
        return pendings

    def _route(self, p: torch.Tensor) -> SparseRoute:
        _, counts, s = self._layout[p]
        esize = self._wire_dtype(p).itemsize
        row = math.prod(p.shape[s:])
        return choose_route(counts, (row + self._index_columns(s, esize)) * esize,
                            p.numel() * esize, self.config.dense_ratio)

    def _wire_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.dense.compression.compress(p.new_empty(0))[0].dtype

    @staticmethod
    def _index_columns(sparse_dim: int, esize: int) -> int:
        if _INDEX_BYTES % esize:
            raise TypeError(f"sparse gradients travel with their indices bit-cast to the value "
                            f"dtype, which needs an element size dividing 8, got {esize}")
        return sparse_dim * _INDEX_BYTES // esize

    def _start_gather(self, items: list[tuple[int, torch.Tensor]],
                      pendings: dict[int, Pending]) -> None:
        packed, ctxs = [], []
        for _, p in items:
            g = p.grad
            values, ctx = self.dense.compression.compress(g._values())
            index_bits = _bitcast(g._indices().t(), values.dtype)
            row = math.prod(p.shape[g.sparse_dim():])
            packed.append(torch.cat([index_bits, values.reshape(values.shape[0], row)], dim=1))
            ctxs.append(ctx)
        handle = grouped_allgather_async(packed, name="hvdsync.sparse.gather",
                                         process_set=self.dense.process_set)
        wait = _waiter(handle)
        average = self.dense.op == Average

        def finisher(j: int, p: torch.Tensor) -> Callable[[], None]:
            def finish() -> None:
                out = wait()[j]
                k = out.shape[1] - math.prod(p.shape[self._layout[p][2]:])
                indices = _bitcast(out[:, :k], torch.int64).t()
                values = self.dense.compression.decompress(out[:, k:].contiguous(), ctxs[j])
                values = values.reshape(out.shape[0], *p.shape[indices.shape[0]:])
                reduced = torch.sparse_coo_tensor(indices, values, p.shape,
                                                  check_invariants=False).coalesce()
                if average:
                    reduced._values().div_(self.size)
                p.grad = reduced
            return finish

        self._record(items, packed, pendings, finisher)

    def _start_dense(self, items: list[tuple[int, torch.Tensor]],
                     pendings: dict[int, Pending]) -> None:
        buffers, ctxs = [], []
        for _, p in items:
            g = p.grad
            s = g.sparse_dim()
            rows = math.prod(p.shape[:s])
            buf = g._values().new_zeros((rows, math.prod(p.shape[s:]) + 1))
            flat = _flat_rows(g._indices(), p.shape[:s])
            buf[flat, :-1] = g._values().reshape(flat.shape[0], buf.shape[1] - 1)
            buf[flat, -1] = 1  # "present": which rows any rank touched
            compressed, ctx = self.dense.compression.compress(buf)
            buffers.append(compressed)
            ctxs.append(ctx)
        handle = grouped_allreduce_async_(buffers, name="hvdsync.sparse.dense", op=self.dense.op,
                                          prescale_factor=self.dense.prescale,
                                          postscale_factor=self.dense.postscale,
                                          process_set=self.dense.process_set)
        wait = _waiter(handle)

        def finisher(j: int, p: torch.Tensor) -> Callable[[], None]:
            def finish() -> None:
                out = self.dense.compression.decompress(wait()[j], ctxs[j])
                s = self._layout[p][2]
                present = out[:, -1].nonzero().squeeze(1)
                values = out[present, :-1].reshape(present.shape[0], *p.shape[s:])
                indices = torch.stack(torch.unravel_index(present, p.shape[:s]))
                p.grad = torch.sparse_coo_tensor(indices, values.to(p.dtype), p.shape,
                                                 is_coalesced=True)
            return finish

        self._record(items, buffers, pendings, finisher)

    def _record(self, items, sent: list[torch.Tensor], pendings: dict[int, Pending],
                finisher: Callable[[int, torch.Tensor], Callable[[], None]]) -> None:
        """Attach each gradient's finisher and bytes to its layer's pending; the grouped
        collective counts once."""
        for j, ((li, p), t) in enumerate(zip(items, sent)):
            pending = pendings[li]
            pending.finishers.append(finisher(j, p))
            pending.nbytes += t.numel() * t.element_size()
        pendings[items[0][0]].collectives += 1


def _waiter(handle) -> Callable[[], list[torch.Tensor]]:
    """Synchronize a grouped handle once and share its outputs among the finishers."""
    outputs: list[list[torch.Tensor]] = []

    def wait() -> list[torch.Tensor]:
        if not outputs:
            outputs.append(synchronize(handle))
        return outputs[0]
    return wait


def _bitcast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a 2-D tensor's rows as ``dtype`` (bit for bit; the row width scales)."""
    width = t.shape[1] * t.element_size() // dtype.itemsize
    return t.contiguous().flatten().view(dtype).reshape(t.shape[0], width)


def _flat_rows(indices: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Row numbers of ``indices`` (``[sparse_dim, n]``) in the flattened sparse dimensions."""
    flat = indices[0]
    for d in range(1, indices.shape[0]):
        flat = flat * shape[d] + indices[d]
    return flat
