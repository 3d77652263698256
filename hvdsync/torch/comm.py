"""The torch communicator: moves gradient bytes between ranks with Horovod's torch ops, on
the active backend (:mod:`hvdsync.torch.engine`: Horovod, or torch.distributed).

Every call launches Horovod collectives asynchronously (in backward, as layers become ready)
and returns a :class:`hvdsync.core.technique.Pending` whose ``wait()`` blocks and returns the
reduced tensors (written in place into the tensors given). When the process set has a single
rank nothing is sent: a reduction over one rank is the identity.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from hvdsync.safety.entries import Entries
from hvdsync.core.stats import SyncStats
from hvdsync.core.wire import Pending
from hvdsync.torch import engine
from hvdsync.safety.watchdog import guard


def payload_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor as a collective carries it (values and indices for sparse COO)."""
    if t.is_sparse:
        return (t._values().numel() * t._values().element_size()
                + t._indices().numel() * t._indices().element_size())
    return t.numel() * t.element_size()


#: how many communicators this thread (a rank; one per simulated rank) has built
_built = threading.local()


class _Prefixed:
    """An engine's ops whose collectives' names start with ``prefix``. Horovod pairs
    collectives by name, and two optimizers over layers of the same names (two Keras models of
    one architecture) would otherwise start collectives of one name while both have some in
    flight (``delay=`` keeps a step's exchange in flight into the next): each communicator a
    rank builds after its first has its own prefix. Every rank builds the same optimizers in
    the same order (each one's setup agreement is a collective), so the names match."""

    def __init__(self, ops: Any, prefix: str):
        self._ops, self._prefix = ops, prefix

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._ops, attr)
        if not callable(value) or isinstance(value, type):
            return value
        prefix = self._prefix

        def named(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("name") is not None:
                kwargs["name"] = prefix + kwargs["name"]
            return value(*args, **kwargs)
        setattr(self, attr, named)  # (found directly from now on)
        return named


class TorchCommunicator:
    """Averages (or sums) tensors with Horovod as its ``DistributedOptimizer`` does: the dense
    ones of one request in one grouped allreduce per dtype (with ``compression`` and
    ``gradient_predivide_factor``), sparse ones through Horovod's allgather-based path (or
    densified with ``sparse_as_dense``)."""

    def __init__(self, compression, op, gradient_predivide_factor: float,
                 sparse_as_dense: bool, process_set: Any, stats: SyncStats):
        #: the backend's ops (Horovod's torch API or hvdsync.torch.c10d), their collectives
        #: named apart from those of the communicators this rank built before (_Prefixed)
        ops = engine.ops()
        _built.count = getattr(_built, "count", 0) + 1
        self.ops = (_Prefixed(ops, f"hvdsync.optimizer{_built.count}.") if _built.count > 1
                    else ops)  # (still "hvdsync.": the engine's checks of scripts' calls skip it)
        self.matches_by_name = engine.active_name() == "horovod"
        self.compression = compression
        self.op = op
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.stats = stats
        self.size = process_set.size()  # again at refresh(): Horovod Elastic changes it
        #: send through Horovod even on one rank (benchmarks of the full path)
        self.force_collectives = False
        # As in Horovod: split the average into a pre- and post-scale (the C++ side applies
        # the remaining 1/size for Average).
        if op == ops.Average:
            self.prescale, self.postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
        else:
            self.prescale = self.postscale = 1.0
        #: what this rank is doing, sent before each entry's first collective (hvdsync.safety.entries)
        self.entries = Entries(process_set, self._tag_round)
        self._tag_buffers: dict[str, torch.Tensor] = {}

    def refresh(self) -> None:
        """Horovod was initialized again (an Elastic reset): read the ranks anew."""
        self.size = self.process_set.size()
        self.entries.reset()

    def _after(self, tag: int, pending: Pending) -> Pending:
        """``pending``, whose first wait first checks the entry tags up to ``tag``."""
        pending.before = partial(self.entries.settle, tag, pending.what)
        return pending

    def allreduce(self, name: str, tensors: Sequence[torch.Tensor]) -> Pending:
        """Start reducing ``tensors`` in place; collective names derive from ``name`` (the same
        on every rank)."""
        tensors = list(tensors)
        if self.size == 1 and not self.force_collectives:
            return Pending.resolved(tensors)
        # first: collectives pair by order on torch.distributed
        tag = self.entries.before(f"the allreduce {name!r}")
        waits, polls, nbytes, collectives = [], [], 0, 0
        dense: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            if t.is_sparse and not self.sparse_as_dense:
                result = self.ops.sparse_allreduce_async(
                    t, name=f"{name}.sparse.{i}", op=self.op, process_set=self.process_set)
                waits.append(_sparse_finisher(t, result))
                polls.append(lambda: False)  # Horovod's sparse path has no pollable handle
                nbytes += payload_bytes(t)
                collectives += 2  # indices and values are two allgathers
            else:
                dense.setdefault(t.dtype, []).append(i)
        for dtype, idx in dense.items():
            group = [tensors[i] for i in idx]
            sources = [g.to_dense() if g.is_sparse else g for g in group]
            compressed, ctxs = zip(*[self.compression.compress(s) for s in sources])
            handle = self.ops.grouped_allreduce_async_(
                list(compressed), name=f"{name}.{str(dtype).removeprefix('torch.')}",
                op=self.op, prescale_factor=self.prescale, postscale_factor=self.postscale,
                process_set=self.process_set)
            nbytes += sum(payload_bytes(c) for c in compressed)
            collectives += 1
            waits.append(self._dense_finisher(handle, group, ctxs))
            polls.append(lambda h=handle: self.ops.poll(h))

        def wait() -> list[torch.Tensor]:
            for w in waits:
                w()
            return tensors
        return self._after(tag, Pending(wait, lambda: all(p() for p in polls), nbytes,
                                        collectives, what=f"the allreduce {name!r}"))

    def _dense_finisher(self, handle, grads, ctxs):
        def finish() -> None:
            for grad, out, ctx in zip(grads, self.ops.synchronize(handle), ctxs):
                out = self.compression.decompress(out, ctx)
                if grad.is_sparse:  # sparse_as_dense: back to sparse for the optimizer
                    grad.zero_().add_(out.to_sparse())
                elif out is not grad:
                    grad.copy_(out)
        return finish

    def dispatch(self, background: bool = False) -> None:
        """Nothing is queued: every collective started when it was asked for."""

    def control(self, values: list[float], name: str, dtype: str = "float64"
                ) -> list[float]:
        """The control plane: one small allreduce (average) of per-layer statistics, so that
        decisions changing which collectives run are taken from values every rank shares.
        Counted in ``stats`` when a collective runs (not on a single rank). ``dtype``: the
        vector's precision (:func:`hvdsync.core.technique.control_dtype`)."""
        return self.control_async(values, name, dtype).wait()

    def control_async(self, values: Any, name: str, dtype: str = "float64") -> Pending:
        """:meth:`control` started now (``values``: floats, or a device vector built by
        :meth:`TorchOps.concat`, which goes without a host read); the pending's ``wait()``
        gives the averages (a decider starts it with the step's data and waits after the
        data)."""
        want = getattr(torch, dtype)
        t = values.to(want) if torch.is_tensor(values) else torch.tensor(values, dtype=want)
        if self.size == 1:  # (in the vector's precision, as the ranks' average would be)
            return Pending(t.tolist, lambda: True, what=f"the control vector {name!r}")
        tag = self.entries.before(f"the control allreduce {name!r}")
        return self._after(tag, self._control_round(t, name))

    def _tag_round(self, values: list[float], name: str, what: str) -> Pending:
        """An entry tag's round, in place in a host buffer kept per name (reused once its
        round was checked): written and read through numpy, so the only op dispatched is
        the engine's own detach of it, a view that launches no kernel on a GPU. float32, as gradients mostly are, so that Horovod can
        fuse it with the step's first data (a step count is exact to 2^24)."""
        self.stats.count("entry_tags", 1)
        if not self.matches_by_name:  # torch.distributed: in the shape of a script's check
            return self._tag_gather(values, name, what)
        buf = self._tag_buffers.get(name)
        if buf is None or buf.numel() != len(values):  # all at once: none in later steps
            self._tag_buffers = {n: torch.zeros(len(values), dtype=torch.float32)
                                 for n in self.entries.names()}
            buf = self._tag_buffers[name]
        view = buf.numpy()
        view[:] = values
        ops = self.ops
        handle = ops.allreduce_async_(buf, name=name, op=ops.Average,
                                      process_set=self.process_set)
        return Pending(lambda: (ops.synchronize(handle), view.tolist())[1],
                       lambda: ops.poll(handle), what=what)

    def _tag_gather(self, values: list[float], name: str, what: str) -> Pending:
        """The entry tag on torch.distributed: gathered in the shape of a script call's
        check, so that a rank in ``hvd.join()`` or a call of the script's own pairs with it
        and every side raises (hvdsync.torch.c10d.joining); read back as the average
        :class:`~hvdsync.safety.entries.Entries` expects."""
        ops, me = self.ops, self.process_set.rank()
        handle = ops.entry_tag_async(int(values[2 * me]), int(values[2 * me + 1]), name,
                                     self.process_set, self.entries.identity())

        def shared() -> list[float]:
            kinds, steps = ops.joining.entry_kinds(ops.synchronize(handle))
            return [v / len(kinds) for pair in zip(kinds, steps) for v in pair]
        return Pending(shared, lambda: ops.poll(handle), what=what)

    def _control_round(self, t: torch.Tensor, name: str) -> Pending:
        self.stats.control(t.numel() * t.element_size())
        ops = self.ops
        handle = ops.allreduce_async(t, name=name, op=ops.Average, process_set=self.process_set)
        return Pending(lambda: ops.synchronize(handle).tolist(), lambda: ops.poll(handle),
                       what=f"the control allreduce {name!r}")

    def average(self, groups: list[tuple[str, list[torch.Tensor]]]) -> None:
        """Average each named group of tensors across ranks, in place (all groups in flight
        at once)."""
        if self.size == 1:
            return
        self.entries.now("the parameter averaging (delay=, flush())")
        ops = self.ops
        handles = [ops.grouped_allreduce_async_(tensors, name=name, op=ops.Average,
                                                process_set=self.process_set)
                   for name, tensors in groups]
        with guard("the parameter averaging (delay=, flush())"):
            for h in handles:
                ops.synchronize(h)

    def allgather_async(self, name: str, tensors: list[torch.Tensor]) -> Pending:
        """Start gathering every rank's 1-d ``tensors``; ``wait()`` gives each one's pieces
        concatenated in rank order."""
        if self.size == 1:
            return Pending.resolved(list(tensors))
        tag = self.entries.before(f"the allgather {name!r}")
        if not self.matches_by_name:  # torch.distributed gathers the sizes first, blocking
            self.entries.settle(tag, f"the allgather {name!r}")
        ops = self.ops
        handles = [ops.allgather_async(t, name=f"{name}.{i}", process_set=self.process_set)
                   for i, t in enumerate(tensors)]
        return self._after(tag, Pending(lambda: [ops.synchronize(h) for h in handles],
                                        lambda: all(ops.poll(h) for h in handles),
                                        sum(payload_bytes(t) for t in tensors), len(tensors),
                                        what=f"the allgather {name!r}"))

    @property
    def averages(self) -> bool:
        return self.op == self.ops.Average

    def gather_rows(self, name: str, tensors: list[torch.Tensor]) -> Pending:
        """One grouped allgather of 2-d ``tensors`` with uneven row counts (``sparse=``)."""
        handle = self.ops.grouped_allgather_async(tensors, name=name,
                                                  process_set=self.process_set)
        return Pending(partial(self.ops.synchronize, handle), partial(self.ops.poll, handle),
                       collectives=1, what=f"the allgather {name!r}")

    def sum_rows(self, name: str, tensors: list[torch.Tensor]) -> Pending:
        """One grouped allreduce (a sum) of ``tensors`` (``sparse=``'s dense route)."""
        handle = self.ops.grouped_allreduce_async_(tensors, name=name, op=self.ops.Sum,
                                                   process_set=self.process_set)
        return Pending(partial(self.ops.synchronize, handle), partial(self.ops.poll, handle),
                       collectives=1, what=f"the allreduce {name!r}")

    def gather_bytes(self, data: bytes, name: str) -> list[bytes]:
        """Every rank's ``data``, in rank order (two allgathers)."""
        if self.size == 1:
            return [data]
        self.entries.now(f"the allgather {name!r}")
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
            torch.zeros(0, dtype=torch.uint8)
        with guard(f"the allgather {name!r}"):
            sizes = self.ops.allgather(torch.tensor([t.numel()]), name=f"{name}.sizes",
                                       process_set=self.process_set).tolist()
            gathered = self.ops.allgather(t, name=name,
                                          process_set=self.process_set).numpy().tobytes()
        out, i = [], 0
        for n in sizes:
            out.append(gathered[i:i + n])
            i += n
        return out

    def after_dispatch(self, fn) -> None:
        """Nothing to chain: torch's Horovod collectives run asynchronously, so a round that
        depends on an earlier one starts once that one has arrived (the caller's)."""
        return None

    def gather_json(self, obj, name: str) -> list:
        """Every rank's ``obj`` (JSON data), in rank order."""
        return [json.loads(b.decode()) for b in self.gather_bytes(json.dumps(obj).encode(),
                                                                 name)]


def _sparse_finisher(grad: torch.Tensor, result):
    def finish() -> None:
        grad.zero_().add_(result())
    return finish
