"""The plain exchange: each layer's gradients averaged (or summed) across ranks in one grouped
allreduce, as Horovod's ``DistributedOptimizer`` does -- the dense transport when ``delay=``
is off. With nothing else configured hvdsync is this transport alone and gives Horovod's
parameters. Where the engine pairs collectives by order (torch.distributed), which fuses
nothing itself, a ready group's layers go in one allreduce, as DDP's buckets do: each
collective costs rounds of messages, on a slow link worth a few layers' bytes.
"""

from __future__ import annotations

from typing import Any, Optional

from hvdsync.core.wire import Pending
from hvdsync.core.ports import Communicator, Gradients
from hvdsync.core.technique import Transport


class Plain(Transport):
    name = "plain"
    traceable = True
    scale_sensitive = False  # a sum is linear: Horovod's AMP recipe unscales it afterwards

    def __init__(self, grads: Gradients, comm: Communicator, layer_names: list[str]):
        self.grads = grads
        self.comm = comm
        self.layer_names = layer_names
        #: one allreduce per ready group (Horovod fuses the layers' own allreduces itself)
        self.fuses = not comm.matches_by_name
        #: the ready group's layers so far: (li, ks, tensors, the layer's pending, its place)
        self._queued: list[tuple[int, list[int], list[Any], Pending, dict]] = []

    def start(self, li: int, ks: list[int], layer: list) -> Optional[Pending]:
        """The layer's allreduce (on Horovod), or its part of its ready group's
        (:meth:`group_started`); the pending gives the reduced gradients."""
        tensors = [layer[k] for k in ks]
        if not self.fuses:
            return self.comm.allreduce(f"hvdsync.{self.layer_names[li]}", tensors)
        place: dict = {}  # the group's pending and this layer's span in it (group_started)
        pending = Pending(lambda: place["group"].wait()[place["lo"]:place["hi"]],
                          lambda: "group" in place and place["group"].ready(),
                          what=f"the allreduce of layer {self.layer_names[li]!r}'s group",
                          guarded=False)  # (the group's own wait is guarded)
        self._queued.append((li, ks, tensors, pending, place))
        return pending

    def group_started(self) -> None:
        """The layers :meth:`start` queued for this ready group go in one allreduce."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        first, last = (self.layer_names[queued[i][0]] for i in (0, -1))
        group = self.comm.allreduce(
            f"hvdsync.{first}" + (f"..{last}" if len(queued) > 1 else ""),
            [t for _, _, tensors, _, _ in queued for t in tensors])
        sizes = [sum(t.numel() for t in tensors) for _, _, tensors, _, _ in queued]
        lo, counted, total = 0, 0, max(sum(sizes), 1)
        for i, ((_, _, tensors, pending, place), size) in enumerate(zip(queued, sizes)):
            place.update(group=group, lo=lo, hi=lo + len(tensors))
            lo += len(tensors)
            # stats: the group's bytes shared by size, its collectives counted once
            pending.nbytes = (group.nbytes - counted if i == len(queued) - 1
                              else group.nbytes * size // total)
            counted += pending.nbytes
            pending.collectives = group.collectives if i == 0 else 0

    def send_rest(self) -> dict[int, Pending]:
        self.comm.dispatch()
        return {}
