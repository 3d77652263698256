"""Horovod's ``horovod.torch.functions`` on the torch engine: objects, parameters and an
optimizer's state sent from one rank to all, built from the engine's collectives
(:mod:`hvdsync.torch.c10d`). ``broadcast_object`` and ``allgather_object`` pickle, as
Horovod's do: the ranks of one job trust each other (docs/checkpoints.md)."""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any, Optional

import torch

from hvdsync.torch import engine


def _global_set() -> Any:
    return engine.ops().global_process_set


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def gather_bytes(data: bytes, name: Optional[str] = None, process_set: Any = None
                 ) -> list[bytes]:
    """Every rank's ``data``, in rank order: the lengths first, then the bytes."""
    ops = engine.ops()
    ps = process_set or _global_set()
    mine = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data  # (none: b"")
            else torch.empty(0, dtype=torch.uint8))
    sizes = ops.synchronize(ops.allgather_async(
        torch.tensor([mine.numel()], dtype=torch.int64),
        None if name is None else f"{name}.sizes", ps)).tolist()
    everyone = ops.synchronize(ops.allgather_async(mine, name, ps))
    starts = [sum(sizes[:r]) for r in range(len(sizes) + 1)]
    return [everyone[a:b].numpy().tobytes() for a, b in zip(starts, starts[1:])]


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Any = None) -> list[Any]:
    """Every rank's ``obj`` (pickled), in rank order."""
    return [pickle.loads(b) for b in gather_bytes(pickle.dumps(obj), name, process_set)]


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = None) -> Any:
    """``root_rank``'s ``obj`` (pickled), on every rank."""
    ops = engine.ops()
    ps = process_set or _global_set()
    if ps.size() == 1:
        return obj
    mine = ops.rank() == root_rank
    data = _pickled(obj) if mine else None
    length = ops.broadcast_(torch.tensor([0 if data is None else data.numel()]), root_rank,
                            None if name is None else f"{name}.size", process_set=ps)
    if mine:
        ops.broadcast_(data, root_rank, name, process_set=ps)
        return obj
    data = ops.broadcast_(torch.empty(int(length), dtype=torch.uint8), root_rank, name,
                          process_set=ps)
    return pickle.loads(data.numpy().tobytes())


def broadcast_parameters(params: Any, root_rank: int, process_set: Any = None) -> None:
    """Every rank takes ``root_rank``'s tensors, in place: ``params`` is a ``state_dict`` or
    ``named_parameters()`` (Horovod's contract: a dict is taken in sorted order)."""
    ops = engine.ops()
    if isinstance(params, dict):
        items: Iterable = sorted(params.items())
    elif hasattr(params, "__iter__"):  # a list, or named_parameters()' generator
        items = list(params)
    else:
        raise ValueError(f"invalid params of type {type(params)}")
    handles = []
    for entry in items:
        if not (isinstance(entry, tuple) and len(entry) == 2):
            raise ValueError("params must be a state_dict or a list of (name, tensor) pairs")
        name, p = entry
        if isinstance(p, torch.Tensor):
            handles.append(ops.broadcast_async_(p.data, root_rank, f"broadcast.{name}",
                                                process_set=process_set or _global_set()))
    for h in handles:
        ops.synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Any = None) -> None:
    """Every rank takes ``root_rank``'s optimizer state: moments, step counts, learning rates
    and every other per-group option, for any torch optimizer, with parameter groups and
    parameters that have no gradient (frozen, unused). Horovod's contract, including its
    first step: an optimizer with no state yet takes one step on zero gradients (its
    parameters do not move) so that every rank has a state to take root's into."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state (Horovod refuses it too)")
    if not optimizer.state:
        _initial_step(optimizer, model)
    # the base class's state_dict: hvdsync's wrapper adds its techniques' state to its own
    # state_dict(), which hvd.broadcast_optimizer_state broadcasts apart (shared part only)
    state = broadcast_object(torch.optim.Optimizer.state_dict(optimizer), root_rank,
                             "broadcast_optimizer_state")
    if engine.ops().rank() != root_rank:
        torch.optim.Optimizer.load_state_dict(optimizer, state)


def _initial_step(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Horovod's way to create a fresh optimizer's state: zero gradients (sparse ones where
    the optimizer or the model's sparse embeddings need them), then the wrapped optimizer's
    own step, which starts no collective."""
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    if hasattr(optimizer, "skip_synchronize"):  # a DistributedOptimizer: its base class's step
        super(type(optimizer), optimizer).step()
    else:
        optimizer.step()
