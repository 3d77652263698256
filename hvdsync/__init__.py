"""hvdsync: communication-efficient drop-in optimizer wrappers for Horovod.

Import the framework adapter you need; this top-level package holds the framework-neutral
core -- the technique interface and the step pipeline, the rulebook, the techniques, layer
grouping, statistics, checkpoints (docs/design.md) -- and imports neither torch nor
TensorFlow::

    import hvdsync.torch as hvd      # instead of: import horovod.torch as hvd
"""

from hvdsync.clipping import ClipConfig
from hvdsync.delay import DelayConfig
from hvdsync.layers import Layer, build_layers
from hvdsync.lowrank import LowRankConfig
from hvdsync.select import SelectConfig
from hvdsync.sparse import SparseConfig
from hvdsync.stats import SyncStats
from hvdsync.threshold import ThresholdConfig

__version__ = "0.1.0"

__all__ = ["ClipConfig", "DelayConfig", "Layer", "LowRankConfig", "SelectConfig", "SparseConfig",
           "SyncStats", "ThresholdConfig", "build_layers", "__version__"]
