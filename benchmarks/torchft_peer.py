"""The torchft peer: (Streaming) DiLoCo from the ``torchft`` package itself
(``torchft.local_sgd.DiLoCo``), one replica group per rank -- or per node, its ranks the
group's ranks, DDP inside it -- Gloo on CPU, a lighthouse on rank 0, set up the way torchft's
own integration tests do, with every address on the emulated network so that its collectives
cross the slow links like everyone else's.

What differs from torchft on GPUs: its quantized allreduce (``should_quantize``) needs CUDA
(Triton kernels), so on this CPU bed the pseudo-gradients travel in float32; everything else
(fragments, ``fragment_sync_delay`` = tau, ``fragment_update_alpha`` = mix, the per-fragment
outer Nesterov SGD, a quorum per synchronization) is torchft's own code.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
from torch import nn

from hvdsync.techniques.outer.technique import fragment_layers


def own_address(peer: str) -> str:
    """This process' address on the network that reaches ``peer``."""
    if peer.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # UDP: no packet is sent
        return s.getsockname()[0]


def fragments_of(model: nn.Module, n: int) -> list[nn.Module]:
    """``model``'s top-level pieces (``ModuleList``/``Sequential`` children opened one level)
    in ``n`` consecutive groups of about equal parameter count, as torchft takes fragments."""
    pieces: list[nn.Module] = []
    for child in model.children():
        inner = list(child.children())
        layers = [m for m in inner if isinstance(m, nn.ModuleList)]
        pieces += list(layers[0]) if layers else [child]
    pieces = [p for p in pieces if any(True for _ in p.parameters())]
    # the same split as hvdsync's fragments (consecutive, balanced by size)
    groups = fragment_layers([sum(p.numel() for p in m.parameters()) for m in pieces], n)
    return [nn.ModuleList([pieces[i] for i in g]) for g in groups]


def start_diloco(model: nn.Module, inner: torch.optim.Optimizer, rank: int, size: int,
                 peer: str, run: int, cfg: dict[str, Any],
                 node: Optional[tuple[int, int, int]] = None) -> Callable[[], None]:
    """Wrap ``inner`` (stepping ``model``) in torchft's DiLoCo for this rank; returns the
    function that tears it down. ``peer``: rank 0's address (the lighthouse runs there).
    ``node``: (node, local rank, local size): one replica group per node, its ranks the
    group's ranks (torchft's own multi-rank replica groups; the caller keeps them
    synchronous inside the node), else one replica group per rank."""
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo
    import horovod.torch as horovod

    me = own_address(peer)
    base = 29700 + 20 * (run % 50)
    group, group_rank, group_size = node if node is not None else (rank, 0, 1)
    lighthouse = None
    if rank == 0:
        lighthouse = LighthouseServer(bind=f"[::]:{base}", min_replicas=size // group_size)
    # the replica group's store is served by its first rank, at that rank's address
    store_addr = horovod.allgather_object(me, name=f"torchft.addresses.{run}")[
        rank - group_rank]
    store_port = base + 1 + group
    store = torch.distributed.TCPStore(store_addr, store_port, world_size=group_size,
                                       is_master=group_rank == 0, wait_for_workers=False)
    horovod.allreduce(torch.zeros(1), name=f"torchft.lighthouse.{run}")  # they are up
    state = {"model": model, "inner": inner}
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), min_replica_size=size // group_size,
        use_async_quorum=False, load_state_dict=lambda sd: None,
        state_dict=lambda: {"model": state["model"].state_dict()},
        replica_id=f"r{group}", store_addr=store_addr, store_port=store_port, rank=group_rank,
        world_size=group_size,
        lighthouse_addr=f"http://{peer}:{base}", hostname=me, port=base + 10 + rank,
        timeout=timedelta(seconds=120), quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=60),
        init_sync=False)  # every rank starts from the same weights, as with the other peers
    frags = fragments_of(model, cfg["fragments"])
    outers = [torch.optim.SGD(f.parameters(), lr=cfg["outer_lr"], momentum=cfg["outer_momentum"],
                              nesterov=True) for f in frags]
    diloco = DiLoCo(manager, frags, inner, outers, sync_every=cfg["average_every"],
                    fragment_sync_delay=cfg["overlap"], fragment_update_alpha=cfg["mix"])
    diloco.__enter__()
    alive = [store]  # the replica group's store serves the others until stop()

    def stop() -> None:
        diloco.__exit__(None, None, None)
        horovod.allreduce(torch.zeros(1), name=f"torchft.done.{run}")
        manager.shutdown(wait=False)
        alive.clear()
        if lighthouse is not None:
            lighthouse.shutdown()
    return stop
