"""``sparse=``: the sparse grouped allgather for row-sparse gradients, counts first (a
transport; docs/sparse.md). The adapter builds it over its row-sparse primitives."""

from hvdsync.techniques.sparse.config import SparseConfig
from hvdsync.techniques.sparse.exchange import Sparse

CONFIG = SparseConfig


def build(config: SparseConfig, parts) -> Sparse:
    return parts.sparse_exchange(config)


__all__ = ["CONFIG", "SparseConfig", "Sparse", "build"]
