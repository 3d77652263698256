"""``sparse=`` for torch: the sparse grouped allgather as a transport (the protocol -- layouts,
shared counts, routes, one round or counts first -- is :class:`hvdsync.sparse.SparseProtocol`;
this file moves torch's tensors).

Row-sparse gradients are torch sparse COO tensors (``nn.Embedding(sparse=True)``,
``nn.EmbeddingBag(sparse=True)``). A gradient with ``c`` distinct rows travels as one
``[c, k + row]`` tensor in the (compressed) value dtype: ``k`` columns carry the int64
indices bit for bit, ``row`` the row's values -- one allgather per gradient instead of
Horovod's two, and all gradients of the step in one grouped call. These parameters go every
step (deciders govern the dense ones); they are queued as their layers become ready and sent
together after backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from hvdsync.sparse import (ABSENT, DENSE, SparseConfig, SparseProtocol, SparseRoute,
                            SparseTransport)
from hvdsync.stats import SyncStats
from hvdsync.pending import Pending
from hvdsync.torch.backend import TorchGradients
from hvdsync.torch.comm import TorchCommunicator
from hvdsync.watchdog import guard

_INDEX_BYTES = 8  # torch sparse indices are int64


class _Sends:
    """What one layer waits for in this exchange (finishers and counts)."""

    def __init__(self) -> None:
        self.finishers: list[Callable[[], None]] = []
        self.nbytes = 0
        self.collectives = 0

    def pending(self) -> Pending:
        finishers = self.finishers
        return Pending(lambda: [f() for f in finishers] and None, None, self.nbytes,
                       self.collectives, what="the sparse exchange")


class SparseExchange(SparseTransport):
    """Moves the sparse gradients of one step; uses ``dense``'s compression, op and scale
    factors. Per step: :meth:`backward_done` takes every parameter's layout (counts-first
    protocol: shares them at once), :meth:`start_early` (one-round protocol) sends the
    gradients whose route the last step predicted together with the layouts, and
    :meth:`flush` sends the rest by this step's shared counts."""

    def __init__(self, config: SparseConfig, grads: TorchGradients, dense: TorchCommunicator,
                 stats: SyncStats):
        self.config = config
        self.grads = grads
        self.dense = dense
        self.stats = stats
        self._params: list[tuple[str, torch.Tensor]] = [
            item for layer in grads.layer_params for item in layer]
        self._layer_of = {p: li for li, layer in enumerate(grads.layer_params) for _, p in layer}
        self._position = {p: i for i, (_, p) in enumerate(self._params)}
        self.protocol = SparseProtocol(config, [n for n, _ in self._params], stats)
        self._queue: list[tuple[int, torch.Tensor]] = []
        self._done: set[torch.Tensor] = set()

    @property
    def size(self) -> int:
        """The ranks now (the dense communicator's: it changes under Horovod Elastic)."""
        return self.dense.size

    # -- the transport's moments ----------------------------------------------------------------
    def owns(self, li: int, k: int) -> bool:
        return self.grads.is_row_sparse(li, k)

    def layer_ready(self, li: int, ks: list[int]) -> None:
        for k in ks:  # before clipping, so the duplicates are counted
            self.coalesce(self.grads.param(li, k))

    def start(self, li: int, ks: list[int]) -> None:
        self._queue += [(li, self.grads.param(li, k)) for k in ks]

    def fill(self, li: int, k: int):
        p = self.grads.param(li, k)
        return self.empty_gradient(p) if self.is_sparse(p) else None

    def backward_done(self) -> None:
        self._done = set()
        self.begin()

    def holds(self, li: int) -> bool:
        """One-round protocol: a parameter with no gradient here that was never seen with one
        anywhere (sparse or dense is unknown) waits for the shared layouts."""
        return any(self.protocol.holds(self._position[p], p.grad is not None)
                   for _, p in self.grads.layer_params[li])

    def start_early(self) -> dict[int, Pending]:
        if not self.config.one_round:
            return {}
        items = [(self._layer_of[p], p) for i, (_, p) in enumerate(self._params)
                 if i in self.protocol.predicted]
        sends = self.start_predicted(items)
        self._done = {p for _, p in items}
        return {li: s.pending() for li, s in sends.items()}

    def flush(self) -> dict[int, Pending]:
        # in the fixed parameter order: layers became ready in a different order on each rank
        items = sorted(((li, p) for li, p in self._queue if p not in self._done),
                       key=lambda item: self._position[item[1]])
        self._queue = []
        if not items:
            return {}
        return {li: s.pending() for li, s in self._start_routed(items).items()}

    # -- stage 1 ----------------------------------------------------------------------------
    def begin(self) -> None:
        """Sum local duplicate rows and take every parameter's layout code. Counts-first
        protocol: share them now (one collective)."""
        local = []
        for _, p in self._params:
            g = p.grad
            if g is None:
                local.append((ABSENT, 0))
            elif g.is_sparse:
                g = self.coalesce(p)
                local.append((g._nnz(), g.sparse_dim()))
            else:
                local.append((DENSE, 0))
        codes = self.protocol.begin(local)
        if not self.config.one_round:
            local_codes = torch.tensor([codes], dtype=torch.int64)
            if self.size == 1:
                self.protocol.absorb(local_codes.tolist())
            else:
                with guard("the sparse layouts allgather 'hvdsync.sparse.layouts'"):
                    self.protocol.absorb(self.dense.ops.allgather(
                        local_codes, name="hvdsync.sparse.layouts",
                        process_set=self.dense.process_set).tolist())
                self.stats.control(local_codes.numel() * _INDEX_BYTES)

    def coalesce(self, p: torch.Tensor) -> torch.Tensor:
        """Sum ``p``'s duplicate gradient rows (counted in ``sparse_duplicate_rows``)."""
        g = p.grad
        if not g.is_coalesced():
            before = g._nnz()
            p.grad = g = g.coalesce()
            self.stats.count("sparse_duplicate_rows", before - g._nnz())
        return g

    def is_sparse(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient travels sparse this step (:meth:`SparseProtocol.is_sparse`)."""
        return self.protocol.is_sparse(self._position[p])

    def _sparse_dim(self, p: torch.Tensor) -> int:
        return self.protocol.sparse_dim(self._position[p])

    def empty_gradient(self, p: torch.Tensor) -> torch.Tensor:
        """A sparse gradient with no rows, for a rank on which ``p`` was not used while others
        have rows: it takes part in the collectives with zero rows."""
        s = self._sparse_dim(p)
        return torch.sparse_coo_tensor(torch.empty(s, 0, dtype=torch.int64, device=p.device),
                                       p.new_empty((0, *p.shape[s:])), p.shape,
                                       is_coalesced=True)

    def end_step(self, ok: bool) -> None:
        """One-round protocol: next step's routes from this step's shared counts."""
        def rows(i: int) -> int:
            g = self._params[i][1].grad
            return g._nnz() if g is not None and g.is_sparse else 0
        self.protocol.end_step(lambda i: self._route(self._params[i][1]).route, rows)
        self._done = set()

    def status(self) -> dict:
        return dict(self.protocol.last_routes)

    # -- stages 2 and 3 ---------------------------------------------------------------------
    def start_predicted(self, items: Sequence[tuple[int, torch.Tensor]]) -> dict[int, _Sends]:
        """One-round protocol: send this rank's layout codes together with the gradients of
        ``items`` (every parameter the protocol predicted, in a fixed order) in **one** grouped
        allgather, routed as predicted from the last step's counts; gradients predicted dense
        go in one grouped allreduce at the same time. Returns when the layouts are shared."""
        pendings: dict[int, _Sends] = {}
        gather, dense = [], []
        for li, p in items:
            pendings.setdefault(li, _Sends())
            if p.grad is None:
                p.grad = self.empty_gradient(p)
            elif not p.grad.is_sparse:  # dense here, sparse elsewhere: raises after the gather
                p.grad = p.grad.to_sparse(self._sparse_dim(p))
            i = self._position[p]
            route = "dense" if self.protocol.predicted[i] == "dense" else "gather"
            self.protocol.take(i, route)
            (dense if route == "dense" else gather).append((li, p))
        codes = torch.tensor([self.protocol.codes], dtype=torch.int64)
        if self.size == 1:
            self.protocol.absorb(codes.tolist())
            return pendings
        if dense:
            self._start_dense(dense, pendings)
        wait = self._start_gather(gather, pendings, header=codes)
        with guard("the sparse rows allgather 'hvdsync.sparse.gather'"):
            self.protocol.absorb(wait()[0].tolist())
        for _, p in gather:
            self.protocol.count_equal(self._position[p])
        return pendings

    def _start_routed(self, items: Sequence[tuple[int, torch.Tensor]]) -> dict[int, _Sends]:
        """Start sending ``(layer index, parameter)`` sparse gradients, in a fixed order, by
        routes from this step's shared counts. Waiting on a layer's sends writes the reduced,
        coalesced gradient into ``p.grad``."""
        pendings: dict[int, _Sends] = {}
        gather: list[tuple[int, torch.Tensor]] = []
        dense: list[tuple[int, torch.Tensor]] = []
        for li, p in items:
            pendings.setdefault(li, _Sends())
            route = self._route(p)
            self.protocol.take(self._position[p], route.route)
            if route.route == "gather":
                self.protocol.count_equal(self._position[p])
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
        i = self._position[p]
        s = self.protocol.sparse_dim(i)
        esize = self._wire_dtype(p).itemsize
        row = math.prod(p.shape[s:])
        return self.protocol.route(i, (row + self._index_columns(s, esize)) * esize,
                                   p.numel() * esize)

    def _wire_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.dense.compression.compress(p.new_empty(0))[0].dtype

    @staticmethod
    def _index_columns(sparse_dim: int, esize: int) -> int:
        if _INDEX_BYTES % esize:
            raise TypeError(f"sparse gradients travel with their indices bit-cast to the value "
                            f"dtype, which needs an element size dividing 8, got {esize}")
        return sparse_dim * _INDEX_BYTES // esize

    def _start_gather(self, items: list[tuple[int, torch.Tensor]], pendings: dict[int, _Sends],
                      header: torch.Tensor | None = None) -> Callable[[], list[torch.Tensor]]:
        """One grouped allgather of the packed gradients (after ``header``, if given: output
        0 is then the gathered header). Returns the shared waiter."""
        packed, ctxs = [], []
        for _, p in items:
            g = p.grad
            values, ctx = self.dense.compression.compress(g._values())
            index_bits = _bitcast(g._indices().t(), values.dtype)
            row = math.prod(p.shape[g.sparse_dim():])
            packed.append(torch.cat([index_bits, values.reshape(values.shape[0], row)], dim=1))
            ctxs.append(ctx)
        first = 0 if header is None else 1
        handle = self.dense.ops.grouped_allgather_async(
            ([] if header is None else [header]) + packed, name="hvdsync.sparse.gather",
            process_set=self.dense.process_set)
        wait = _waiter(handle, self.dense.ops.synchronize)
        average = self.dense.op == self.dense.ops.Average

        def finisher(j: int, p: torch.Tensor) -> Callable[[], None]:
            def finish() -> None:
                out = wait()[first + j]
                k = out.shape[1] - math.prod(p.shape[self._sparse_dim(p):])
                indices = _bitcast(out[:, :k], torch.int64).t()
                values = self.dense.compression.decompress(out[:, k:].contiguous(), ctxs[j])
                values = values.reshape(out.shape[0], *p.shape[indices.shape[0]:])
                reduced = torch.sparse_coo_tensor(indices, values, p.shape,
                                                  check_invariants=False).coalesce()
                if average:
                    reduced._values().div_(self.size)
                p.grad = reduced
            return finish

        if header is not None:
            self.stats.control(header.numel() * header.element_size(), collectives=0 if items else 1)
        if items:
            self._record(items, packed, pendings, finisher)
        return wait

    def _start_dense(self, items: list[tuple[int, torch.Tensor]],
                     pendings: dict[int, _Sends]) -> None:
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
        handle = self.dense.ops.grouped_allreduce_async_(
            buffers, name="hvdsync.sparse.dense", op=self.dense.op,
            prescale_factor=self.dense.prescale, postscale_factor=self.dense.postscale,
            process_set=self.dense.process_set)
        wait = _waiter(handle, self.dense.ops.synchronize)

        def finisher(j: int, p: torch.Tensor) -> Callable[[], None]:
            def finish() -> None:
                out = self.dense.compression.decompress(wait()[j], ctxs[j])
                s = self._sparse_dim(p)
                present = out[:, -1].nonzero().squeeze(1)
                values = out[present, :-1].reshape(present.shape[0], *p.shape[s:])
                indices = torch.stack(torch.unravel_index(present, p.shape[:s]))
                p.grad = torch.sparse_coo_tensor(indices, values.to(p.dtype), p.shape,
                                                 is_coalesced=True)
            return finish

        self._record(items, buffers, pendings, finisher)

    def _record(self, items, sent: list[torch.Tensor], pendings: dict[int, _Sends],
                finisher: Callable[[int, torch.Tensor], Callable[[], None]]) -> None:
        """Attach each gradient's finisher and bytes to its layer's pending; the grouped
        collective counts once."""
        for j, ((li, p), t) in enumerate(zip(items, sent)):
            pending = pendings[li]
            pending.finishers.append(finisher(j, p))
            pending.nbytes += t.numel() * t.element_size()
        pendings[items[0][0]].collectives += 1


def _waiter(handle, synchronize) -> Callable[[], list[torch.Tensor]]:
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
    # A fresh buffer: .contiguous() keeps odd strides on size-1 dimensions, which view rejects.
    flat = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    flat.view(t.shape).copy_(t)
    return flat.view(dtype).view(t.shape[0], width)


def _flat_rows(indices: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Row numbers of ``indices`` (``[sparse_dim, n]``) in the flattened sparse dimensions."""
    flat = indices[0]
    for d in range(1, indices.shape[0]):
        flat = flat * shape[d] + indices[d]
    return flat
