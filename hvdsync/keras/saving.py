"""Loading models saved with hvdsync's Keras optimizer.

``model.save()`` writes the wrapped optimizer as the optimizer class it wraps (its variables
included), so the file loads with plain ``keras.models.load_model`` too. hvdsync's own state
(docs/checkpoints.md) is stored beside the optimizer's variables under ``hvdsync.*`` keys:
plain Keras then skips the optimizer's variables with a warning (the model's weights load),
while :func:`load_model` restores everything, wrapping the optimizer again with the options
given.
"""

from __future__ import annotations

from typing import Any, Optional

import keras

from hvdsync.keras import collectives
from hvdsync.keras.callbacks import _hvdsync_optimizer


def load_model(filepath: str, custom_optimizers: Optional[list] = None,
               custom_objects: Optional[dict] = None, compile: bool = True,
               **hvdsync_options: Any):
    """Load a model saved with ``model.save()`` and wrap its optimizer in
    :func:`hvdsync.keras.DistributedOptimizer` with ``hvdsync_options`` (Horovod's and
    hvdsync's arguments: ``compression=``, ``clip=``, ``threshold=``, ...), restoring the
    wrapper's saved state too. As Horovod's ``load_model``: ``custom_optimizers`` lists your
    own optimizer classes to wrap as well.
    """
    from hvdsync.keras import DistributedOptimizer  # (this backend's)
    classes = [c for c in vars(keras.optimizers).values()
               if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)]
    classes += list(custom_optimizers or [])

    def loader(base: type) -> type:
        class Wrapping:
            @classmethod
            def from_config(cls, config, custom_objects=None):
                return DistributedOptimizer(base.from_config(config), **hvdsync_options)
        Wrapping.__name__ = base.__name__
        return Wrapping

    objects = {c.__name__: loader(c) for c in classes}
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects, compile=compile)


def save_model(model, filepath: str, root_rank: int = 0, **kwargs: Any) -> None:
    """``model.save(filepath, **kwargs)`` on ``root_rank``, with every rank's own hvdsync
    memory in the file (``hvd.load_model`` then gives each rank its own back; a plain
    ``model.save`` on one rank holds that rank's, which ``load_model`` drops on every rank).
    A collective: call it on every rank; every rank returns once the file is written. With
    ``delay=``, call ``optimizer.flush()`` first (replicas identical)."""
    from hvdsync.safety import checkpoint

    opt = _hvdsync_optimizer(model)  # (the one a LossScaleOptimizer wraps: mixed precision)
    hv = getattr(opt, "_hv", None)  # (hvdsync's optimizer, on either backend)
    process_set = hv.process_set if hv is not None else collectives.global_set()
    if hv is not None and opt.built and process_set.size() > 1:  # refused where ranks differ
        hv.comm.entries.begin("save", hv.stats.total.step)
        hv.comm.entries.now("save_model's gather")
    if hv is not None and opt.built and opt._configured:
        own = checkpoint.per_rank_part(opt._configured, opt.technique_state())
        # as arrays and JSON, never pickles: nothing another rank sends runs code here
        hv.every_rank = [checkpoint.state_from_bytes(b) for b in collectives.gather_bytes(
            checkpoint.state_bytes(own), "hvdsync.checkpoint.save", process_set)]
    try:
        if process_set.rank() == root_rank:
            model.save(filepath, **kwargs)
    finally:
        if hv is not None:
            hv.every_rank = None
    collectives.gather_bytes(b"", "hvdsync.checkpoint.written", process_set)  # written for all
