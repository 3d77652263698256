"""hvdsync: communication-efficient drop-in optimizer wrappers for Horovod.

Import the framework adapter you need; this top-level package names the techniques' configs,
the layer grouping and the statistics, and imports neither torch nor TensorFlow. Its
folders are its layers (docs/internals.md): ``core`` (the interfaces and one step),
``safety``, ``techniques`` (one package each), the adapters ``torch`` and ``keras``, and
``tools`` and ``testing`` beside the product::

    import hvdsync.torch as hvd      # instead of: import horovod.torch as hvd
"""

from hvdsync.techniques.clip import ClipConfig
from hvdsync.techniques.delay import DelayConfig
from hvdsync.core.layers import Layer, build_layers
from hvdsync.techniques.lowrank import LowRankConfig
from hvdsync.techniques.select import SelectConfig
from hvdsync.techniques.sparse import SparseConfig
from hvdsync.core.stats import SyncStats
from hvdsync.techniques.threshold import ThresholdConfig

__version__ = "0.1.0"

__all__ = ["ClipConfig", "DelayConfig", "Layer", "LowRankConfig", "SelectConfig", "SparseConfig",
           "SyncStats", "ThresholdConfig", "build_layers", "__version__"]
