"""hvdsync's own state in a checkpoint: one format for both adapters (docs/checkpoints.md).

torch puts it under ``optimizer.state_dict()["hvdsync"]``; Keras stores it beside the
optimizer's variables in ``model.save()`` files (packed by :func:`pack_state`). Either way::

    {"format": 1,
     "params": ["<shape> <dtype>", ...],   # the optimized parameters, in layer order
     "rank": r, "world_size": n,           # who wrote it
     "techniques": {"clip": {...}, "threshold": {...}, ...}}

Each technique's entry is its ``state_dict()`` (:mod:`hvdsync.technique`): plain data and
tensors (torch tensors in torch, numpy arrays once a Keras file is written), memory keyed by
a parameter's position in layer order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hvdsync.technique import Technique

FORMAT = 1
STATE_KEY = "hvdsync."


def state_of(techniques: Sequence[Technique], params: Sequence[str], rank: int,
             world_size: int) -> dict:
    """The checkpoint entry of a wrapped optimizer's techniques."""
    return {"format": FORMAT, "params": list(params), "rank": rank, "world_size": world_size,
            "techniques": {t.name: t.state_dict() for t in techniques}}


def load_into(techniques: Sequence[Technique], state: Mapping[str, Any],
              params: Sequence[str]) -> None:
    """Restore ``state`` (from :func:`state_of`) into ``techniques``. A technique configured
    here but absent from ``state`` forgets its memory; state of a technique not configured
    here, another format or other parameters raise ``ValueError``."""
    if state.get("format") != FORMAT:
        raise ValueError(f"hvdsync state of format {state.get('format')!r}; this hvdsync reads "
                         f"format {FORMAT}")
    saved = list(state["params"])
    if saved != list(params):
        diff = next((i for i, (a, b) in enumerate(zip(saved, params)) if a != b),
                    min(len(saved), len(params)))
        raise ValueError(f"the hvdsync state was saved for {len(saved)} parameters, this "
                         f"optimizer has {len(params)}; first difference at parameter #{diff}: "
                         f"{_at(saved, diff)} saved, {_at(params, diff)} here")
    by_name = {t.name: t for t in techniques}
    for name in state["techniques"]:
        if name not in by_name:
            raise ValueError(f"the saved optimizer has hvdsync {name}= state but this one was "
                             f"not built with {name}=; pass the same options")
    for t in techniques:
        if t.name in state["techniques"]:
            t.load_state_dict(state["techniques"][t.name])
        else:
            t.forget()


def _at(xs: Sequence[str], i: int) -> str:
    return repr(xs[i]) if i < len(xs) else "nothing"


def signature(shape: Sequence[int], dtype: Any) -> str:
    """A parameter as the checkpoint records it: ``"(3, 4) float32"``."""
    return f"{tuple(int(d) for d in shape)} {str(dtype).removeprefix('torch.')}"


# -- Keras weights stores hold arrays only ------------------------------------------------------
def pack_state(state: dict) -> dict[str, np.ndarray]:
    """A nested dict of JSON values and arrays as ``{key: array}``: the structure as UTF-8
    JSON bytes, each array (anything with ``.numpy()``, or a numpy array) under its own key."""
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


def unpack_state(store: Mapping[str, Any]) -> dict:
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
