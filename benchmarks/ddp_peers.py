"""The bench's DDP peers (benchmarks/bench_suite.py): torch's own communication hooks and
model averagers on ``torch.distributed`` (Gloo), set up as their documentation does -- PowerSGD,
the fp16 compression hook, post-local SGD with ``PeriodicModelAverager`` (its subgroup the
rank, or the node) and ``HierarchicalModelAverager`` -- and the bytes each sends a step.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

from torch import nn

#: post-local SGD's synchronous start, and how often the models are averaged after it
SYNCHRONOUS_STEPS, AVERAGE_EVERY = 10, 32


def _local_size() -> int:
    return int(os.environ.get("HOROVOD_LOCAL_SIZE", "1"))


def inside_node(model: nn.Module) -> nn.Module:
    """``model`` in DDP over its node's ranks only: synchronous inside the node (a peer that
    runs something else between the nodes: torchft's replica group per node)."""
    import torch.distributed as dist
    # a node's ranks are consecutive, so groups of the local size are the nodes
    node_group, _ = dist.new_subgroups(group_size=_local_size())
    return nn.parallel.DistributedDataParallel(model, process_group=node_group)


def wrap(model: nn.Module, base: Any, spec: dict) -> tuple[Any, nn.Module]:
    """``model`` in DDP with ``spec``'s hook (``"powersgd"``, ``"fp16"``, ``"post_local"``);
    returns the optimizer to step (``base``, which averages the models after its step where
    the hook is post-local SGD) and the module to run."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    assert dist.is_initialized()
    # PowerSGD's hook chains collectives from future callbacks (P after the vectors, Q after
    # P): with two or more buckets on Gloo the callbacks of different buckets run in
    # completion order, which differs between ranks, and the collectives mismatch (seen on
    # the LM: "Received data size doesn't match expected size"). One bucket keeps them in
    # order; it sends at the end of backward, as PowerSGD's compression needs anyway.
    one_bucket = dict(bucket_cap_mb=1024) if spec["hook"] == "powersgd" else {}
    net = nn.parallel.DistributedDataParallel(model, **one_bucket)
    if spec["hook"] == "powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                       start_powerSGD_iter=SYNCHRONOUS_STEPS)
        net.register_comm_hook(state, powersgd.powerSGD_hook)
    elif spec["hook"] == "fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        _post_local(net, model, base, spec)
    return base, net


def _post_local(net: nn.Module, model: nn.Module, base: Any, spec: dict) -> None:
    """Post-local SGD on ``net``: the gradient averaged over its subgroup every step (the
    rank alone, or with ``subgroup="node"`` the node), the models averaged after ``base``'s
    step -- every rank every 32 steps, or with ``averager="hierarchical"`` inside the node
    every step and every rank every 32 (torch's ``HierarchicalModelAverager``)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as plsgd
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import \
        HierarchicalModelAverager
    # a node's ranks are consecutive, so groups of the local size are the nodes
    local_group, _ = dist.new_subgroups(
        group_size=_local_size() if spec.get("subgroup") == "node" else 1)
    net.register_comm_hook(plsgd.PostLocalSGDState(process_group=None, subgroup=local_group,
                                                   start_localSGD_iter=SYNCHRONOUS_STEPS),
                           plsgd.post_localSGD_hook)
    if spec.get("averager") == "hierarchical":
        averager = HierarchicalModelAverager(
            OrderedDict([(1, _local_size()), (AVERAGE_EVERY, dist.get_world_size())]),
            warmup_steps=SYNCHRONOUS_STEPS)
    else:
        averager = PeriodicModelAverager(period=AVERAGE_EVERY, warmup_steps=SYNCHRONOUS_STEPS)
    base_step = base.step

    def step_and_average(*args: Any, **kw: Any) -> Any:
        out = base_step(*args, **kw)
        averager.average_parameters(model.parameters())
        return out
    base.step = step_and_average


def powersgd_bytes(model: nn.Module, rank: int = 2, min_rate: float = 2.0) -> int:
    """Bytes per step PowerSGD's hook hands to allreduce (P and Q for compressible matrices,
    the whole tensor otherwise), by the hook's own rule."""
    total = 0
    for p in model.parameters():
        if p.ndim <= 1:
            total += p.numel() * 4
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        total += ((n + m) * rank if (n + m) * rank * min_rate < n * m else n * m) * 4
    return total


def traffic(model: nn.Module, spec: dict, steps: int) -> tuple[float, float]:
    """Payload bytes a rank hands to the collectives per step over ``steps`` steps, and
    collectives per step. Post-local SGD: the synchronous start, then a model averaging every
    32 steps (the hierarchical averager's averaging inside the node every step is not
    counted: it stays on the node's bridge)."""
    if spec["hook"] == "powersgd":
        return powersgd_bytes(model), 3  # per DDP bucket (one bucket here): vectors, P, Q
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if spec["hook"] == "fp16":
        return dense_bytes / 2, 1
    rounds = min(steps, SYNCHRONOUS_STEPS) + max(steps - SYNCHRONOUS_STEPS, 0) // AVERAGE_EVERY
    return dense_bytes * rounds / steps, rounds / steps
