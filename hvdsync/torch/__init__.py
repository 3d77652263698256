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

from hvdsync.agreement import RanksDisagree  # noqa: E402
from hvdsync.clipping import ClipConfig  # noqa: E402
from hvdsync.delay import DelayConfig  # noqa: E402
from hvdsync.lowrank import LowRankConfig  # noqa: E402
from hvdsync.select import SelectConfig  # noqa: E402
from hvdsync.sparse import SparseConfig  # noqa: E402
from hvdsync.stats import SyncStats  # noqa: E402
from hvdsync.threshold import ThresholdConfig  # noqa: E402
from hvdsync.torch.optimizer import DistributedOptimizer  # noqa: E402,F811
from hvdsync.torch.optimizer import _DistributedOptimizer  # noqa: E402
from hvdsync.torch.saving import (broadcast_technique_state, load_checkpoint,  # noqa: E402
                                  save_checkpoint)


def broadcast_optimizer_state(optimizer, root_rank, model=None, **kwargs):  # noqa: F811
    """Horovod's ``broadcast_optimizer_state``, also for hvdsync's optimizer, and for its
    techniques' state: every rank gets ``root_rank``'s shared technique state (a checkpoint
    loaded on ``root_rank`` only reaches every rank); per-rank memory is not broadcast, so
    none is kept (docs/checkpoints.md).

    Horovod initialises an empty optimizer state by calling ``step()`` on zero gradients; on
    hvdsync's optimizer that step must stay local (no collectives, no stats, no technique
    state), as Horovod arranges for its own optimizer.
    """
    if not isinstance(optimizer, _DistributedOptimizer):
        return _horovod_torch.broadcast_optimizer_state(optimizer, root_rank, model, **kwargs)
    with optimizer.skip_synchronize():
        _horovod_torch.broadcast_optimizer_state(optimizer, root_rank, model, **kwargs)
    broadcast_technique_state(optimizer, root_rank)
