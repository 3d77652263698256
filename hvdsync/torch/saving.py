"""Checkpoints of a torch training run with hvdsync, the Horovod way -- rank 0 writes one file,
every rank reads it -- without losing what each rank keeps for itself (docs/checkpoints.md).

``optimizer.state_dict()`` holds this rank's hvdsync memory (threshold's accumulations and
sync points, select's residuals, local clipping statistics). A file written by rank 0 alone
holds rank 0's; restored on every rank, that memory is dropped everywhere (never given to
another rank). :func:`save_checkpoint` gathers every rank's own memory into the one file, and
:func:`load_checkpoint` gives each rank its own back.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, Optional

import numpy as np
import torch

from hvdsync.safety import checkpoint
from hvdsync.core.api import SyncAPI
from hvdsync.torch import engine
from hvdsync.safety.watchdog import guard


class UntrustedCheckpoint(pickle.UnpicklingError):
    """A checkpoint holds more than tensors and plain data: loading it could run code."""


# numeric numpy arrays: the select= hypernet's state in files written before state_dict()
# held tensors only. Restoring one runs no code (an object array's items are unpickled under
# the same restrictions), which is why torch's own documentation allowlists these.
_NUMPY_CORE = getattr(np, "_core", None) or np.core  # numpy 2 renamed it
_NUMPY_ARRAYS = [np.ndarray, np.dtype, _NUMPY_CORE.multiarray._reconstruct,
                 _NUMPY_CORE.multiarray.scalar,
                 *(type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDG")]


def safe_load(source: Any, trusted: bool = False, what: str = "this checkpoint") -> Any:
    """``torch.load(source)`` with ``weights_only=True``: tensors, plain Python data and
    numeric numpy arrays only, so that a file cannot run code. Anything else raises
    :class:`UntrustedCheckpoint` naming ``trusted=True``, which loads it as pickle does
    (only for a file whose source you trust)."""
    if trusted:
        return torch.load(source, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAYS):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message: advice first, then the line that names what was refused
        reason = next((line.strip() for line in str(e).splitlines()
                       if "GLOBAL" in line), "objects of other types")
        reason = reason.split(" was not an allowed global")[0].split(" whose module")[0]
        reason = reason.removeprefix("WeightsUnpickler error: ")
        raise UntrustedCheckpoint(
            f"hvdsync: {what} holds objects that are not tensors or plain data ({reason}); "
            "loading it could run code from the file, so it was not loaded. If you trust the "
            "file's source, pass trusted=True (docs/checkpoints.md).") from None


def tensors_only(state: Any) -> Any:
    """``state`` with numpy arrays as tensors and numpy scalars as Python numbers: what
    ``torch.load(..., weights_only=True)`` (torch's default) reads without an allowlist."""
    if isinstance(state, dict):
        return {k: tensors_only(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(tensors_only(v) for v in state)
    if isinstance(state, np.ndarray):
        return torch.from_numpy(state.copy())
    if isinstance(state, np.generic):
        return state.item()
    return state


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def broadcast_optimizer_state(optimizer: Any, root_rank: int, model: Any = None,
                              **kwargs: Any) -> None:
    """Horovod's ``broadcast_optimizer_state``, also for hvdsync's optimizer, and for its
    techniques' state: every rank gets ``root_rank``'s shared technique state (a checkpoint
    loaded on ``root_rank`` only reaches every rank); per-rank memory is not broadcast, so
    none is kept (docs/checkpoints.md).

    Horovod initialises an empty optimizer state by calling ``step()`` on zero gradients; on
    hvdsync's optimizer that step must stay local (no collectives, no stats, no technique
    state), as Horovod arranges for its own optimizer.
    """
    ops = engine.ops()
    if not isinstance(optimizer, SyncAPI):
        return ops.broadcast_optimizer_state(optimizer, root_rank, model, **kwargs)
    with optimizer.skip_synchronize():
        ops.broadcast_optimizer_state(optimizer, root_rank, model, **kwargs)
    broadcast_technique_state(optimizer, root_rank)


def broadcast_technique_state(optimizer, root_rank: int) -> None:
    """Every rank takes ``root_rank``'s shared technique state (``broadcast_optimizer_state``
    of hvdsync.torch calls it): a checkpoint loaded on ``root_rank`` only reaches every rank,
    and so does a running job's state when Horovod Elastic adds a rank. Per-rank memory cannot
    be given to another rank, so every rank drops its own, now -- before the next step could
    use it -- warned where it held any."""
    if not optimizer._configured or optimizer.process_set.size() == 1:
        return
    ps = optimizer.process_set
    checkpoint.take_shared(optimizer._configured, optimizer._param_signatures, ps.rank(),
                           ps.size(), root_rank, lambda obj: engine.ops().broadcast_object(
                               obj, root_rank, "hvdsync.techniques", ps))
    optimizer._pipeline.after_load(False)


def save_checkpoint(path: str, model: torch.nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None, extra: Any = None,
                    root_rank: int = 0) -> None:
    """Write a checkpoint of ``model``, ``optimizer`` and ``extra`` (anything ``torch.save``
    takes) to ``path``. A collective: call it on every rank; ``root_rank`` writes the file
    (atomically), with every rank's own hvdsync memory; every rank returns once it is
    written. With ``delay=``, call ``optimizer.flush()`` first (replicas identical)."""
    if isinstance(optimizer, SyncAPI):  # hvdsync's wrapper  # refused at once where ranks differ
        optimizer._everyone.entries.begin("save", optimizer.stats.total.step)
        optimizer._everyone.entries.now("save_checkpoint's gather")
    state = optimizer.state_dict() if optimizer is not None else None
    if isinstance(optimizer, SyncAPI) and "hvdsync" in state:
        own = checkpoint.per_rank_part(optimizer._configured, state["hvdsync"])
        parts = [safe_load(io.BytesIO(b), what=f"rank {r}'s hvdsync state")
                 for r, b in enumerate(optimizer._everyone.gather_bytes(
                     _to_bytes(own), "hvdsync.checkpoint.save"))]
        state["hvdsync"] = checkpoint.with_every_rank(optimizer._configured, state["hvdsync"],
                                                      parts)
    if engine.ops().rank() == root_rank:
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save({"model": model.state_dict(), "optimizer": state, "extra": extra}, tmp)
        os.replace(tmp, path)
    with guard("the end of save_checkpoint on every rank"):  # the file exists for everyone
        engine.ops().allreduce(torch.zeros(1), name="hvdsync.checkpoint.written")


def load_checkpoint(path: str, model: torch.nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None,
                    trusted: bool = False) -> Any:
    """Restore a :func:`save_checkpoint` file into ``model`` (and ``optimizer``: each rank gets
    its own hvdsync memory back; saved by another number of ranks, that memory is dropped on
    every rank with a warning). Call on every rank; returns the ``extra`` that was saved.

    The file is read with ``weights_only=True``: tensors and plain data only, never code. A
    file holding other objects (an ``extra`` of your own classes, or a crafted file) raises
    :class:`UntrustedCheckpoint`; ``trusted=True`` reads it with pickle's full power, for
    files whose source you trust."""
    ckpt = safe_load(path, trusted, what=repr(path))
    model.load_state_dict(ckpt["model"])
    if optimizer is not None:
        if ckpt["optimizer"] is None:
            raise ValueError(f"{path} holds no optimizer state")
        optimizer.load_state_dict(ckpt["optimizer"])
    return ckpt["extra"]
