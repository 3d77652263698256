"""``sparse=`` for Keras ``IndexedSlices`` gradients: the sparse grouped allgather as a
transport. The protocol -- layouts, shared counts, routes, one round or counts first -- is
:class:`hvdsync.sparse.SparseProtocol`, the same as torch's; this file moves Keras' tensors:
each row carries its index bit-cast into extra value columns, the gradients of a step go in
one grouped allgather per value dtype (uneven counts in Horovod's uneven-size allgather), and
the layout codes ride bit-cast as its first tensor (``one_round``).

**Compiled** (Keras' train function, :meth:`SparseExchange.trace_exchange`): each variable's
route is a device boolean -- the host writes last step's choice (``host_flags``), or, where
the codes go first (the first step, ``one_round=False``), a branch gathers them and picks the
route on the device by :func:`hvdsync.sparse.choose_route`'s rule -- and each row-sparse
variable is one ``tf.cond(dense, allreduce, allgather)``; the codes reach the host in a
variable, where the protocol takes them in after the step (``end_traced_step``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf
from horovod.tensorflow.mpi_ops import Average

from hvdsync.keras.backend import KerasGradients
from hvdsync.keras.comm import KerasCommunicator, coalesce, payload_bytes
from hvdsync.sparse import ABSENT, DENSE, SparseConfig, SparseProtocol, SparseTransport
from hvdsync.stats import SyncStats
from hvdsync.pending import Pending
from hvdsync.traced import TracedRounds

_INDEX_BYTES = 8  # int64 row indices


class SparseExchange(SparseTransport, TracedRounds):
    """Moves the sparse (``IndexedSlices``) gradients of one step, as the torch adapter's
    exchange does: the protocol's decisions are :class:`hvdsync.sparse.SparseProtocol`'s."""

    traceable = True
    # beside a decider: its layers go every step, outside the decider's branches (they are
    # not decidable); lowrank='s rounds and its buckets are not built beside it
    traced_with = ("clip", "plain", "threshold", "select", "lowrank")

    def __init__(self, config: SparseConfig, grads: KerasGradients, comm: KerasCommunicator,
                 stats: SyncStats):
        self.config = config
        self.grads = grads
        self.comm = comm
        self.stats = stats
        #: every model variable in layer order: the protocol's parameter positions
        self._vars = [v for vs in grads.layer_vars for v in vs]
        self.protocol = SparseProtocol(config, [v.path for v in self._vars], stats)
        self._queue: list[tuple[int, int]] = []
        self._at: dict[int, tuple[int, int]] = {}  # position -> (layer, k) this step
        self._done: set[int] = set()  # positions sent with the codes (one round)
        #: compiled: the row-sparse variables of the traced step, whether its codes go first,
        #: and the variables the step leaves for the host (every rank's codes; rows, duplicates)
        self._traced: list[int] = []
        self._lookups: dict = {}
        self._counts_first = True
        with tf.init_scope():  # made with the optimizer: a variable made while the train
            # function is traced makes TensorFlow trace it a second time
            n = 2 * len(self._vars)  # (per rank: the world may change, Horovod Elastic)
            self._shared = tf.Variable(tf.zeros([comm.size, n], tf.int64),
                                       shape=tf.TensorShape([None, n]), trainable=False,
                                       name="hvdsync_sparse_codes")
            self._rows = tf.Variable(tf.zeros([2, len(self._vars)], tf.int64),
                                     trainable=False, name="hvdsync_sparse_rows")

    def owns(self, li: int, k: int) -> bool:
        return self.grads.is_row_sparse(li, k)

    def layer_ready(self, li: int, ks: list[int]) -> None:
        for k in ks:  # before clipping, so the duplicates are counted
            g = self.grads.get(li, k)
            merged = coalesce(g)
            self.stats.count("sparse_duplicate_rows",
                             int(tf.shape(g.indices)[0]) - int(tf.shape(merged.indices)[0]))
            self.grads.set(li, k, merged)

    def start(self, li: int, ks: list[int]) -> None:
        self._queue += [(li, k) for k in ks]

    def backward_done(self) -> None:
        """Every variable's layout code (a Keras variable is in every step of its train
        function or in none); counts first: share them now."""
        self._at, self._done = {}, set()
        local = [(ABSENT, 0)] * len(self._vars)
        for li in range(len(self.grads.layer_vars)):
            for k in range(self.grads.size(li)):
                i = int(self.grads.key(li, k))
                self._at[i] = (li, k)
                g = self.grads.get(li, k)  # (summed in layer_ready, after the step's stats)
                local[i] = ((int(tf.size(tf.unique(g.indices).y)), 1)
                            if isinstance(g, tf.IndexedSlices) else (DENSE, 0))
        codes = self.protocol.begin(local)
        if not self.config.one_round:
            self._share_codes(codes)

    def _share_codes(self, codes: list[int]) -> None:
        """The codes in an allgather of their own (counts first, or nothing to gather)."""
        self._absorb(self.comm.allgather([tf.constant([codes], tf.int64)],
                                         "hvdsync.sparse.layouts")[0], codes)

    def _absorb(self, gathered, codes: list[int], own_collective: bool = True) -> None:
        """Every rank's codes, gathered (in their own collective, or with the rows)."""
        if self.comm.size > 1:
            self.stats.control(8 * len(codes), collectives=int(own_collective))
        self.protocol.absorb(np.asarray(gathered).reshape(self.comm.size, -1).tolist())
        for i, (layout, _, _) in self.protocol.layout.items():
            if layout == "sparse" and i not in self._at:
                raise RuntimeError(f"the gradient of {self._vars[i].path!r} is sparse on some "
                                   "rank but this rank's train function has none: every rank "
                                   "must train the same variables")

    def start_early(self) -> dict[int, Pending]:
        """One round: the codes, with the rows of every variable routed as the last step's
        counts chose, in one grouped allgather (and one allreduce for those routed dense)."""
        if not self.config.one_round:
            return {}
        missing = [self._vars[i].path for i in self.protocol.predicted if i not in self._at]
        if missing:
            raise RuntimeError(f"the gradients of {missing} were sparse last step but this "
                               "rank's train function has none now")
        positions = sorted(self.protocol.predicted)
        routes = ["dense" if self.protocol.predicted[i] == "dense" else "gather"
                  for i in positions]
        self._done = set(positions)
        return self._send(positions, routes, header=self.protocol.codes)

    def flush(self) -> dict[int, Pending]:
        queued, self._queue = self._queue, []
        positions = sorted(i for i in (int(self.grads.key(li, k)) for li, k in queued)
                           if i not in self._done)
        if not positions:
            return {}
        return self._send(positions, routes=[self._route(i) for i in positions])

    def _route(self, i: int) -> str:
        """This step's route for variable ``i`` from the shared counts."""
        return self.protocol.route(i, *_route_bytes(self._vars[i])).route

    def _send(self, positions: list[int], routes: list[str],
              header: Optional[list[int]] = None) -> dict[int, Pending]:
        """Send the gradients at ``positions`` by ``routes`` (eager: done on return); with
        ``header`` (this rank's codes), share it bit-cast as the first tensor of the first
        value dtype's allgather (alone, if nothing is gathered) and absorb every rank's."""
        scale = 1.0 / self.comm.size if self.comm.op == Average else 1.0
        sends: dict[int, list[int]] = {}  # layer -> [bytes, collectives]
        items = [self._at[i] for i in positions]
        grads = [self.grads.get(li, k) for li, k in items]
        for i, route in zip(positions, routes):
            self.protocol.take(i, route)
        gather = [j for j, r in enumerate(routes) if r == "gather"]
        dense = [j for j, r in enumerate(routes) if r == "dense"]
        by_dtype: dict[tf.DType, list[int]] = {}
        for j in gather:  # one grouped allgather per value dtype (a group has one dtype)
            by_dtype.setdefault(grads[j].values.dtype, []).append(j)
        if header is not None and not by_dtype:
            self._share_codes(header)
            header = None
        for dtype, js in sorted(by_dtype.items(), key=lambda item: item[0].name):
            packed = [_pack(grads[j]) for j in js]
            for j, t in zip(js, packed):
                sends.setdefault(items[j][0], [0, 0])[0] += payload_bytes(t)
            first = [] if header is None else [_as_values(header, dtype)]
            gathered = self.comm.allgather(first + packed, f"hvdsync.sparse.rows.{dtype.name}")
            if header is not None:
                self._absorb(_from_values(gathered[0], self.comm.size), header,
                             own_collective=False)
                header, gathered = None, gathered[1:]
            for j, t in zip(js, gathered):
                self.grads.set(*items[j], _rows_summed(t, grads[j], scale))
            sends[items[js[0]][0]][1] += 1
        if dense:
            buffers = []
            for j in dense:
                buffers.append(_dense_buffer(grads[j], self._vars[positions[j]].shape))
                sends.setdefault(items[j][0], [0, 0])[0] += payload_bytes(buffers[-1])
            summed = self.comm.sum(buffers, "hvdsync.sparse.dense")
            for b, j in zip(summed, dense):
                self.grads.set(*items[j], _present_rows(b, grads[j], scale))
            sends[items[dense[0]][0]][1] += 1
        for j in gather:  # the codes are shared by now
            self.protocol.count_equal(positions[j])
        if self.comm.size == 1:
            return {}
        return {li: Pending(nbytes=b, collectives=c) for li, (b, c) in sends.items()}

    # -- compiled (hvdsync.keras.graph) -------------------------------------------------------
    def host_flags(self) -> dict:
        """``dense``: per variable, whether last step's counts route it dense this step;
        ``counts_first``: whether the codes go first this step (no history for a variable of
        the step, or ``one_round=False``)."""
        predicted = self.protocol.predicted
        self._counts_first = (not self.config.one_round or not predicted
                              or any(i not in predicted for i in self._traced))
        return {"dense": [predicted.get(i) == "dense" for i in range(len(self._vars))],
                "counts_first": self._counts_first}

    def traced_groups(self, one_layer_each: bool = False) -> list[list[int]]:
        """The layers with a row-sparse gradient, as one group (never decided: it goes
        every step, so never split)."""
        g = self.grads
        layers = [li for li in range(len(g.layer_vars))
                  if any(g.is_row_sparse(li, k) for k in range(g.size(li)))]
        self._traced = [int(g.key(li, k)) for li in layers for k in range(g.size(li))
                        if g.is_row_sparse(li, k)]
        self._at = {int(g.key(li, k)): (li, k) for li in range(len(g.layer_vars))
                    for k in range(g.size(li))}  # the step's variables
        # the lookups before anything merged them (a local clip sums duplicates first)
        self._lookups = {i: tf.cast(tf.shape(g.get(*self._at[i]).indices)[0], tf.int64)
                         for i in self._traced}
        return [layers] if layers else []

    def trace_exchange(self, layers, reduce, plain, flags, count=None) -> dict[int, list]:
        """One step of the protocol in the graph: sum duplicate rows, this rank's codes, the
        routes (host flags, or from codes gathered first), then per variable its route's
        collective; the codes every rank sent and the rows handed on go to variables for
        :meth:`end_traced_step`."""
        g, comm, n = self.grads, self.comm, len(self._vars)
        scale = 1.0 / comm.size if comm.op == Average else 1.0
        merged, duplicates = {}, {}
        codes = [tf.constant(ABSENT, tf.int64), tf.constant(0, tf.int64)] * n
        for li in range(len(g.layer_vars)):  # every variable of the step, as eagerly
            for k in range(g.size(li)):
                i = int(g.key(li, k))
                codes[2 * i] = tf.constant(DENSE, tf.int64)
                if g.is_row_sparse(li, k):
                    raw = g.get(li, k)
                    merged[i] = coalesce(raw)
                    rows = tf.cast(tf.shape(merged[i].indices)[0], tf.int64)
                    duplicates[i] = self._lookups[i] - rows
                    codes[2 * i], codes[2 * i + 1] = rows, tf.constant(1, tf.int64)
        codes = tf.stack(codes)
        dense = tf.cond(flags["counts_first"], lambda: self._routes_from(self._gathered(
            comm.allgather([tf.reshape(codes, [1, -1])], "hvdsync.sparse.layouts")[0])),
            lambda: flags["dense"])
        out: dict[int, list] = {}
        header = codes
        rows_out = [tf.constant(0, tf.int64)] * n
        for li, ks in layers:
            plain_ks = [k for k in ks if not g.is_row_sparse(li, k)]
            reduced = dict(zip(plain_ks, plain(li, [g.get(li, k) for k in plain_ks])))
            for k in ks:
                if k in reduced:
                    continue
                i = int(g.key(li, k))
                values, indices, gathered = self._trace_route(
                    li, i, merged[i], dense[i], header, scale, count)
                if header is not None:
                    self._shared.assign(gathered)
                    header = None
                rows_out[i] = tf.cast(tf.shape(indices)[0], tf.int64)
                reduced[k] = tf.IndexedSlices(values, indices, merged[i].dense_shape)
            out[li] = [reduced[k] for k in ks]
        dup = [duplicates.get(i, tf.constant(0, tf.int64)) for i in range(n)]
        self._rows.assign(tf.stack([tf.stack(rows_out), tf.stack(dup)]))
        return out

    def _trace_route(self, li: int, i: int, g: tf.IndexedSlices, dense, header, scale: float,
                     count) -> tuple:
        """``tf.cond(dense, allreduce, allgather)`` for variable ``i``'s summed rows ``g``;
        ``header``: this rank's codes to gather with them (else ``None``). Returns the
        rank-summed rows (values, indices) and every rank's codes (``[size, codes]``)."""
        comm, dtype = self.comm, g.values.dtype
        like = tf.zeros([comm.size, 2 * len(self._vars)], tf.int64)

        def gather():
            packed = _pack(g)
            first = [] if header is None else [_as_values(header, dtype)]
            got = comm.allgather(first + [packed], f"hvdsync.sparse.rows.{dtype.name}.{i}")
            if count is not None:
                count(li, tf.size(packed, tf.int64) * dtype.size, 1)
            summed = _rows_summed(got[-1], g, scale)
            return (summed.values, summed.indices,
                    like if header is None else self._gathered(got[0]))

        def allreduce():
            buffer = _dense_buffer(g, self._vars[i].shape)
            b = comm.sum([buffer], f"hvdsync.sparse.dense.{i}")[0]
            if count is not None:
                count(li, payload_bytes(buffer), 1)
            summed = _present_rows(b, g, scale)
            codes = like if header is None else self._gathered(comm.allgather(
                [_as_values(header, dtype)], f"hvdsync.sparse.codes.{dtype.name}")[0])
            return summed.values, summed.indices, codes
        return tf.cond(dense, allreduce, gather)

    def _gathered(self, values: tf.Tensor) -> tf.Tensor:
        """Every rank's codes from their gathered bits, in the codes variable's shape."""
        return tf.reshape(_from_values(values, self.comm.size),
                          [self.comm.size, 2 * len(self._vars)])

    def _routes_from(self, shared: tf.Tensor) -> tf.Tensor:
        """Per variable, whether this step's shared codes route it dense
        (:func:`hvdsync.sparse.choose_route` on the device)."""
        counts = tf.reduce_sum(tf.maximum(shared[:, 0::2], 0), axis=0)
        row, whole = zip(*(_route_bytes(v) for v in self._vars))
        gathered = tf.cast(counts, tf.float64) * tf.constant(row, tf.float64)
        return gathered > self.config.dense_ratio * tf.constant(whole, tf.float64)

    def trace_commit(self, ok) -> list:
        """No memory of tensors; the host reads every rank's codes and the rows after the
        step (read here, after the step wrote them: the host call waits for these reads)."""
        return [self._shared.read_value(), self._rows.read_value()]

    def end_traced_step(self, ok: bool) -> None:
        """The protocol's host side of a compiled step: every rank's codes taken in, the
        routes the step took (from them, where they went first; else as predicted), the
        counters, the next step's routes."""
        codes = self._shared.numpy()
        rows, dup = self._rows.numpy().tolist()
        first = self._counts_first
        own = codes[self.comm.process_set.rank()].reshape(-1, 2)
        self.protocol.begin([(int(c), int(d)) for c, d in own])
        self._absorb(codes, self.protocol.codes, own_collective=first)
        for i in self._traced:
            route = (self._route(i) if first
                     else "dense" if self.protocol.predicted.get(i) == "dense" else "gather")
            route = "gather" if route == "none" else route  # (the graph gathers no rows)
            self.protocol.take(i, route)
            if route == "gather":
                self.protocol.count_equal(i)
            self.stats.count("sparse_duplicate_rows", int(dup[i]))
        self.protocol.end_step(self._route, lambda i: int(rows[i]))

    def end_step(self, ok: bool) -> None:
        def rows(i: int) -> int:
            g = self.grads.get(*self._at[i]) if i in self._at else None
            return int(tf.shape(g.indices)[0]) if isinstance(g, tf.IndexedSlices) else 0
        self.protocol.end_step(self._route, rows)

    def status(self) -> dict:
        return dict(self.protocol.last_routes)


def _as_values(codes, dtype: tf.DType) -> tf.Tensor:
    """``[1, w]``: the int64 codes (a list or tensor) bit-cast into the value dtype (an
    allgather copies bytes)."""
    bits = tf.bitcast(tf.convert_to_tensor(codes, tf.int64), dtype)
    return tf.reshape(bits, [1, -1])


def _from_values(gathered: tf.Tensor, size: int) -> tf.Tensor:
    """Inverse of :func:`_as_values` on the gathered ``[size, w]``: ``[size, codes]``."""
    k = 8 // gathered.dtype.size
    bits = tf.reshape(gathered, [size, -1] if k == 1 else [size, -1, k])
    return tf.bitcast(bits, tf.int64)


def _route_bytes(v) -> tuple[int, int]:
    """What a gathered row of variable ``v`` (its values and index) and its dense tensor cost
    on the wire: :func:`hvdsync.sparse.choose_route`'s inputs."""
    shape, size = [int(d) for d in v.shape], tf.as_dtype(v.dtype).size
    return int(np.prod(shape[1:])) * size + _INDEX_BYTES, int(np.prod(shape)) * size


def _pack(g: tf.IndexedSlices) -> tf.Tensor:
    """``[rows, width + k]``: each row's values, then its int64 index bit-cast into ``k``
    columns of the value dtype (bit-for-bit: an allgather copies bytes, no arithmetic)."""
    rows = tf.reshape(g.values, [-1, _width(g)])
    index = tf.bitcast(tf.cast(g.indices, tf.int64), g.values.dtype)
    if index.shape.rank == 1:  # same width (float64)
        index = tf.expand_dims(index, 1)
    return tf.concat([rows, index], axis=1)


def _unpack(packed: tf.Tensor, like: tf.IndexedSlices) -> tf.IndexedSlices:
    k = 8 // packed.dtype.size
    width = _width(like)  # (static: a traced allgather's output shape is not)
    index = packed[:, width:]
    index = tf.bitcast(index[:, 0] if k == 1 else index, tf.int64)
    values = tf.reshape(packed[:, :width], [-1, *like.values.shape[1:]])
    return tf.IndexedSlices(values, tf.cast(index, like.indices.dtype), like.dense_shape)


def _rows_summed(gathered: tf.Tensor, like: tf.IndexedSlices,
                 scale: float) -> tf.IndexedSlices:
    """The gather route's result: every rank's packed rows (gathered), duplicates across ranks
    summed, times ``scale`` (``1 / ranks`` for ``Average``)."""
    merged = coalesce(_unpack(gathered, like))
    return tf.IndexedSlices(merged.values * tf.constant(scale, like.values.dtype),
                            merged.indices, like.dense_shape)


def _dense_buffer(g: tf.IndexedSlices, shape) -> tf.Tensor:
    """The dense route's tensor: ``g``'s rows scattered into the variable's (static)
    ``shape``, flattened per row, with a "present" column of ones where a row is."""
    shape = [int(d) for d in shape]
    flat = tf.reshape(g.values, [-1, int(np.prod(shape[1:]))])
    rows = tf.concat([flat, tf.ones([tf.shape(flat)[0], 1], flat.dtype)], axis=1)
    return tf.scatter_nd(tf.expand_dims(g.indices, 1), rows, [shape[0], flat.shape[1] + 1])


def _present_rows(summed: tf.Tensor, like: tf.IndexedSlices, scale: float) -> tf.IndexedSlices:
    """The dense route's result: the rows some rank had (present column > 0), times
    ``scale``."""
    present = tf.cast(tf.where(summed[:, -1] > 0)[:, 0], like.indices.dtype)
    rows = tf.gather(summed[:, :-1], present) * tf.constant(scale, like.values.dtype)
    return tf.IndexedSlices(tf.reshape(rows, [-1, *like.values.shape[1:]]), present,
                            like.dense_shape)


def _width(g: tf.IndexedSlices) -> int:
    """Values per row (the row shape is static: the variable's)."""
    return int(np.prod(g.values.shape[1:]))
