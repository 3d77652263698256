"""Saving and loading models compiled with hvdsync's Keras optimizer.

``model.save()`` writes the wrapped optimizer as the optimizer class it wraps (its variables
included), so the file loads with plain ``keras.models.load_model`` too. The wrapper's own
state (clip statistics, threshold accumulations, select residuals and hypernet, the delay step
counter) is stored beside the optimizer's variables under ``hvdsync.*`` keys: plain Keras then
skips the optimizer's variables with a warning (the model's weights load), while
:func:`load_model` restores everything, wrapping the optimizer again with the options given.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np

STATE_KEY = "hvdsync."


def pack_state(state: dict) -> dict[str, np.ndarray]:
    """A nested dict of JSON values and arrays as ``{key: array}`` for a Keras weights store:
    the structure as UTF-8 JSON bytes, each array under its own key."""
    arrays: list[np.ndarray] = []

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            return {str(k): walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        if isinstance(x, np.ndarray) or hasattr(x, "numpy"):
            arrays.append(np.asarray(x))
            return {"__array__": len(arrays) - 1}
        if isinstance(x, np.generic):
            return x.item()
        return x
    skeleton = json.dumps(walk(state)).encode()
    out = {STATE_KEY + "json": np.frombuffer(skeleton, dtype=np.uint8)}
    out.update({f"{STATE_KEY}{i}": a for i, a in enumerate(arrays)})
    return out


def unpack_state(store: dict[str, np.ndarray]) -> dict:
    """Inverse of :func:`pack_state`."""
    skeleton = json.loads(bytes(np.asarray(store[STATE_KEY + "json"], dtype=np.uint8)).decode())

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {"__array__"}:
                return np.asarray(store[f"{STATE_KEY}{x['__array__']}"])
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x
    return walk(skeleton)


def load_model(filepath: str, custom_optimizers: Optional[list] = None,
               custom_objects: Optional[dict] = None, compile: bool = True,
               **hvdsync_options: Any):
    """Load a model saved with ``model.save()`` and wrap its optimizer in
    :func:`hvdsync.keras.DistributedOptimizer` with ``hvdsync_options`` (Horovod's and
    hvdsync's arguments: ``compression=``, ``clip=``, ``threshold=``, ...), restoring the
    wrapper's saved state too. As Horovod's ``load_model``: ``custom_optimizers`` lists your
    own optimizer classes to wrap as well.
    """
    import keras

    from hvdsync.keras.optimizer import DistributedOptimizer

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
