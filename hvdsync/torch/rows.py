"""Row-sparse gradients in torch -- sparse COO tensors (``nn.Embedding(sparse=True)``,
``nn.EmbeddingBag(sparse=True)``) -- as :class:`hvdsync.techniques.sparse.ports.RowSparse`: what the core's
sparse exchange (hvdsync/techniques/sparse/exchange.py) packs, scatters and sums. Rows travel in the
communicator's compression (fp16 halves them), their int64 indices bit for bit."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hvdsync.techniques.sparse.config import SparseConfig
from hvdsync.techniques.sparse.exchange import Sparse
from hvdsync.core.stats import SyncStats
from hvdsync.torch.backend import TorchGradients
from hvdsync.torch.comm import TorchCommunicator


def row_exchange(config: SparseConfig, grads: TorchGradients, comm: TorchCommunicator,
                 stats: SyncStats) -> Sparse:
    """The core's exchange of row-sparse gradients over torch's parameters."""
    rows = TorchRows(comm.compression)
    params = [p for layer in grads.layer_params for _, p in layer]
    return Sparse(config, grads, comm, rows, stats,
                          [n for layer in grads.layer_params for n, _ in layer],
                          [p.shape for p in params], [rows.wire_itemsize(p) for p in params],
                          len(grads.layer_params))


class TorchRows:
    """:class:`hvdsync.techniques.sparse.ports.RowSparse` over torch sparse COO gradients."""

    def __init__(self, compression: Any):
        self.compression = compression

    def wire_itemsize(self, p: torch.Tensor) -> int:
        """The element size ``p``'s rows travel in (after compression)."""
        return self.compression.compress(p.new_empty(0))[0].element_size()

    @staticmethod
    def coalesce(g: torch.Tensor) -> tuple[torch.Tensor, int]:
        if g.is_coalesced():
            return g, 0
        merged = g.coalesce()
        return merged, g._nnz() - merged._nnz()

    def layout(self, g: torch.Tensor) -> tuple[int, int]:
        return self.coalesce(g)[0]._nnz(), g.sparse_dim()

    @staticmethod
    def row_count(g: torch.Tensor) -> int:
        return g._nnz()

    @staticmethod
    def empty(like: torch.Tensor, sparse_dim: int) -> torch.Tensor:
        return torch.sparse_coo_tensor(
            torch.empty(sparse_dim, 0, dtype=torch.int64, device=like.device),
            like.new_empty((0, *like.shape[sparse_dim:])), like.shape, is_coalesced=True,
            check_invariants=False)

    @staticmethod
    def as_rows(g: torch.Tensor, sparse_dim: int) -> torch.Tensor:
        return g.to_sparse(sparse_dim)

    def pack(self, g: torch.Tensor) -> tuple[torch.Tensor, Any]:
        values, ctx = self.compression.compress(g._values())
        flat = values.reshape(values.shape[0], math.prod(values.shape[1:]))
        return torch.cat([flat, _bitcast(g._indices().t(), values.dtype)], dim=1), ctx

    def unpack_summed(self, gathered: torch.Tensor, ctx: Any, shape: tuple, sparse_dim: int,
                      divide_by: int) -> torch.Tensor:
        width = math.prod(shape[sparse_dim:])
        indices = _bitcast(gathered[:, width:], torch.int64).t()
        values = self.compression.decompress(gathered[:, :width].contiguous(), ctx)
        values = values.reshape(gathered.shape[0], *shape[sparse_dim:])
        summed = torch.sparse_coo_tensor(indices, values, shape,
                                         check_invariants=False).coalesce()
        if divide_by != 1:
            summed._values().div_(divide_by)
        return summed

    def scatter(self, g: torch.Tensor, shape: tuple) -> tuple[torch.Tensor, Any]:
        s = g.sparse_dim()
        buffer = g._values().new_zeros((math.prod(shape[:s]), math.prod(shape[s:]) + 1))
        flat = _flat_rows(g._indices(), shape[:s])
        buffer[flat, :-1] = g._values().reshape(flat.shape[0], buffer.shape[1] - 1)
        buffer[flat, -1] = 1
        return self.compression.compress(buffer)

    def present_rows(self, summed: torch.Tensor, ctx: Any, shape: tuple, sparse_dim: int,
                     divide_by: int) -> torch.Tensor:
        out = self.compression.decompress(summed, ctx)
        present = out[:, -1].nonzero().squeeze(1)
        values = out[present, :-1].reshape(present.shape[0], *shape[sparse_dim:])
        if divide_by != 1:
            values = values / divide_by
        indices = torch.stack(torch.unravel_index(present, shape[:sparse_dim]))
        return torch.sparse_coo_tensor(indices, values, shape, is_coalesced=True,
                                       check_invariants=False)  # (rows from nonzero: sorted)

    @staticmethod
    def codes(codes: Sequence[int], like: Any) -> torch.Tensor:
        # int64 as they are: a grouped allgather of torch's engines takes mixed dtypes
        return torch.tensor([list(codes)], dtype=torch.int64)

    @staticmethod
    def codes_of(gathered: torch.Tensor, size: int) -> list[list[int]]:
        return gathered.reshape(size, -1).tolist()

    @staticmethod
    def dtype_key(t: torch.Tensor) -> str:
        return str(t.dtype).removeprefix("torch.")

    @staticmethod
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()


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
