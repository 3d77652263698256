"""``lowrank=`` inside ``delay=``: each step's exchange is the compressed one, its P round
started in backward, its Q round once P has arrived, its ``P Q^T`` folded in by delay up to
``staleness`` steps later. Two rules change because rounds overlap later steps: step ``t``
warm-starts from the Q step ``t - 1 - staleness`` produced (the newest every rank has), and
each exchange's residual joins ``E`` when delay folds it in (an exchange a flush drops gives
back the ``E`` it took). docs/lowrank.md, "Compositions"; the traced form is
:mod:`hvdsync.techniques.lowrank.in_delay_traced`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from hvdsync.techniques.lowrank.memory import LowRankBase
from hvdsync.techniques.lowrank.config import LowRankConfig
from hvdsync.techniques.lowrank.codec import FACTORS
from hvdsync.techniques.lowrank.in_delay_traced import TracedRing, ring_memory, traffic
from hvdsync.core.wire import Pending
from hvdsync.core.ports import Communicator, Gradients, TensorOps


class _Exchange(Pending):
    """One layer's exchange of one step inside ``delay=`` (see
    :meth:`LowRankInDelay.exchange`)."""

    def __init__(self, owner: "LowRankInDelay", step: int, ks: list[int], grads: list,
                 plain: list[int], plain_p: Pending, compressed: list[int], keys: list[str],
                 ms: list, taken: list, p_round: Pending, name: str, q_bytes: int):
        super().__init__(self._finish, self._poll, plain_p.nbytes + p_round.nbytes + q_bytes,
                         plain_p.collectives + p_round.collectives + 1,
                         what=f"the low-rank exchange {name!r}")
        self.owner, self.step, self.ks, self.grads = owner, step, ks, grads
        self.plain, self.plain_p, self.compressed = plain, plain_p, compressed
        self.keys, self.ms, self.taken, self.p_round, self.name = keys, ms, taken, p_round, name
        self._q: Optional[Pending] = None
        self._ctx: Any = None  # the codec's context after its P round
        self._residuals: list = []
        # Keras: eager Horovod ops block its background thread, so the Q round runs there
        # right behind the step's flush (the same order on every rank); torch starts it when
        # this rank first sees P arrived (Horovod matches async collectives by name)
        self._chained = owner.comm.after_dispatch(self._q_round_blocking)

    def _q_parts(self) -> list:
        """The Q round's parts from the arrived P (the codec's next round)."""
        parts, self._ctx = FACTORS.next_round(self.owner.ops, self.p_round.wait(), self.ms)
        return parts

    def _q_round_blocking(self, reduce) -> None:
        self._q = Pending.resolved(reduce(f"{self.name}.Q", self._q_parts()))

    def _start_q(self) -> None:
        if self._chained is not None:
            self._chained.result()
        elif self._q is None:
            self._q = self.owner.comm.allreduce(f"{self.name}.Q", self._q_parts())

    def wait_idle(self) -> list:
        if self._chained is None and self._q is None and not self.owner.comm.matches_by_name:
            # due now (every rank waits for it at this point): its Q round, and the older
            # ones', start here -- polling would never start them (see _poll)
            self.owner._start_arrived(due=self.step)
        return super().wait_idle()

    def _poll(self) -> bool:
        if not (self.plain_p.ready() and self.p_round.ready()):
            return False
        if self._chained is not None:
            return self._chained.done()
        if self._q is None and not self.owner.comm.matches_by_name:
            return False  # its Q round starts when due, on every rank alike
        self._start_q()
        return self._q.ready()

    def _finish(self) -> list:
        if self._chained is None:  # due: every due exchange's Q round in flight at once
            self.owner._start_arrived(due=self.step)
        self._start_q()
        ops = self.owner.ops
        q_avg = self._q.wait()
        full: list = [None] * len(self.ks)
        for i, x in zip(self.plain, self.plain_p.wait()):
            full[i] = x
        approx = FACTORS.average(ops, q_avg, self.owner.comm.size, self._ctx)
        # the residuals are this rank's, committed when used
        self._residuals = FACTORS.residual(ops, approx, self._ctx)
        for i, key, q, x in zip(self.compressed, self.keys, q_avg, approx):
            # Q is shared: recorded whenever it arrives (the warm start reads only the ones
            # every rank has)
            self.owner._q_at.setdefault(key, {})[self.step] = q
            full[i] = ops.from_matrix(x, self.grads[i])
        return full

    def used(self) -> None:
        """Folded in: each matrix's residual joins ``E``."""
        self.wait()
        self.owner.settled(self)
        for key, r in zip(self.keys, self._residuals):
            _add_into(self.owner.ops, self.owner.err, key, r)

    def discard(self) -> None:
        """Dropped before use (a flush averages the replicas instead): the ``E`` it took
        comes back."""
        self.wait()
        self.owner.settled(self)
        for key, e in zip(self.keys, self.taken):
            if e is not None:
                _add_into(self.owner.ops, self.owner.err, key, e)


class LowRankInDelay(LowRankBase):
    """``lowrank=`` carried by ``delay=`` (:class:`hvdsync.techniques.delay.carried.CarriedCompressor`): delay
    runs every exchange; in the step pipeline it owns nothing."""

    def __init__(self, config: LowRankConfig, grads: Gradients, ops: TensorOps,
                 comm: Communicator, layer_names: list[str], staleness: int,
                 finished_steps: Callable[[], int]):
        super().__init__(config, grads, ops, comm, layer_names)
        self._lag = staleness + 1  # which Q every rank has for the warm start
        self._finished = finished_steps  # delay's step count (ids are 1, 2, ...)
        self._q_at: dict[str, dict[int, Any]] = {}  # Q per matrix by the step that made it
        self._no_q: list[_Exchange] = []  # torch: exchanges whose Q round waits for P
        self._live: list[_Exchange] = []  # started, not yet used or discarded
        self._ring: Optional[TracedRing] = None  # traced: the memory in device variables
        self._trace_keys: list[str] = []

    def owns(self, li: int, k: int) -> bool:
        return False

    def end_step(self, ok: bool) -> None:
        if ok:  # a skipped step does not count (warm-up ends as if it never happened)
            self.step += 1

    # -- eager ------------------------------------------------------------------------------
    def exchange(self, li: int, ks: list[int], grads: list, step: int, lag: int,
                 name: str) -> Pending:
        """``delay=``'s exchange of one layer's gradients ``grads`` (copies; of parameters
        ``ks``) for global step ``step``: compressible matrices (after warm-up) by P and Q
        rounds, the rest plain, every round named from ``name``. ``wait()`` gives the
        rank-averaged gradients (``P Q^T`` for matrices); ``ready()`` starts the Q round once
        P has arrived; delay calls ``used()`` when it folds them in (the residuals join ``E``)
        or ``discard()`` when it drops them (the ``E`` they took comes back). ``lag``:
        staleness + 1 (which ``Q`` every rank has for the warm start)."""
        g, ops = self.grads, self.ops
        compressed = [i for i, k in enumerate(ks)
                      if step > self.config.warmup_steps and self.rank_for(li, k) > 0]
        plain = [i for i in range(len(ks)) if i not in compressed]
        plain_p = (self.comm.allreduce(f"{name}.plain", [grads[i] for i in plain])
                   if plain else Pending.resolved([]))
        if not compressed:
            return plain_p
        ms, qs, taken, keys = [], [], [], []
        for i in compressed:
            key = g.key(li, ks[i])
            m = ops.matrix(grads[i])
            e = self.err.pop(key, None)  # every residual joins exactly one later exchange
            taken.append(e)
            ms.append(m if e is None else ops.add(m, e))
            keys.append(key)
            qs.append(self._warm_q(key, li, ks[i], m, step - lag))
        ps, _ = FACTORS.encode(ops, ms, qs)
        p_round = self.comm.allreduce(f"{name}.P", ps)
        rows = sum(ops.matrix_shape(p)[0] * ops.matrix_shape(p)[1] for p in ps)
        cols = sum(ops.matrix_shape(m)[1] * ops.matrix_shape(p)[1] for m, p in zip(ms, ps))
        exchange = _Exchange(self, step, ks, grads, plain, plain_p, compressed, keys, ms,
                                   taken, p_round, name, p_round.nbytes * cols // max(rows, 1))
        self._live.append(exchange)
        if exchange._chained is None:
            self._no_q.append(exchange)
            self._start_arrived()  # a layer is ready: earlier exchanges' Q rounds can go
        return exchange

    def _start_arrived(self, due: Optional[int] = None) -> None:
        """torch, inside ``delay=``: start the Q round of the exchanges (oldest first) whose P
        has arrived -- and, with ``due``, of every exchange of steps <= ``due``, waiting for
        its P: one P and one Q round of latency for a step's layers, not one per layer."""
        by_name = self.comm.matches_by_name  # else only the due ones: the same on every rank
        while self._no_q and (self._no_q[0]._q is not None
                              or (by_name and self._no_q[0].p_round.ready())
                              or (due is not None and self._no_q[0].step <= due)):
            self._no_q.pop(0)._start_q()

    def _warm_q(self, key: str, li: int, k: int, m: Any, newest: int) -> Any:
        """The Q to start from: the one produced by the newest step <= ``newest`` (every rank
        has it), else the seeded initial one; older ones are dropped."""
        versions = self._q_at.get(key, {})
        usable = [j for j in versions if j <= newest]
        if usable:
            j = max(usable)
            for old in [x for x in versions if x < j]:
                del versions[old]
            return versions[j]
        return self._initial_q(key, li, k, m)

    def settled(self, exchange: _Exchange) -> None:
        """``exchange`` was used or discarded (no longer in flight)."""
        if exchange in self._live:
            self._live.remove(exchange)

    # -- traced (Keras' compiled train function): the ring in lowrank_delay_traced ---------
    def memory_to_trace(self, params: dict[str, Any]) -> dict[str, dict[str, Any]]:
        q, err = self._seeded_memory(params)
        self._trace_keys = list(q)
        return ring_memory(q, err, self._lag)

    def use_memory(self, memory: dict[str, Any]) -> None:
        self.err = memory["err"]
        self._ring = TracedRing(self, memory, self._lag, self._trace_keys)

    def delay_flags(self) -> dict[str, Any]:
        """For delay's next traced step: whether its exchanges (``held``: the last step's
        gradient, ``own``: this step's, on a drain) are compressed, and each one's ring slot
        (one-hot)."""
        held = self._finished()
        flags = {}
        for which, j in (("held", held), ("own", held + 1)):
            flags[f"{which}_compressed"] = j > self.config.warmup_steps
            flags[f"{which}_slot"] = [j % self._lag == i for i in range(self._lag)]
        return flags

    def trace_in_delay(self, layers: list[tuple[int, list[int]]], held: Optional[list[list]],
                       own: list[list], reduce: Callable[[int, str, list], list],
                       flags: dict[str, Any]) -> tuple[list[list], list[list]]:
        """Build delay's exchanges of a traced step (:meth:`TracedRing.build`)."""
        return self._ring.build(layers, held, own, reduce, flags)

    def delay_traffic(self, li: int, tensors: list, wire_bytes: Callable[[Any], int],
                      compressed: Any) -> tuple[Any, Any]:
        """Bytes and collectives of one step's exchange of layer ``li`` (counted at its step,
        as the eager step counts them), where the device boolean ``compressed`` says whether
        it is compressed (``wire_bytes``: a tensor's bytes on the wire)."""
        return traffic(self.ops, [self.rank_for(li, i) for i in range(len(tensors))], tensors,
                       wire_bytes, compressed)

    def discard_in_delay(self, held: Optional[dict[str, Any]] = None) -> None:
        """Traced: delay dropped its exchanges in flight (:meth:`TracedRing.discard`)."""
        self._ring.discard(held, self._finished())

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """As every mode's (saved after a flush, so every rank has every Q): the newest Q."""
        for key, versions in self._q_at.items():
            if versions:
                self.q[key] = versions[max(versions)]
        self._q_at.clear()
        if self._ring is not None:  # the newest Q, and every warm start from it
            newest = self._finished()
            self._ring.discard(None, newest)
            self.q.clear()
            if newest > self.config.warmup_steps:
                self.q.update(self._ring.newest_q(newest))
            self._ring.fill(self.q)
        return super().state_dict()

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self._ring is not None:  # the checkpoint's Q is every warm start now
            self._ring.clear(keep=("err",))
            self._ring.fill(self.q)

    def _restart(self) -> None:
        self._no_q.clear()
        self._live.clear()
        self._q_at.clear()

    def forget(self) -> None:
        super().forget()
        if self._ring is not None:
            self._ring.clear()

    def drop_per_rank(self) -> None:
        super().drop_per_rank()
        self._live.clear()
        if self._ring is not None:
            self._ring.clear(keep=self._ring.q_names)

    def _owed(self) -> dict[str, Any]:
        """:attr:`err` and what the exchanges in flight took of it (they give it back if
        dropped)."""
        if self._ring is not None:
            return self._ring.owed()
        owed = dict(self.err)
        for exchange in self._live:
            for key, e in zip(exchange.keys, exchange.taken):
                if e is not None:
                    _add_into(self.ops, owed, key, e)
        return owed


def _add_into(ops: TensorOps, memory: Any, key: str, x: Any) -> None:
    """``memory[key] += x`` (``x`` itself where it holds nothing for ``key``)."""
    memory[key] = ops.add(memory[key], x) if key in memory else x
