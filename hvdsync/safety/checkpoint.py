"""hvdsync's own state in a checkpoint: one format for both adapters (docs/checkpoints.md).

torch keeps it in ``optimizer.state_dict()["hvdsync"]``, Keras in ``model.save()`` files::

    {"format": 1,
     "params": ["<shape> <dtype>", ...],   # the optimized parameters, in layer order
     "rank": r, "world_size": n,           # who wrote it
     "techniques": {"clip": {...}, "threshold": {...}, ...},
     "per_rank": [{"threshold": {...}}, ...]}   # optional: every rank's own memory

A keyword's entry holds the ``state_dict()`` of the techniques it builds (``delay=``: two),
plain data and tensors, memory keyed by a parameter's position in layer order. The keys a
technique lists in ``per_rank`` are restored only on the rank that wrote them, in a job of
the same size; anywhere else they are dropped on every rank (with a warning).
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import numpy as np

from hvdsync.core.technique import Technique

FORMAT = 1
STATE_KEY = "hvdsync."


def state_of(techniques: Sequence[Technique], params: Sequence[str], rank: int,
             world_size: int) -> dict:
    """The checkpoint entry of a wrapped optimizer's techniques."""
    entries: dict[str, dict] = {}
    for t in techniques:
        entries.setdefault(t.keyword, {}).update(t.state_dict())
    return {"format": FORMAT, "params": list(params), "rank": rank, "world_size": world_size,
            "techniques": entries}


def _per_rank_keys(techniques: Sequence[Technique]) -> dict[str, set[str]]:
    """By keyword, the keys of its entry that hold a rank's own memory."""
    keys: dict[str, set[str]] = {}
    for t in techniques:
        keys.setdefault(t.keyword, set()).update(t.per_rank)
    return keys


def per_rank_part(techniques: Sequence[Technique], state: Mapping[str, Any]) -> dict:
    """This rank's own memory from its :func:`state_of` entry."""
    return {kw: {k: state["techniques"][kw][k] for k in sorted(keys)
                 if k in state["techniques"].get(kw, {})}
            for kw, keys in _per_rank_keys(techniques).items() if keys}


def with_every_rank(techniques: Sequence[Technique], state: Mapping[str, Any],
                    parts: Sequence[dict]) -> dict:
    """``state`` (one rank's) holding every rank's own memory (``parts``, in rank order) under
    ``per_rank``, its shared part under ``techniques``."""
    out = dict(state)
    out["techniques"] = _shared(techniques, state["techniques"])
    out["per_rank"] = list(parts)
    return out


def _shared(techniques: Sequence[Technique], states: Mapping[str, Any]) -> dict:
    per_rank = _per_rank_keys(techniques)
    return {name: {k: v for k, v in s.items() if k not in per_rank.get(name, ())}
            for name, s in states.items()}


def load_into(techniques: Sequence[Technique], state: Mapping[str, Any],
              params: Sequence[str], rank: int, world_size: int, quiet: bool = False) -> bool:
    """Restore ``state`` (from :func:`state_of`) into ``techniques`` on ``rank`` of
    ``world_size``. A technique configured here but absent from ``state`` forgets its memory;
    state of a technique not configured here, another format or other parameters raise
    ``ValueError``. Returns whether this rank's own memory was restored (or there is none);
    ``quiet``: no warning when it is not."""
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
    keywords = {t.keyword for t in techniques}
    for name in state["techniques"]:
        if name not in keywords:
            raise ValueError(f"the saved optimizer has hvdsync {name}= state but this one was "
                             f"not built with {name}=; pass the same options")
    states, restored = _own(techniques, state, rank, world_size, quiet)
    for t in techniques:
        if t.keyword in states:
            t.load_state_dict(states[t.keyword])
        else:
            t.forget()
    return restored


def _own(techniques: Sequence[Technique], state: Mapping[str, Any], rank: int,
         world_size: int, quiet: bool) -> tuple[dict, bool]:
    """The technique states this rank restores, and whether they hold its own memory."""
    states = state["techniques"]
    if not any(t.per_rank and t.keyword in states for t in techniques):
        return dict(states), True
    if "per_rank" in state and len(state["per_rank"]) == world_size:
        mine = state["per_rank"][rank]
        return {name: {**s, **mine.get(name, {})} for name, s in states.items()}, True
    if "per_rank" not in state and (state["rank"], state["world_size"]) == (rank, world_size):
        return dict(states), True
    saved = (f"{len(state['per_rank'])} ranks" if "per_rank" in state
             else f"rank {state['rank']} of {state['world_size']}")
    if not quiet:
        warnings.warn(f"hvdsync: this checkpoint holds the own memory of {saved}, not of rank "
                      f"{rank} of {world_size}: per-rank memory ({_names(techniques)}) "
                      "starts empty on every rank, the shared state is restored "
                      "(docs/checkpoints.md)", RuntimeWarning, stacklevel=3)
    return _shared(techniques, states), False


def take_shared(techniques: Sequence[Technique], params: Sequence[str], rank: int,
                world_size: int, root_rank: int, broadcast: Callable[[Any], Any]) -> None:
    """Every rank takes ``root_rank``'s shared technique state (``broadcast(obj)`` returns
    ``root_rank``'s ``obj`` on every rank): a checkpoint loaded on ``root_rank`` only reaches
    every rank, and so does a running job's state when Horovod Elastic adds a rank. Per-rank
    memory cannot be given to another rank, so every rank drops its own, now -- before a step
    could use it -- warned where it held any. Both adapters' broadcasts of the optimizer state
    call this; the caller says what its next step checks (``StepPipeline.after_load``)."""
    held = _held(techniques)  # before the shared state replaces anything
    shared = broadcast(state_of(techniques, params, rank, world_size))
    if rank != root_rank:
        load_into(techniques, shared, params, rank, world_size, quiet=True)
    lost = drop_per_rank(techniques, held)
    if lost:
        warnings.warn(f"hvdsync: every rank takes rank {root_rank}'s shared technique state; "
                      "per-rank memory is never given to another rank, so every rank drops "
                      f"its own -- this rank dropped {'; '.join(lost)} (docs/checkpoints.md)",
                      RuntimeWarning, stacklevel=4)


def drop_per_rank(techniques: Sequence[Technique],
                  before: Optional[dict[str, int]] = None) -> list[str]:
    """Drop every technique's per-rank memory; what that lost, as ``"name: key (size)"``:
    what held a non-zero value before (``before``: as found earlier, else now) and holds
    none after -- nothing before the first step, or right after a ``flush()``; a technique
    may keep per-rank state it can rebuild."""
    before = _held(techniques) if before is None else before
    for t in techniques:
        if t.per_rank:
            t.drop_per_rank()
    after = _held(techniques)
    return [f"{key} ({_size(n)})" for key, n in before.items() if key not in after]


def _held(techniques: Sequence[Technique]) -> dict[str, int]:
    """``{"name: key": bytes}`` of the per-rank memory that holds a non-zero value now."""
    out = {}
    for t in techniques:
        state = t.state_dict() if t.per_rank else {}
        for k in t.per_rank:
            if _holds(state.get(k)):
                out[f"{t.keyword}: {k}"] = _nbytes(state.get(k))
    return out


def _nbytes(x: Any) -> int:
    if isinstance(x, Mapping):
        return sum(_nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    if hasattr(x, "element_size"):  # torch
        return x.numel() * x.element_size()
    return int(getattr(x, "nbytes", 0) or np.asarray(x).nbytes)


def _size(n: int) -> str:
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _holds(x: Any) -> bool:
    if isinstance(x, Mapping):
        return any(_holds(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_holds(v) for v in x)
    if hasattr(x, "detach"):  # torch (any dtype, sparse too)
        x = x.detach()
        return bool((x.to_dense() if x.is_sparse else x).ne(0).any())
    if hasattr(x, "shape"):  # numpy, TensorFlow
        return bool(np.any(np.asarray(x) != 0))
    return isinstance(x, (int, float)) and x != 0


def _names(techniques: Sequence[Technique]) -> str:
    return ", ".join(f"{kw}: {'/'.join(sorted(keys))}"
                     for kw, keys in _per_rank_keys(techniques).items() if keys)


def shared_digest(techniques: Sequence[Technique]) -> str:
    """A digest of the state every rank must have alike (the techniques' shared parts)."""
    shared = {t.name: {k: v for k, v in t.state_dict().items() if k not in t.per_rank}
              for t in techniques}
    text = json.dumps(shared, sort_keys=True, default=_plain)
    return hashlib.sha1(text.encode()).hexdigest()


def _plain(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "numpy"):
        return x.numpy().tolist()
    return str(x)


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


def state_bytes(state: dict) -> bytes:
    """``state`` (JSON values and arrays) as bytes that load without unpickling anything: an
    ``.npz`` of :func:`pack_state`'s arrays (how a rank's own memory travels to the saving
    rank)."""
    buf = io.BytesIO()
    np.savez(buf, **pack_state(state))
    return buf.getvalue()


def state_from_bytes(data: bytes) -> dict:
    """Inverse of :func:`state_bytes` (``allow_pickle=False``: data only, never code)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        return unpack_state({k: arrays[k] for k in arrays.files})


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
