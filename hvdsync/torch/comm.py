"""Communicators: the pieces that move gradient bytes between ranks (torch tensors).

Each ``start_*`` call launches Horovod collectives asynchronously and returns a
:class:`Pending` whose ``wait()`` blocks and writes the reduced values back into the
gradients. When the process set has a single rank nothing is sent: a reduction over one rank
is the identity, so the pending result is ready at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from horovod.torch.mpi_ops import Average, ProcessSet
from horovod.torch.mpi_ops import (allreduce, grouped_allreduce_async_, poll,
                                   sparse_allreduce_async, synchronize)

from hvdsync.stats import SyncStats


@dataclass
class Pending:
    """Outstanding collectives for one layer; ``wait()`` finishes them (idempotent)."""

    finishers: list[Callable[[], None]] = field(default_factory=list)
    nbytes: int = 0
    collectives: int = 0
    #: Horovod handles of the dense collectives, to ask whether they are done without waiting
    handles: list[int] = field(default_factory=list)
    #: False once a collective without a pollable handle (Horovod's sparse path) is added
    pollable: bool = True

    def wait(self) -> None:
        for f in self.finishers:
            f()
        self.finishers.clear()

    def ready(self) -> bool:
        """Whether ``wait()`` would return at once (never blocks)."""
        if not self.finishers:
            return True
        return self.pollable and all(poll(h) for h in self.handles)


def payload_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor as a collective carries it (values and indices for sparse COO)."""
    if t.is_sparse:
        return (t._values().numel() * t._values().element_size()
                + t._indices().numel() * t._indices().element_size())
    return t.numel() * t.element_size()


class GradientAllreduce:
    """Averages (or sums) gradients with Horovod: one grouped allreduce per layer and dtype for
    dense gradients, Horovod's allgather-based path for sparse ones (``sparse_as_dense``
    densifies them first, as Horovod does)."""

    def __init__(self, compression, op, gradient_predivide_factor: float,
                 sparse_as_dense: bool, process_set: ProcessSet):
        self.compression = compression
        self.op = op
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        # As in Horovod: split the average into a pre- and post-scale (the C++ side applies the
        # remaining 1/size for Average).
        if op == Average:
            self.prescale, self.postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
        else:
            self.prescale = self.postscale = 1.0
        self.single_rank = process_set.size() == 1

    def start(self, name: str, params: Sequence[tuple[str, torch.Tensor]]) -> Pending:
        """Start reducing ``p.grad`` of every ``(param_name, p)`` in ``params`` (grads present)
        in place.

        Collective names derive from ``name`` and parameter names, so they match across ranks.
        """
        return self.start_tensors(name, [(pname, p.grad) for pname, p in params])

    def start_tensors(self, name: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> Pending:
        """Start reducing every ``(param_name, gradient)`` tensor in place."""
        pending = Pending()
        if self.single_rank:
            return pending
        dense: dict[torch.dtype, list[torch.Tensor]] = {}
        for pname, grad in tensors:
            if grad.is_sparse and not self.sparse_as_dense:
                self._start_sparse(f"{name}.sparse.{pname}", grad, pending)
            else:
                dense.setdefault(grad.dtype, []).append(grad)
        for dtype, group in dense.items():
            self._start_dense(f"{name}.{str(dtype)[6:]}", group, pending)
        return pending

    def _start_dense(self, name: str, grads: list[torch.Tensor], pending: Pending) -> None:
        sources = [g.to_dense() if g.is_sparse else g for g in grads]
        compressed, ctxs = zip(*[self.compression.compress(t) for t in sources])
        handle = grouped_allreduce_async_(list(compressed), name=name, op=self.op,
                                          prescale_factor=self.prescale,
                                          postscale_factor=self.postscale,
                                          process_set=self.process_set)
        pending.nbytes += sum(payload_bytes(t) for t in compressed)
        pending.collectives += 1
        pending.handles.append(handle)

        def finish() -> None:
            outputs = synchronize(handle)
            for grad, out, ctx in zip(grads, outputs, ctxs):
                out = self.compression.decompress(out, ctx)
                if grad.is_sparse:  # sparse_as_dense: back to sparse for the optimizer
                    grad.zero_().add_(out.to_sparse())
                elif out is not grad:
                    grad.copy_(out)
        pending.finishers.append(finish)

    def _start_sparse(self, name: str, grad: torch.Tensor, pending: Pending) -> None:
        result = sparse_allreduce_async(grad, name=name, op=self.op, process_set=self.process_set)
        pending.nbytes += payload_bytes(grad)
        pending.collectives += 2  # indices and values are two allgathers
        pending.pollable = False

        def finish() -> None:
            grad.zero_().add_(result())
        pending.finishers.append(finish)


def control_allreduce(values: list[float], name: str, process_set: ProcessSet,
                      stats: SyncStats) -> list[float]:
    """The control plane: one small allreduce (average) of per-layer statistics, so that
    decisions changing which collectives run are taken from values every rank shares.
    Counted in ``stats`` when a collective runs (not on a single rank)."""
    if process_set.size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    stats.control(t.numel() * t.element_size())
    return allreduce(t, name=name, op=Average, process_set=process_set).tolist()
