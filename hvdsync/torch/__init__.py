"""``import hvdsync.torch as hvd``: a drop-in for ``import horovod.torch as hvd``, on Horovod or,
without it, on ``torch.distributed`` (``torchrun``).

Every name of Horovod's ``horovod.torch`` (0.28.1) is here and behaves as Horovod's on whichever
engine :mod:`hvdsync.torch.engine` chose (``hvd.init(backend=...)``, ``HVDSYNC_BACKEND``, or
the launcher); ``hvd.backend_name()`` says which. On Horovod they are Horovod's own; on the
torch engine :mod:`hvdsync.torch.c10d`'s; ``join`` knows hvdsync's optimizer on both
(:mod:`hvdsync.torch.joined`).
hvdsync's own: ``DistributedOptimizer`` (same arguments, same results with no technique
enabled, plus hvdsync's options and ``stats``), ``SyncBatchNorm`` (also on CPU tensors),
``elastic`` (Horovod's Elastic knowing hvdsync's optimizer, docs/elastic.md). The table of
names: docs/backends.md.
"""

from typing import Any as _Any

from hvdsync.torch import engine as _engine

try:
    import horovod.torch as _horovod_torch
except ImportError:  # the torch backend only (docs/install.md)
    _horovod_torch = None

# names whose meaning depends on the backend: resolved at each call (module __getattr__),
# never bound to one backend at import
_LAZY = ("ProcessSet", "global_process_set", "HorovodInternalError")
# Horovod's names hvdsync has its own for, on either engine: Elastic knowing hvdsync's
# optimizer, a SyncBatchNorm that also runs on CPU tensors, the modules of the torch engine
_OWN = ("elastic", "SyncBatchNorm", "sync_batch_norm", "functions", "compression")
_DISPATCHED = (
    "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank", "local_rank",
    "cross_rank", "barrier", "poll", "synchronize", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "allgather_object", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_parameters", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "add_process_set", "remove_process_set", "start_timeline", "stop_timeline",
    "check_extension", "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built",
    "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built")
#: Horovod's modules of its compiled extension: no counterpart on the torch engine
_EXTENSION = ("mpi_ops", "mpi_lib_v2")

if _horovod_torch is not None:  # Horovod's whole public API, as Horovod has it ...
    globals().update({k: v for k, v in vars(_horovod_torch).items()
                      if not k.startswith("_") and k not in _LAZY + _OWN})
else:
    from hvdsync.torch.c10d import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
    from hvdsync.torch.compression import Compression  # noqa: F401


def _dispatch(name: str):
    def call(*args: _Any, **kwargs: _Any) -> _Any:
        return getattr(_engine.ops(), name)(*args, **kwargs)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"Horovod's ``{name}``, on the active backend (``hvd.backend_name()``)."
    return call


# ... with the calls routed to the active backend
globals().update({_name: _dispatch(_name) for _name in _DISPATCHED})


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        return getattr(_engine.ops(), name)
    if name in _EXTENSION:
        raise AttributeError(f"hvd.{name} is a module of Horovod's compiled extension, which the "
                             "torch engine has not: call the same function on hvd itself "
                             "(docs/backends.md)")
    raise AttributeError(f"module 'hvdsync.torch' has no attribute {name!r}")


def init(*args: _Any, backend: str | None = None, **kwargs: _Any) -> None:
    """Horovod's ``init``, on ``backend`` (``"horovod"`` or ``"torch"``; default: the
    ``HVDSYNC_BACKEND`` environment variable, else by launcher, see
    :mod:`hvdsync.torch.engine`)."""
    _engine.select(backend).init(*args, **kwargs)


def backend_name() -> str:
    """``"horovod"`` or ``"torch"``: which engine this process's collectives run on."""
    return _engine.active_name()


from hvdsync.safety.agreement import RanksDisagree  # noqa: E402
from hvdsync.techniques.clip import ClipConfig
from hvdsync.techniques.delay import DelayConfig
from hvdsync.techniques.lowrank import LowRankConfig
from hvdsync.techniques.select import SelectConfig
from hvdsync.techniques.sparse import SparseConfig
from hvdsync.core.stats import SyncStats  # noqa: E402
from hvdsync.techniques.threshold import ThresholdConfig
from hvdsync.torch.optimizer import DistributedOptimizer  # noqa: E402,F811
from hvdsync.torch.joined import join  # noqa: E402 - Horovod's, knowing hvdsync's optimizer
from hvdsync.torch.nodes import node_process_sets  # noqa: E402 - between="nodes" on Horovod
from hvdsync.torch.saving import (UntrustedCheckpoint, broadcast_technique_state,  # noqa: E402
                                  broadcast_optimizer_state,
                                  load_checkpoint,
                                  save_checkpoint)
from hvdsync.torch import elastic  # noqa: E402 - Horovod's, knowing hvdsync's optimizer
from hvdsync.torch import compression, functions, sync_batch_norm  # noqa: E402,F401
from hvdsync.torch.sync_batch_norm import SyncBatchNorm  # noqa: E402,F401

elastic.install()

