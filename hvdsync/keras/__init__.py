"""``import hvdsync.keras as hvd``: Horovod for Keras 3, with hvdsync, on either backend.

TensorFlow backend (``horovodrun``): every public name of ``horovod.tensorflow`` (init, size,
rank, allreduce, Compression, Average, ...), as Horovod's ``horovod.tensorflow.keras`` would
give them on Keras 3, where it does not work. torch backend (``KERAS_BACKEND=torch``,
``torchrun`` or ``horovodrun``): the same names from :mod:`hvdsync.torch`'s engine, no
Horovod build and no TensorFlow needed (:mod:`hvdsync.keras.on_torch`). On both:
``DistributedOptimizer`` (for ``model.compile``/``model.fit``), :mod:`hvdsync.keras.callbacks`
(broadcast, metric average, learning-rate warm-up, ``SyncStatsCallback``, ``FlushCallback``),
``broadcast_variables``, ``load_model``, ``save_model``, the config classes and, where Horovod
is installed, ``elastic``. docs/keras.md says which backend to choose.
"""

import os as _os

_SUPPORTED = ("tensorflow", "torch")
try:
    import keras as _keras
except ImportError as _e:  # e.g. KERAS_BACKEND=jax without JAX installed
    if _os.environ.get("KERAS_BACKEND", "tensorflow") in _SUPPORTED:
        raise
    _keras = None
_BACKEND = _keras.backend.backend() if _keras is not None else _os.environ["KERAS_BACKEND"]
#: hvdsync.torch's names that are Horovod's API, given on the torch backend
_TORCH_NAMES = ("init", "backend_name", "Compression", "Average", "Sum", "Adasum", "Min", "Max",
                "Product", "node_process_sets")
#: what to use where Horovod Elastic cannot run: Horovod is not installed
_NO_ELASTIC = "torchrun --max-restarts with hvd.save_model checkpoints (docs/elastic.md)"

if _BACKEND == "torch":
    import hvdsync.torch as _hvd_torch
    globals().update({_n: getattr(_hvd_torch, _n)
                      for _n in _hvd_torch._DISPATCHED + _TORCH_NAMES})
    from hvdsync.keras.on_torch import DistributedOptimizer  # noqa: E402,F401

    def __getattr__(name: str):
        if name in _hvd_torch._LAZY:  # (their meaning depends on the engine)
            return getattr(_hvd_torch, name)
        if name == "elastic":  # Horovod's, so only where Horovod is installed
            try:
                import hvdsync.keras.elastic as elastic
            except ImportError as e:
                raise AttributeError("hvdsync.keras.elastic is Horovod Elastic: it needs "
                                     "Horovod (scripts/install_horovod.sh) and horovodrun; "
                                     f"without them, use {_NO_ELASTIC}") from e
            return elastic
        raise AttributeError(f"module 'hvdsync.keras' has no attribute {name!r}")
elif _BACKEND == "tensorflow":
    try:
        import horovod.tensorflow as _horovod_tf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "hvdsync.keras on the TensorFlow backend needs Horovod built with TensorFlow "
            "support: run scripts/install_horovod.sh from the hvdsync repository (README.md), "
            "or use Keras' torch backend (KERAS_BACKEND=torch) under torchrun, which needs no "
            f"Horovod (docs/keras.md). Original error: {e}") from e
    # every name but ``elastic``: hvdsync.keras.elastic is Horovod's, on Keras 3, knowing hvdsync
    globals().update({k: v for k, v in vars(_horovod_tf).items()
                      if not k.startswith("_") and k != "elastic"})
    from hvdsync.keras import elastic  # noqa: E402,F401
    from hvdsync.keras.nodes import node_process_sets  # noqa: E402,F401 - between="nodes"
    from hvdsync.keras.optimizer import DistributedOptimizer  # noqa: E402,F401,F811
else:  # (JAX, NumPy, OpenVINO: no per-layer hooks, no collectives hvdsync can start)
    raise ImportError(
        f"hvdsync.keras runs on Keras' TensorFlow or torch backend; KERAS_BACKEND is "
        f"{_BACKEND!r}. Set KERAS_BACKEND=torch and launch with torchrun (no Horovod needed), "
        "or KERAS_BACKEND=tensorflow with horovodrun (docs/keras.md)")

from hvdsync.safety.agreement import RanksDisagree  # noqa: E402
from hvdsync.techniques.clip import ClipConfig
from hvdsync.techniques.delay import DelayConfig
from hvdsync.keras import callbacks  # noqa: E402
from hvdsync.keras.callbacks import broadcast_variables  # noqa: E402,F811
from hvdsync.keras.saving import load_model, save_model  # noqa: E402
from hvdsync.techniques.lowrank import LowRankConfig
from hvdsync.techniques.select import SelectConfig
from hvdsync.techniques.sparse import SparseConfig
from hvdsync.core.stats import SyncStats  # noqa: E402
from hvdsync.techniques.threshold import ThresholdConfig
