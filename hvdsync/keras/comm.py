"""The Keras communicator: moves gradient bytes with ``horovod.tensorflow`` ops (Horovod's own
Keras wrapper does not work with Keras 3).

Two execution contexts use it:

* the plain graph path builds Horovod ops into the compiled train function
  (:meth:`KerasCommunicator.reduce` with no name: op names come from the graph, as in
  Horovod's TensorFlow optimizer);
* the step pipeline runs eagerly inside ``tf.py_function``. Eager Horovod ops block until
  done and are matched across ranks by the name they are given, so eager requests are
  queued and :meth:`KerasCommunicator.dispatch` sends all of a step's layers in **one** grouped
  allreduce (one negotiation round instead of one per layer), named from the requests'
  names, which every rank has alike -- or hands it to a background thread (``delay=``).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Optional

import numpy as np
import tensorflow as tf
from horovod.tensorflow import allreduce as hvd_allreduce
from horovod.tensorflow import mpi_ops
from horovod.tensorflow.compression import FP16Compressor
from horovod.tensorflow.mpi_ops import Average, ProcessSet, Sum

from hvdsync.safety.agreement import RanksDisagree
from hvdsync.safety.entries import CODE, Entries, describe
from hvdsync.core.stats import SyncStats
from hvdsync.core.wire import Pending
from hvdsync.safety.watchdog import guard


def payload_bytes(g) -> int:
    """Bytes a collective carries for ``g`` (values and indices for ``IndexedSlices``)."""
    if isinstance(g, tf.IndexedSlices):
        return payload_bytes(g.values) + payload_bytes(g.indices)
    n = g.shape.num_elements()
    if n is None:  # dynamic shape: only known when running eagerly
        n = int(tf.size(g))
    return n * g.dtype.size


def coalesce(g: tf.IndexedSlices) -> tf.IndexedSlices:
    """Sum duplicate rows (Keras' embedding gradient has one row per lookup)."""
    unique, position = tf.unique(g.indices)
    values = tf.math.unsorted_segment_sum(g.values, position, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, g.dense_shape)


def gather_bytes(data: bytes, name: str, process_set: ProcessSet) -> list[bytes]:
    """Every rank's ``data``, in rank order (two eager allgathers)."""
    if process_set.size() == 1:
        return [data]
    t = tf.constant(np.frombuffer(data, dtype=np.uint8))
    with guard(f"the allgather {name!r}"):
        sizes = mpi_ops.allgather(tf.constant([int(t.shape[0])], tf.int64),
                                  name=f"{name}.sizes", process_set=process_set)
        gathered = mpi_ops.allgather(t, name=name, process_set=process_set)
    sizes, raw = sizes.numpy().tolist(), gathered.numpy().tobytes()
    out, i = [], 0
    for n in sizes:
        out.append(raw[i:i + n])
        i += n
    return out


def gather_json(obj, name: str, process_set: ProcessSet) -> list:
    """Every rank's ``obj`` (JSON data), in rank order."""
    return [json.loads(b.decode())
            for b in gather_bytes(json.dumps(obj).encode(), name, process_set)]


def _settle_into(fn: Callable[[], Any], future: Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:  # the waiter re-raises it
        future.set_exception(e)


class _Request:
    def __init__(self, name: str, tensors: list, pending: Pending):
        self.name, self.tensors, self.pending = name, tensors, pending
        self.future: Optional[Future] = None
        self.index = 0


class KerasCommunicator:
    """Averages (or sums) gradients across ranks as Horovod's ``DistributedOptimizer`` does:
    dense gradients in grouped allreduces (with ``compression`` and
    ``gradient_predivide_factor``), ``IndexedSlices`` through Horovod's allgather path, or
    densified with ``sparse_as_dense``."""

    #: whether this rank's data collectives cross the link (two levels: the node's leader's,
    #: :mod:`hvdsync.keras.nodes`)
    carries = True

    def __init__(self, compression, op, gradient_predivide_factor: float,
                 sparse_as_dense: bool, process_set: ProcessSet, stats: SyncStats):
        self.compression = compression
        self.op = op
        self.predivide = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.stats = stats
        self._queue: list[_Request] = []
        self._pool: Optional[ThreadPoolExecutor] = None
        self._after: list[tuple[Callable[[], Any], Future]] = []
        self.matches_by_name = True  # Horovod
        #: what this rank is doing, compared before each entry's first collective
        #: (hvdsync.safety.entries); eager Horovod ops block, so each tag is checked at once
        # (a grace before raising: a compiled step checks its tag after its data started)
        self.entries = Entries(process_set, self._tag_round, grace_s=2.0)
        self._tag_functions: dict[str, Callable] = {}

    def _tag_round(self, values: list[float], name: str, what: str) -> Pending:
        self.stats.count("entry_tags", 1)
        with guard(what):  # eager: blocks here
            out = self._tag_function()(tf.constant(values, tf.float32)).numpy().tolist()
        return Pending.resolved(out)

    def _tag_op(self, values: tf.Tensor) -> tf.Tensor:
        """The entry tags' allreduce, under one name wherever it is built: a rank in a compiled
        step pairs with one in ``flush()`` (Horovod pairs by name; an eager op's name is its
        type's, so eager tags run through :meth:`_tag_function`). One name is enough: an eager
        tag is checked before anything else starts, a compiled step's before its update."""
        return mpi_ops._allreduce(values, name=self.entries.names()[0], op=Average,
                                  ignore_name_scope=True, process_set=self.process_set)

    def _tag_function(self) -> Callable:
        name = self.entries.names()[0]  # (set when the layers are known: name_after)
        if name not in self._tag_functions:
            self._tag_functions[name] = tf.function(self._tag_op, autograph=False)
        return self._tag_functions[name]

    def step_tag(self, step: tf.Tensor) -> tf.Tensor:
        """The compiled step's entry tag (graph ops): this rank is in a training step
        (``step``: its number), compared with every rank's; what the step's update waits
        for. Ranks that entered differently -- one in ``flush()`` or a save -- all raise
        :class:`~hvdsync.safety.agreement.RanksDisagree` (here through TensorFlow), naming
        what each called; the update waits for it, the step's data does not (a round trip
        before the first send cost 9 % of a 9 ms step: benchmarks/results/
        keras_overhead_np2_entry_tag.md)."""
        rank, size = self.process_set.rank(), self.size
        if size == 1:
            return tf.constant(True)
        # float32, as the gradients mostly are: Horovod can fuse it with the first of them
        mine = tf.stack([tf.constant(float(CODE["step"])), tf.cast(step, tf.float32)])
        shared = self._tag_op(tf.concat([tf.zeros([2 * rank]), mine,
                                         tf.zeros([2 * (size - rank - 1)])], 0))
        kinds = tf.round(shared[0::2] * size)

        def refuse(shared: tf.Tensor) -> tf.Tensor:
            rows = [round(v * size) for v in shared.numpy().tolist()]
            raise RanksDisagree(describe(rows[0::2], rows[1::2]))
        return tf.cond(tf.reduce_all(tf.equal(kinds, kinds[0])), lambda: tf.constant(True),
                       lambda: tf.py_function(refuse, [shared], tf.bool))

    @property
    def size(self) -> int:
        return self.process_set.size()

    def _op_and_scales(self) -> tuple:
        if self.op == Average and self.predivide != 1.0:
            return Sum, 1.0 / self.predivide, self.predivide / self.size
        return self.op, 1.0, 1.0

    def wire_bytes(self, g) -> int:
        """Payload after compression (fp16 halves float32 dense tensors)."""
        if isinstance(g, tf.IndexedSlices) and not self.sparse_as_dense:
            return payload_bytes(g)
        if not self.carries:
            return 0
        n = payload_bytes(tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g)
        fp16 = isinstance(self.compression, type) and issubclass(self.compression, FP16Compressor)
        if fp16 and g.dtype.is_floating and g.dtype.size > 2:
            return n * 2 // g.dtype.size
        return n

    def collectives(self, grads: Sequence) -> int:
        """How many collectives :meth:`reduce` runs for ``grads``."""
        sparse = (sum(isinstance(g, tf.IndexedSlices) for g in grads)
                  if not self.sparse_as_dense else 0)
        return sparse * 2 + (1 if sparse < len(grads) and self.carries else 0)

    def _moved(self, name: Optional[str], start: Callable[[], list], like: list,
               gathered: bool = False) -> list:
        """The result of the data collective ``start()`` (``like``: its inputs; ``gathered``:
        it concatenates every rank's along the first axis). Flat, every rank runs it; two
        levels, the node's leader (:mod:`hvdsync.keras.nodes`)."""
        return start()

    def reduce(self, grads: Sequence, name: Optional[str] = None) -> list:
        """Reduce ``grads`` now (graph ops in a traced function; eager ops, which need a
        ``name``, when running eagerly)."""
        if self.size == 1:
            return list(grads)
        op, pre, post = self._op_and_scales()
        grads = list(grads)
        out: list = [None] * len(grads)
        dense_pos = []
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices) and not self.sparse_as_dense:
                out[i] = hvd_allreduce(g, op=op, compression=self.compression,
                                       prescale_factor=pre, postscale_factor=post,
                                       name=None if name is None else f"{name}.sparse{i}",
                                       process_set=self.process_set)
            else:
                if isinstance(g, tf.IndexedSlices):
                    grads[i] = tf.convert_to_tensor(g)
                dense_pos.append(i)
        if dense_pos:
            pairs = [self.compression.compress(grads[i]) for i in dense_pos]
            compressed = [c for c, _ in pairs]
            reduced = self._moved(name, lambda: mpi_ops._grouped_allreduce(
                compressed, name=name, op=op, prescale_factor=pre, postscale_factor=post,
                process_set=self.process_set), compressed)
            for i, r, (_, ctx) in zip(dense_pos, reduced, pairs):
                out[i] = self.compression.decompress(r, ctx)
        return out

    # -- the pipeline's interface (eager) -----------------------------------------------------
    def allreduce(self, name: str, tensors: list) -> Pending:
        """Queue ``tensors`` for the next :meth:`dispatch`; the pending gives their reduction."""
        tensors = list(tensors)
        request = _Request(name, tensors, Pending())
        nbytes = sum(self.wire_bytes(t) for t in tensors) if self.size > 1 else 0
        request.pending = Pending(lambda: self._result(request), lambda: self._ready(request),
                                  nbytes, 0, what=f"the allreduce {name!r}")
        self._queue.append(request)
        return request.pending

    def dispatch(self, background: bool = False) -> None:
        """Send every queued request in one grouped allreduce (``background``: in a thread,
        so the step returns at once)."""
        requests, self._queue = self._queue, []
        if not requests:
            return
        if self.size > 1:
            self.entries.now("the step's grouped allreduce")
            requests[0].pending.collectives = self.collectives(
                [t for r in requests for t in r.tensors])
        key = zlib.crc32("|".join(r.name for r in requests).encode())
        flat = [t for r in requests for t in r.tensors]

        def run() -> list:
            with guard(f"the step's grouped allreduce 'hvdsync.step.{key:08x}'"):
                return self.reduce(flat, name=f"hvdsync.step.{key:08x}")
        if background:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hvdsync")
            future = self._pool.submit(run)
            after, self._after = self._after, []
            for fn, placeholder in after:  # right behind it, in the same order on every rank
                self._pool.submit(_settle_into, fn, placeholder)
        else:
            future = Future()
            future.set_result(run())
        i = 0
        for r in requests:
            r.future, r.index = future, i
            i += len(r.tensors)

    def after_dispatch(self, fn: Callable[[Callable[[str, list], list]], Any]) -> Future:
        """Run ``fn(reduce)`` in the background thread right after the next background dispatch
        (eager Horovod ops block, so collectives that depend on that dispatch's result -- low-rank
        Q rounds inside ``delay=`` -- are queued behind it, in the same order on every rank);
        ``reduce(name, tensors)``: a blocking allreduce, under the watchdog."""
        placeholder: Future = Future()
        self._after.append((partial(fn, self._reduce_now), placeholder))
        return placeholder

    def _reduce_now(self, name: str, tensors: list) -> list:
        with guard(f"the allreduce {name!r}"):
            return self.reduce(tensors, name=name)

    @staticmethod
    def _result(request: _Request) -> list:
        if request.future is None:
            raise RuntimeError("hvdsync: a queued allreduce was waited on before dispatch()")
        out = request.future.result()
        return out[request.index:request.index + len(request.tensors)]

    @staticmethod
    def _ready(request: _Request) -> bool:
        return request.future is not None and request.future.done()

    def control(self, values: Any, name: str, dtype: str = "float64") -> list[float]:
        """The control plane (eager): average a small vector of per-layer statistics across
        ranks in one collective, so every rank decides from the same numbers (``values``:
        floats or a device vector; ``dtype``: :func:`hvdsync.core.technique.control_dtype`)."""
        if tf.is_tensor(values):  # a device vector (KerasOps.concat)
            x = tf.cast(values, dtype)
            if self.size == 1:
                return x.numpy().tolist()
        elif self.size == 1:  # (in the vector's precision, as the ranks' average would be)
            return np.asarray(values, dtype=dtype).tolist()
        else:
            x = tf.constant(np.asarray(values, dtype=dtype))
        self.entries.now(f"the control allreduce {name!r}")
        self.stats.control(payload_bytes(x))
        with guard(f"the control allreduce {name!r}"):
            out = mpi_ops._allreduce(x, name=name, op=Average, process_set=self.process_set)
            return out.numpy().tolist()

    def control_async(self, values: Any, name: str, dtype: str = "float64") -> Pending:
        """:meth:`control`, done now (Horovod's eager TensorFlow ops block): the whole eager
        step runs after backward, so there is no backward left to overlap."""
        return Pending.resolved(self.control(values, name, dtype))

    def average(self, groups: list[tuple[str, list[Any]]]) -> None:
        """Average each named group of variables across ranks (eager) and assign the result."""
        if self.size == 1:
            return
        self.entries.now("the parameter averaging (delay=, flush())")
        for name, xs in groups:
            values = [tf.convert_to_tensor(x.value) for x in xs]
            with guard("the parameter averaging (delay=, flush())"):
                avg = self._moved(name, lambda: mpi_ops._grouped_allreduce(
                    values, name=name, op=Average, process_set=self.process_set), values)
            for x, a in zip(xs, avg):
                x.assign(a)

    def gather_json(self, obj, name: str) -> list:
        if self.size > 1:
            self.entries.now(f"the allgather {name!r}")
        return gather_json(obj, name, self.process_set)

    def allgather_async(self, name: str, tensors: list) -> Pending:
        """Gather every rank's 1-d ``tensors`` in the background thread (behind what it was
        given before, in the same order on every rank); ``wait()`` gives each one's pieces
        concatenated in rank order."""
        tensors = list(tensors)
        if self.size == 1:
            return Pending.resolved(tensors)
        self.entries.now(f"the allgather {name!r}")

        def run() -> list:  # one allgather per tensor: a grouped one takes a single dtype
            with guard(f"the allgather {name!r}"):
                return self._moved(name, lambda: [
                    mpi_ops.allgather(t, name=f"{name}.{i}", process_set=self.process_set)
                    for i, t in enumerate(tensors)], tensors, gathered=True)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hvdsync")
        future = self._pool.submit(run)
        return Pending(future.result, future.done,
                       sum(payload_bytes(t) for t in tensors) * self.carries,
                       len(tensors) * self.carries, what=f"the allgather {name!r}")

    @property
    def averages(self) -> bool:
        return self.op == Average

    def gather_rows(self, name: str, tensors: list) -> Pending:
        """:meth:`allgather`, done on return (``sparse=``'s rows)."""
        return ran_here(Pending.resolved(self.allgather(tensors, name)), self.carries)

    def sum_rows(self, name: str, tensors: list) -> Pending:
        """:meth:`sum`, done on return (``sparse=``'s dense route)."""
        return ran_here(Pending.resolved(self.sum(tensors, name)), self.carries)

    def allgather(self, tensors: list, name: str) -> list:
        """Eager grouped allgather (the sparse exchange's rows and counts)."""
        if self.size == 1:
            return list(tensors)
        self.entries.now(f"the allgather {name!r}")
        with guard(f"the allgather {name!r}"):
            return self._moved(name, lambda: mpi_ops.grouped_allgather(
                tensors, name=name, process_set=self.process_set), tensors, gathered=True)

    def sum(self, tensors: list, name: str) -> list:
        """Eager grouped allreduce with op Sum."""
        if self.size == 1:
            return list(tensors)
        self.entries.now(f"the allreduce {name!r}")
        with guard(f"the allreduce {name!r}"):
            return self._moved(name, lambda: mpi_ops._grouped_allreduce(
                tensors, name=name, op=Sum, process_set=self.process_set), tensors)


def ran_here(pending: Pending, carries: bool = True) -> Pending:
    """``pending``, run by this rank: one collective (sparse='s ports: its bytes count here),
    none where another rank of the node carries it (``carries``: two levels)."""
    pending.collectives = int(carries)
    return pending
