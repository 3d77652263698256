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
from typing import Any, Optional

import torch

from hvdsync import checkpoint
from hvdsync.torch import engine
from hvdsync.watchdog import guard


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


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
    from hvdsync.torch.optimizer import _DistributedOptimizer
    state = optimizer.state_dict() if optimizer is not None else None
    if isinstance(optimizer, _DistributedOptimizer) and "hvdsync" in state:
        own = checkpoint.per_rank_part(optimizer._configured, state["hvdsync"])
        parts = [_from_bytes(b) for b in optimizer._comm.gather_bytes(
            _to_bytes(own), "hvdsync.checkpoint.save")]
        state["hvdsync"] = checkpoint.with_every_rank(optimizer._configured, state["hvdsync"],
                                                      parts)
    if engine.ops().rank() == root_rank:
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save({"model": model.state_dict(), "optimizer": state, "extra": extra}, tmp)
        os.replace(tmp, path)
    with guard("the end of save_checkpoint on every rank"):  # the file exists for everyone
        engine.ops().allreduce(torch.zeros(1), name="hvdsync.checkpoint.written")


def load_checkpoint(path: str, model: torch.nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
    """Restore a :func:`save_checkpoint` file into ``model`` (and ``optimizer``: each rank gets
    its own hvdsync memory back; saved by another number of ranks, that memory is dropped on
    every rank with a warning). Call on every rank; returns the ``extra`` that was saved."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(ckpt["model"])
    if optimizer is not None:
        if ckpt["optimizer"] is None:
            raise ValueError(f"{path} holds no optimizer state")
        optimizer.load_state_dict(ckpt["optimizer"])
    return ckpt["extra"]
