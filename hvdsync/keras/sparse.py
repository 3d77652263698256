"""``sparse=`` compiled into Keras' train function: the core's sparse exchange
(:class:`hvdsync.techniques.sparse.exchange.Sparse`, which runs the eager steps) with its traced
form. Each variable's route is a device boolean -- the host writes last step's choice
(:meth:`host_flags`), or, where the codes go first (the first step, ``one_round=False``), a
branch gathers them and picks the route on the device by
:func:`hvdsync.techniques.sparse.protocol.choose_route`'s rule -- and each row-sparse variable is one
``tf.cond(dense, allreduce, allgather)``; the codes reach the host in a variable, where the
protocol takes them in after the step (:meth:`end_traced_step`).
"""

from __future__ import annotations

import tensorflow as tf

from hvdsync.keras.backend import KerasGradients
from hvdsync.keras.comm import KerasCommunicator, coalesce, payload_bytes, ran_here
from hvdsync.keras.rows import KerasRows, from_values
from hvdsync.core.wire import Pending
from hvdsync.techniques.sparse.protocol import ABSENT, DENSE
from hvdsync.techniques.sparse.codec import GatheredRows, ScatteredRows
from hvdsync.techniques.sparse.config import SparseConfig
from hvdsync.techniques.sparse.exchange import Sparse
from hvdsync.core.stats import SyncStats
from hvdsync.core.traced import TracedRounds


class TracedSparse(Sparse, TracedRounds):
    """The sparse exchange of a Keras model, eager or compiled."""

    traceable = True

    def __init__(self, config: SparseConfig, grads: KerasGradients, comm: KerasCommunicator,
                 stats: SyncStats):
        variables = [v for vs in grads.layer_vars for v in vs]
        super().__init__(config, grads, comm, KerasRows(), stats, [v.path for v in variables],
                         [v.shape for v in variables],
                         [tf.as_dtype(v.dtype).size for v in variables], len(grads.layer_vars))
        #: the row-sparse variables of the traced step, whether its codes go first, and the
        #: variables the step leaves for the host (every rank's codes; rows, duplicates)
        self._traced: list[int] = []
        self._lookups: dict = {}
        self._counts_first = True
        with tf.init_scope():  # made with the optimizer: a variable made while the train
            # function is traced makes TensorFlow trace it a second time
            n = 2 * len(variables)  # (per rank: the world may change, Horovod Elastic)
            self._shared = tf.Variable(tf.zeros([comm.size, n], tf.int64),
                                       shape=tf.TensorShape([None, n]), trainable=False,
                                       name="hvdsync_sparse_codes")
            self._rows = tf.Variable(tf.zeros([2, len(variables)], tf.int64),
                                     trainable=False, name="hvdsync_sparse_rows")

    def host_flags(self) -> dict:
        """``dense``: per variable, whether last step's counts route it dense this step;
        ``counts_first``: whether the codes go first this step (no history for a variable of
        the step, or ``one_round=False``)."""
        self._counts_first = self.codes_go_first(self._traced)
        return {"dense": self.predicted_dense(), "counts_first": self._counts_first}

    def traced_groups(self, one_layer_each: bool = False) -> list[list[int]]:
        """The layers with a row-sparse gradient, as one group (never decided: it goes
        every step, so never split)."""
        g = self.grads
        layers = [li for li in range(len(g.layer_vars))
                  if any(g.is_row_sparse(li, k) for k in range(g.size(li)))]
        self._traced = [int(g.key(li, k)) for li in layers for k in range(g.size(li))
                        if g.is_row_sparse(li, k)]
        self._at = {i: (li, k) for i, li, k in self._each()}  # the step's variables
        # the lookups before anything merged them (a local clip sums duplicates first)
        self._lookups = {i: tf.cast(tf.shape(g.get(*self._at[i]).indices)[0], tf.int64)
                         for i in self._traced}
        return [layers] if layers else []

    def trace_exchange(self, layers, reduce, plain, flags, count=None) -> dict[int, list]:
        """One step of the protocol in the graph: sum duplicate rows, this rank's codes, the
        routes (host flags, or from codes gathered first), then per variable its route's
        collective; the codes every rank sent and the rows handed on go to variables for
        :meth:`end_traced_step`."""
        g, comm, n = self.grads, self.comm, len(self.shapes)
        divide_by = self.divisor()
        merged, duplicates = {}, {}
        codes = [tf.constant(ABSENT, tf.int64), tf.constant(0, tf.int64)] * n
        for i, li, k in self._each():  # every variable of the step, as eagerly
            codes[2 * i] = tf.constant(DENSE, tf.int64)
            if g.is_row_sparse(li, k):
                merged[i] = coalesce(g.get(li, k))
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
                    li, i, merged[i], dense[i], header, divide_by, count)
                if header is not None:
                    self._shared.assign(gathered)
                    header = None
                rows_out[i] = tf.cast(tf.shape(indices)[0], tf.int64)
                reduced[k] = tf.IndexedSlices(values, indices, merged[i].dense_shape)
            out[li] = [reduced[k] for k in ks]
        dup = [duplicates.get(i, tf.constant(0, tf.int64)) for i in range(n)]
        self._rows.assign(tf.stack([tf.stack(rows_out), tf.stack(dup)]))
        return out

    def _trace_route(self, li: int, i: int, g: tf.IndexedSlices, dense, header, divide_by: int,
                     count) -> tuple:
        """``tf.cond(dense, allreduce, allgather)`` for variable ``i``'s summed rows ``g``;
        ``header``: this rank's codes to gather with them (else ``None``). Returns the
        rank-summed rows (values, indices) and every rank's codes (``[size, codes]``)."""
        comm, rows, dtype, shape = self.comm, self.rows, g.values.dtype, self.shapes[i]
        like = tf.zeros([comm.size, 2 * len(self.shapes)], tf.int64)

        def gather():
            codec = GatheredRows(shape, 1)
            (packed,), ctx = codec.encode(rows, [g])
            first = [] if header is None else [rows.codes(header, packed)]
            got = comm.allgather(first + [packed], f"hvdsync.sparse.rows.{dtype.name}.{i}")
            if count is not None:
                count(li, tf.size(packed, tf.int64) * dtype.size, 1)
            summed, = codec.average(rows, got[-1:], divide_by, ctx)
            return (summed.values, summed.indices,
                    like if header is None else self._gathered(got[0]))

        def allreduce():
            codec = ScatteredRows(shape, 1)
            (buffer,), ctx = codec.encode(rows, [g])
            summed_rows = comm.sum([buffer], f"hvdsync.sparse.dense.{i}")
            if count is not None:
                count(li, payload_bytes(buffer), 1)
            summed, = codec.average(rows, summed_rows, divide_by, ctx)
            codes = like if header is None else self._gathered(comm.allgather(
                [rows.codes(header, g.values)], f"hvdsync.sparse.codes.{dtype.name}")[0])
            return summed.values, summed.indices, codes
        return tf.cond(dense, allreduce, gather)

    def _gathered(self, values: tf.Tensor) -> tf.Tensor:
        """Every rank's codes from their gathered bits, in the codes variable's shape."""
        return tf.reshape(from_values(values, self.comm.size),
                          [self.comm.size, 2 * len(self.shapes)])

    def _routes_from(self, shared: tf.Tensor) -> tf.Tensor:
        """Per variable, whether this step's shared codes route it dense
        (:func:`hvdsync.techniques.sparse.protocol.choose_route` on the device)."""
        counts = tf.reduce_sum(tf.maximum(shared[:, 0::2], 0), axis=0)
        row, limit = self.dense_limits()
        gathered = tf.cast(counts, tf.float64) * tf.constant(row, tf.float64)
        return gathered > tf.constant(limit, tf.float64)

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
        self._absorb(ran_here(Pending.resolved([tf.constant(codes)])), self.protocol.codes,
                     own_collective=first)  # (gathered by this rank, in the graph)
        for i in self._traced:
            route = (self._route(i) if first
                     else "dense" if self.protocol.predicted.get(i) == "dense" else "gather")
            route = "gather" if route == "none" else route  # (the graph gathers no rows)
            self.protocol.take(i, route)
            if route == "gather":
                self.protocol.count_equal(i)
            self.stats.count("sparse_duplicate_rows", int(dup[i]))
        self.protocol.end_step(self._route, lambda i: int(rows[i]))
