"""``import hvdsync.torch as hvd``: a drop-in for ``import horovod.torch as hvd``.

Every public name of ``horovod.torch`` (init, size, rank, local_rank, allreduce, allgather,
broadcast_parameters, broadcast_optimizer_state, Compression, Average, Sum, ...) is
re-exported unchanged; ``DistributedOptimizer`` is hvdsync's (same arguments, same results
with no technique enabled, plus hvdsync's options and ``stats``).
"""

try:
    import horovod.torch as _horovod_torch
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hvdsync.torch needs Horovod built with PyTorch support. Horovod 0.28.1 does not build "
        "as-is on current torch; run scripts/install_horovod.sh from the hvdsync repository "
        f"(see README.md). Original error: {e}") from e

# Re-export horovod.torch's public API exactly as Horovod has it.
globals().update({k: v for k, v in vars(_horovod_torch).items() if not k.startswith("_")})

from hvdsync.clipping import ClipConfig  # noqa: E402
from hvdsync.stats import SyncStats  # noqa: E402
from hvdsync.torch.optimizer import DistributedOptimizer  # noqa: E402,F811
