"""The plain exchange: each layer's gradients averaged (or summed) across ranks in one grouped
allreduce, as Horovod's ``DistributedOptimizer`` does -- the dense transport when ``delay=``
is off. With nothing else configured hvdsync is this transport alone and gives Horovod's
parameters."""

from __future__ import annotations

from typing import Optional

from hvdsync.pending import Pending
from hvdsync.ports import Communicator, Gradients
from hvdsync.technique import Transport


class PlainAllreduce(Transport):
    name = "plain"
    traceable = True
    scale_sensitive = False  # a sum is linear: Horovod's AMP recipe unscales it afterwards

    def __init__(self, grads: Gradients, comm: Communicator, layer_names: list[str]):
        self.grads = grads
        self.comm = comm
        self.layer_names = layer_names

    def start(self, li: int, ks: list[int]) -> Optional[Pending]:
        tensors = [self.grads.get(li, k) for k in ks]
        pending = self.comm.allreduce(f"hvdsync.{self.layer_names[li]}", tensors)

        def write_back(outputs: list) -> None:
            for k, out in zip(ks, outputs):
                self.grads.set(li, k, out)
        return pending.then(write_back)

    def flush(self) -> dict[int, Pending]:
        self.comm.flush()
        return {}
