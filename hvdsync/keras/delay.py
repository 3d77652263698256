"""Local updates with stale global gradients for Keras (technique 2; the schedule lives in
:mod:`hvdsync.delay`).

Horovod's TensorFlow ops block until their collective finishes, so a step cannot leave one in
flight inside the compiled train function. Each step therefore hands its layers' allreduces to
one background thread (eager Horovod ops, named by layer and step slot so they match across
ranks) and returns at once: the next steps' forward and backward run while they travel. The
update folds in the global gradients that have arrived (or are due) exactly as the torch
adapter does: ``d_t = g_t + sum_j (G_j - g_j)``. Every K-th step drains, updates and then
averages the variables (and, with ``optimizer_state="average"``, the optimizer slots).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import tensorflow as tf
from horovod.tensorflow import mpi_ops
from horovod.tensorflow.mpi_ops import Average

from hvdsync.delay import DelayConfig, DelayPolicy, staleness_histogram
from hvdsync.keras.comm import Reducer, payload_bytes
from hvdsync.keras.techniques import EagerTechnique, Slots, StepLayout
from hvdsync.stats import SyncStats


class EagerDelay(EagerTechnique):
    def __init__(self, config: DelayConfig, reducer: Reducer, slots: Slots, stats: SyncStats):
        self.config = config
        self.policy = DelayPolicy(config, stats)
        self.reducer = reducer
        self.slots = slots
        self.stats = stats
        # step id -> (per layer (positions, local gradients), future of the reduced ones)
        self._in_flight: dict[int, tuple[list[tuple[list[int], list]], Future]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hvdsync-delay")
        self._average_after_step = False

    @property
    def outstanding(self) -> list[int]:
        return sorted(self._in_flight)

    def before_apply(self, layout: StepLayout, grads: list, values: list) -> list:
        for g in grads:
            if isinstance(g, tf.IndexedSlices):
                raise ValueError("delay= supports dense gradients only (pass "
                                 "sparse_as_dense=True or no delay)")
        t = self.policy.current
        slot = t % (self.config.staleness + 1)
        parts = [(positions, [grads[p] for p in positions]) for _, positions in layout.layers]
        layers = [(layout.names[li], local) for (li, _), (_, local) in zip(layout.layers, parts)]
        for g in grads:
            self.stats.dense(payload_bytes(g))
        self.reducer.record_sent(layers, self.stats)
        # all layers of the step in one grouped allreduce, in the background
        self._in_flight[t] = (parts, self._pool.submit(self.reducer.reduce_layers, layers,
                                                       f"delay{slot}"))

        ids = self.outstanding
        ready = {j for j in ids if self._in_flight[j][1].done()}
        wait_for, fold = self.policy.plan(ids, ready)
        waited: Optional[float] = None
        if wait_for:
            start = time.perf_counter()
            for j in wait_for:
                self._in_flight[j][1].result()
            waited = time.perf_counter() - start
        folded = [self._in_flight.pop(j) for j in fold]
        own = bool(fold) and fold[0] == t  # this step's global gradient is back: use it
        out = list(grads)
        current = folded[0] if own else self._in_flight[t]
        corrections = [(part, future.result()) for part, future in (folded[1:] if own else folded)]
        own_global = current[1].result() if own else None
        for k, (positions, local) in enumerate(current[0]):
            for i, p in enumerate(positions):
                update = own_global[k][i] if own else local[i]
                for part, reduced in corrections:
                    update = update + reduced[k][i] - part[k][1][i]
                out[p] = update
        self._average_after_step = self.policy.averages_now()
        if self._average_after_step:
            self.stats.count("averaged")
            self.stats.control(*self._averaging_size(layout))
        self.policy.finish_step(fold, waited, len(self._in_flight))
        return out

    def after_apply(self, layout: StepLayout) -> None:
        if self._average_after_step:
            self._average_after_step = False
            self._average(layout)

    def flush(self, layout: Optional[StepLayout]) -> int:
        """Wait for every outstanding global gradient and average the replicas (see
        ``DistributedOptimizer.flush``); returns how many this rank discarded."""
        if layout is None or self.config.synchronous \
                or self.policy.step % self.config.average_every == 0:
            return 0
        dropped = self.discard()
        self.stats.control(*self._averaging_size(layout))
        self._average(layout)
        return dropped

    def discard(self) -> int:
        n = len(self._in_flight)
        for _, future in self._in_flight.values():
            future.result()
        self._in_flight.clear()
        self._average_after_step = False
        if n:
            self.stats.count("discarded", n)
        return n

    forget = discard

    def status(self) -> dict:
        return {"step": self.policy.step, "outstanding": self.outstanding,
                "last_folded": list(self.policy.last_folded),
                "staleness": staleness_histogram(self.stats.total.counters)}

    def state_dict(self, ids: dict[str, str]) -> dict:
        return {"policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict, paths: dict[str, str]) -> None:
        self.discard()
        self.policy.load_state_dict(state["policy"])

    # -- averaging the replicas ---------------------------------------------------------------
    def _averaged(self, layout: StepLayout) -> list[tuple[str, list]]:
        """Per layer and dtype, the variables averaged: the model's, then (``"average"``)
        their optimizer slots."""
        groups = []
        for li, positions in layout.layers:
            by_dtype: dict[str, list] = {}
            for p in positions:
                v = layout.variables[p]
                tensors = [v] + (self.slots.of[v.path] if self.config.optimizer_state == "average"
                                 else [])
                for x in tensors:
                    by_dtype.setdefault(str(x.dtype), []).append(x)
            groups += [(f"hvdsync.average.{layout.names[li]}.{d}", xs)
                       for d, xs in by_dtype.items()]
        return groups

    def _averaging_size(self, layout: StepLayout) -> tuple[int, int]:
        if self.reducer.size == 1:
            return 0, 0
        groups = self._averaged(layout)
        return (sum(x.shape.num_elements() * tf.as_dtype(x.dtype).size
                    for _, xs in groups for x in xs), len(groups))

    def _average(self, layout: StepLayout) -> None:
        if self.reducer.size == 1:
            return
        for name, xs in self._averaged(layout):
            avg = mpi_ops._grouped_allreduce([tf.convert_to_tensor(x.value) for x in xs],
                                             name=name, op=Average,
                                             process_set=self.reducer.process_set)
            for x, a in zip(xs, avg):
                x.assign(a)
