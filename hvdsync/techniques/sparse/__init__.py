"""``sparse=``: the sparse grouped allgather for row-sparse gradients, counts first (a
transport; docs/sparse.md). The adapter builds it over its row-sparse primitives
(``Parts.builds[SparseConfig]``)."""

from hvdsync.techniques.sparse.config import SparseConfig
from hvdsync.techniques.sparse.exchange import Sparse

CONFIG = SparseConfig


def build(config: SparseConfig, parts) -> Sparse:
    """Only an adapter can: the exchange runs over its row-sparse primitives."""
    raise TypeError("sparse= needs the adapter's row-sparse primitives: the adapter builds it "
                    "(Parts.builds[SparseConfig])")


__all__ = ["CONFIG", "SparseConfig", "Sparse", "build"]
