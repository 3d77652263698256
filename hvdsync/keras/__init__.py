"""``import hvdsync.keras as hvd``: Horovod for Keras 3 (TensorFlow backend), with hvdsync.

Horovod's ``horovod.tensorflow.keras`` does not work with Keras 3; this module offers the same
names on ``horovod.tensorflow`` ops: every public name of ``horovod.tensorflow`` (init, size,
rank, local_rank, allreduce, allgather, broadcast, Compression, Average, Sum, ...), plus
``DistributedOptimizer`` (hvdsync's, for ``model.compile``/``model.fit``), ``callbacks``
(:class:`~hvdsync.keras.callbacks.BroadcastGlobalVariablesCallback`,
:class:`~hvdsync.keras.callbacks.MetricAverageCallback`,
:class:`~hvdsync.keras.callbacks.LearningRateWarmupCallback`,
:class:`~hvdsync.keras.callbacks.SyncStatsCallback`,
:class:`~hvdsync.keras.callbacks.FlushCallback`), ``elastic`` (Horovod Elastic on Keras 3:
:mod:`hvdsync.keras.elastic`), ``broadcast_variables`` and ``load_model``.
"""

try:
    import horovod.tensorflow as _horovod_tf
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hvdsync.keras needs Horovod built with TensorFlow support. Horovod 0.28.1 does not "
        "build as-is on current TensorFlow; run scripts/install_horovod.sh from the hvdsync "
        f"repository (see README.md). Original error: {e}") from e

# every name but ``elastic``: hvdsync.keras.elastic is Horovod's, on Keras 3, knowing hvdsync
globals().update({k: v for k, v in vars(_horovod_tf).items()
                  if not k.startswith("_") and k != "elastic"})

from hvdsync.agreement import RanksDisagree  # noqa: E402
from hvdsync.clipping import ClipConfig  # noqa: E402
from hvdsync.delay import DelayConfig  # noqa: E402
from hvdsync.keras import callbacks  # noqa: E402
from hvdsync.keras import elastic  # noqa: E402
from hvdsync.keras.callbacks import broadcast_variables  # noqa: E402,F811
from hvdsync.keras.optimizer import DistributedOptimizer  # noqa: E402,F811
from hvdsync.keras.saving import load_model, save_model  # noqa: E402
from hvdsync.lowrank import LowRankConfig  # noqa: E402
from hvdsync.select import SelectConfig  # noqa: E402
from hvdsync.sparse import SparseConfig  # noqa: E402
from hvdsync.stats import SyncStats  # noqa: E402
from hvdsync.threshold import ThresholdConfig  # noqa: E402
