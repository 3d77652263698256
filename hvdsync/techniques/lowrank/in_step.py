"""``lowrank=`` in the step pipeline: per bucket of layers, a P round started in backward and
a Q round once P has arrived (eager), or both rounds built into Keras' compiled step (traced).
Both rounds are its codec's (:mod:`hvdsync.techniques.lowrank.codec`); docs/lowrank.md says what a
layer goes through.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Optional

from hvdsync.techniques.lowrank.memory import LowRankBase
from hvdsync.techniques.lowrank.config import LowRankConfig
from hvdsync.techniques.lowrank.codec import FACTORS
from hvdsync.techniques.lowrank.factors import round_label, two_rounds
from hvdsync.techniques.lowrank.in_delay import LowRankInDelay
from hvdsync.core.wire import Pending
from hvdsync.core.ports import Communicator, Gradients, TensorOps
from hvdsync.core.traced import TracedRounds


class _Round:
    """One bucket's compression in flight this step: the P round of its layers that go, then
    (once P has arrived) their Q round."""

    def __init__(self, name: str, layers: list[tuple[int, list[int], list, list[int]]],
                 p: Pending):
        # layers: (li, compressed ks, their matrices, ks that ride plain in the P round)
        self.name, self.layers, self.p = name, layers, p
        self.q: Optional[Pending] = None  # the Q round
        self.result: Optional[Pending] = None  # the Q round, then the gradients delivered


class LowRank(LowRankBase, TracedRounds):
    """Owns the compressible matrices after warm-up; per bucket: P round, then Q round."""

    def __init__(self, config: LowRankConfig, grads: Gradients, ops: TensorOps,
                 comm: Communicator, layer_names: list[str]):
        super().__init__(config, grads, ops, comm, layer_names)
        #: a traced step's memory updates, for trace_commit: (keys, Q, E, whether compressing)
        self._traced: list[tuple[list, list, list, Any]] = []
        self._bucket_of: Optional[dict[int, int]] = None  # see _buckets
        self._members: list[list[int]] = []
        self._restart()

    def in_delay(self, staleness: int, finished_steps: Callable[[], int]) -> LowRankInDelay:
        """This compression run by ``delay=`` (:class:`hvdsync.techniques.delay.carried.Carryable`)."""
        return LowRankInDelay(self.config, self.grads, self.ops, self.comm, self.layer_names,
                              staleness, finished_steps)

    def _restart(self) -> None:
        """A new step: nothing ready, queued or in flight."""
        self._ready: set[int] = set()  # layers ready this step
        #: started in the current ready group, their P not computed yet: (li, compressed ks,
        #: plain ks)
        self._new_layers: list[tuple[int, list[int], list[int]]] = []
        self._filling: dict[int, list] = {}  # bucket -> (li, ks, matrices, P) not sent yet
        self._waiting: list[_Round] = []  # P in flight, Q not started yet (in sending order)
        self._started: list[_Round] = []
        self._deliveries: list = []  # the step's Q rounds' deliveries, for after_wait
        self._new_q: dict[str, Any] = {}
        self._new_err: dict[str, Any] = {}

    def owns(self, li: int, k: int) -> bool:
        """After warm-up: the compressible matrices, and the other dense parameters of their
        layers (biases, small matrices), which ride plain in the P round instead of a
        collective of their own."""
        return (self.step >= self.config.warmup_steps and li in self._buckets()
                and not self.grads.is_row_sparse(li, k))

    def _buckets(self) -> dict[int, int]:
        """Layer -> bucket: layers with a compressible matrix (by shape), in backward (reverse)
        order, cut when their factors reach ``bucket_bytes``. Fixed from shapes alone, so every
        rank has the same buckets (and the same rounds) whatever order its layers get ready
        in."""
        if self._bucket_of is None:
            self._bucket_of, self._members = {}, [[]]
            filled = 0
            for li in reversed(range(len(self.layer_names))):
                factors = 0
                for k in range(self.grads.size(li)):
                    r = self.rank_for(li, k)
                    if r:  # a row-sparse one never goes here: its bucket goes without it
                        n, m = self.ops.matrix_shape(self.grads.value(li, k))
                        factors += r * (n + m) * 4
                if not factors:
                    continue
                if self._members[-1] and filled >= self.config.bucket_bytes:
                    self._members.append([])
                    filled = 0
                self._members[-1].append(li)
                self._bucket_of[li] = len(self._members) - 1
                filled += factors
        return self._bucket_of

    # -- the eager step ---------------------------------------------------------------------
    def layer_ready(self, li: int, ks: list[int]) -> None:
        self._ready.add(li)

    def group_started(self) -> None:
        """The group's layers are started or kept back: their P are computed (at once), a
        bucket whose members are all ready is complete (a member a decider kept back went
        nowhere) and its P round goes; and the Q rounds whose P has arrived."""
        self._compute_p()
        self._send_complete()
        self._advance()

    def _send_complete(self) -> None:
        for b in [b for b in self._filling if all(li in self._ready for li in self._members[b])]:
            self._send(b)

    def _send(self, b: int) -> None:
        entries = self._filling.pop(b)
        names = [self.layer_names[li] for li, *_ in entries]
        label = round_label(names)
        p = self.comm.allreduce(f"hvdsync.lowrank.P.{label}",
                                [t for _, _, _, sent, _ in entries for t in sent])
        self._waiting.append(_Round(label, [(li, ks, ms, plain)
                                            for li, ks, ms, _, plain in entries], p))

    def start(self, li: int, ks: list[int], layer: list) -> Optional[Pending]:
        """Queue the layer: its matrices' P are computed with its ready group's
        (:meth:`group_started`); its bucket's P round starts once every layer of the bucket
        is ready (its Q round once P has arrived)."""
        self._new_layers.append((li, [k for k in ks if self.rank_for(li, k)],
                                 [k for k in ks if not self.rank_for(li, k)]))
        return None

    def _compute_p(self) -> None:
        """``M = grad + E`` and ``P = M Q`` for every matrix the ready group started: a few
        multi-tensor ops for all of them (the same bits as one matrix at a time)."""
        layers, self._new_layers = self._new_layers, []
        if not layers:
            return
        g, ops = self.grads, self.ops
        where = [(li, k, g.key(li, k)) for li, compressed, _ in layers for k in compressed]
        ms = [ops.matrix(g.get(li, k)) for li, k, _ in where]
        owed = [i for i, (_, _, key) in enumerate(where) if key in self.err]
        if owed:
            for i, m in zip(owed, ops.add_all([ms[i] for i in owed],
                                              [self.err[where[i][2]] for i in owed])):
                ms[i] = m
        qs = [self._initial_q(key, li, k, m) for (li, k, key), m in zip(where, ms)]
        matrices, ps = iter(ms), iter(FACTORS.encode(ops, ms, qs)[0])
        for li, compressed, plain in layers:
            layer_ms = [next(matrices) for _ in compressed]
            layer_ps = [next(ps) for _ in compressed]
            self._filling.setdefault(self._buckets()[li], []).append(
                (li, compressed, layer_ms, layer_ps + [g.get(li, k) for k in plain], plain))

    def _advance(self) -> None:
        """Start the Q rounds of the waiting buckets whose P has arrived, in sending order
        (only where collectives pair by name: elsewhere they start in :meth:`send_rest`, in the
        same order on every rank)."""
        arrived = []
        while self.comm.matches_by_name and self._waiting and self._waiting[0].p.ready():
            arrived.append(self._waiting.pop(0))
        if arrived:
            self._start_q(arrived)

    def _start_q(self, rounds: list[_Round]) -> None:
        """The Q rounds of ``rounds`` (their P arrived): the codec's next round for all of
        them at once; each round's Q allreduce; the delivery of all of them once every
        reduction of the step arrived (:meth:`after_wait`: ``P Q^T`` and the residuals, at
        once)."""
        g, ops = self.grads, self.ops
        ms, ps = [], []
        for rnd in rounds:
            arrived = iter(rnd.p.wait())
            for li, _, layer_ms, plain in rnd.layers:
                ps += [next(arrived) for _ in layer_ms]
                ms += layer_ms
                for k in plain:  # averaged already: delivered now
                    g.set(li, k, next(arrived))
        parts, ctx = FACTORS.next_round(ops, ps, ms)
        qs = iter(parts)
        for rnd in rounds:
            mine = [next(qs) for _, _, layer_ms, _ in rnd.layers for _ in layer_ms]
            # (no matrix: its layers' only matrix was row-sparse this step)
            rnd.q = (self.comm.allreduce(f"hvdsync.lowrank.Q.{rnd.name}", mine) if mine
                     else Pending.resolved([]))
        delivered: list[bool] = []

        def deliver() -> None:
            if delivered:
                return
            delivered.append(True)
            q_avg = [q for rnd in rounds for q in rnd.q.wait()]
            approx = FACTORS.average(ops, q_avg, self.comm.size, ctx)
            owed = iter(FACTORS.residual(ops, approx, ctx))  # this rank still owes it
            at = iter(zip(q_avg, approx))
            for rnd in rounds:
                for li, ks, _, _ in rnd.layers:
                    for k in ks:
                        key = g.key(li, k)
                        q, x = next(at)
                        self._new_q[key], self._new_err[key] = q, next(owed)
                        g.set(li, k, ops.from_matrix(x, g.get(li, k)))
        self._deliveries.append(deliver)
        for rnd in rounds:  # (delivered by after_wait: nothing for the pipeline to write)
            rnd.result = Pending(partial(_arrived, rnd), lambda: all(r.q.ready() for r in rounds),
                                 what=f"the low-rank Q round {rnd.name!r}")
        self._started += rounds

    def after_wait(self, layers: list[int]) -> None:
        """Every reduction of the step arrived: ``P Q^T`` and the residuals of every round,
        at once."""
        deliveries, self._deliveries = self._deliveries, []
        for deliver in deliveries:
            deliver()

    def send_rest(self) -> dict[int, Pending]:
        """Every P is computed: send the buckets still filling, then start the Q rounds still
        to start (each waits for its P). A bucket's rounds are counted on its first layer;
        its other layers wait for the same rounds."""
        self._compute_p()  # (every group ended with group_started: nothing left, normally)
        for b in sorted(self._filling):
            self._send(b)
        if self._waiting:
            self.comm.dispatch()  # queued P rounds go now (Keras)
            rounds, self._waiting = self._waiting, []
            self._start_q(rounds)
            self.comm.dispatch()  # and the Q rounds
        out: dict[int, Pending] = {}
        for rnd in self._started:  # both rounds count (Keras knows them after flush)
            rnd.result.nbytes = rnd.p.nbytes + rnd.q.nbytes
            rnd.result.collectives = rnd.p.collectives + rnd.q.collectives
            first, *rest = [li for li, *_ in rnd.layers]
            out[first] = rnd.result
            for li in rest:
                out[li] = same = rnd.result.then(lambda result: result)
                same.nbytes = same.collectives = 0
        return out

    def end_step(self, ok: bool) -> None:
        """Commit the step's Q and residuals when it was finite on every rank."""
        if ok:  # a skipped step does not count (warm-up ends as if it never happened)
            self.q.update(self._new_q)
            self.err.update(self._new_err)
            self.step += 1
        self._restart()

    # -- the traced step (Keras' compiled train function) ------------------------------------
    # The eager step's rounds, built into the step: ``Q`` and ``E`` live in the adapter's
    # device variables, and warm-up is a branch on a flag the host writes (host_flags). The
    # memory's next values are staged and written once, after every exchange (trace_commit):
    # an assignment inside a branch with collectives made the step slower
    # (benchmarks/results/keras_lab_notes.md).
    # Beside a decider each layer's rounds sit in the branch that sends it, so every layer
    # gets its own rounds whatever ``bucket_bytes`` says (a bucket only shares collectives:
    # the numbers are the eager step's); what they staged leaves that branch (staged,
    # restage).
    def host_flags(self) -> dict[str, bool]:
        return {"compressing": self.step >= self.config.warmup_steps}

    def traced_groups(self, one_layer_each: bool = False) -> list[list[int]]:
        self._traced = []  # a new traced step (a trace that failed midway leaves nothing)
        self._buckets()  # (fills _members)
        # a layer whose matrices are all row-sparse this step is not this transport's (the
        # plain exchange, or sparse='s)
        present = {li for li, comp, _ in self._split(
            [(li, list(range(self.grads.size(li)))) for li in range(len(self.layer_names))])
            if comp}
        groups = [group for group in ([li for li in sorted(members) if li in present]
                                      for members in self._members) if group]
        return [[li] for group in groups for li in group] if one_layer_each else groups

    def memory_to_trace(self, params: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """``q`` and ``err`` per compressible matrix."""
        q, err = self._seeded_memory(params)
        return {"q": q, "err": err}

    def use_memory(self, memory: dict[str, Any]) -> None:
        self.q, self.err = memory["q"], memory["err"]

    def trace_exchange(self, layers: list[tuple[int, list[int]]],
                       reduce: Callable[[str, list], list],
                       plain: Callable[[int, list], list], flags: dict[str, Any],
                       count: Optional[Callable[[int, Any, int], None]] = None
                       ) -> dict[int, list]:
        g, ops = self.grads, self.ops
        label = round_label([self.layer_names[li] for li, _ in layers])
        split = self._split(layers)
        keys = [g.key(li, k) for li, comp, _ in split for k in comp]

        def compressed() -> tuple[list, list, list]:
            # the eager step's rounds (start, flush), in its order
            rounds = [([g.get(li, k) for k in comp],
                       [ops.add(ops.matrix(g.get(li, k)), self.err.read(g.key(li, k)))
                        for k in comp], [self.q.read(g.key(li, k)) for k in comp],
                       [g.get(li, k) for k in dense]) for li, comp, dense in split]
            delivered, qs, residuals = two_rounds(ops, rounds, reduce, label)
            return [x for layer in delivered for x in layer], qs, residuals

        def warming_up() -> tuple[list, list, list]:  # every layer plain, memory as it is
            return ([x for li, comp, dense in split
                     for x in plain(li, [g.get(li, k) for k in comp + dense])],
                    [self.q.read(k) for k in keys], [self.err.read(k) for k in keys])
        active = flags["compressing"]
        delivered, new_q, new_err = ops.cond(active, compressed, warming_up)
        self._traced.append((keys, new_q, new_err, active))
        result: dict[int, list] = {}
        at = iter(delivered)
        for (li, ks), (_, comp, dense) in zip(layers, split):
            by_k = {k: next(at) for k in comp + dense}
            sparse = [k for k in ks if k not in by_k]
            if sparse:
                by_k.update(zip(sparse, plain(li, [g.get(li, k) for k in sparse])))
            result[li] = [by_k[k] for k in ks]
        return result

    def _split(self, layers: list[tuple[int, list[int]]]
               ) -> list[tuple[int, list[int], list[int]]]:
        """Per layer: its compressible positions and the rest of its dense ones; row-sparse
        ones are not this transport's (the plain exchange, in either branch)."""
        g = self.grads
        return [(li, [k for k in ks if self.rank_for(li, k) and not g.is_row_sparse(li, k)],
                 [k for k in ks if not self.rank_for(li, k) and not g.is_row_sparse(li, k)])
                for li, ks in layers]

    def _compressed_keys(self, layers: list[tuple[int, list[int]]]) -> list[str]:
        return [self.grads.key(li, k) for li, comp, _ in self._split(layers) for k in comp]

    def staged(self, layers: list[tuple[int, list[int]]], built: bool) -> list:
        """What the memory should become after :meth:`trace_exchange` of ``layers``, as a
        flat list of tensors, so that it can leave a decider's branch (which sends the layers
        only where the plan says). ``built``: inside the branch that just built the exchange
        (what it staged, taken back from :meth:`trace_commit`'s list); else, in the other
        branch, the memory as it stands. :meth:`restage` gives it back after the branch."""
        if built:  # the last trace_exchange's (these layers'): new Qs, then residuals
            _, new_q, new_err, _ = self._traced.pop()
            return [*new_q, *new_err]
        keys = self._compressed_keys(layers)
        return [*(self.q.read(k) for k in keys), *(self.err.read(k) for k in keys)]

    def restage(self, layers: list[tuple[int, list[int]]], values: list, taken: Any) -> None:
        """Stage ``values`` (:meth:`staged`, as they left the branch) for
        :meth:`trace_commit`, written only where the device boolean ``taken`` holds (the
        branch that built the exchange ran)."""
        keys = self._compressed_keys(layers)
        n = len(keys)
        # (warm-up writes back the memory as it was: a no-op, and no flag to read here)
        self._traced.append((keys, values[:n], values[n:], taken))

    def trace_commit(self, ok: Any) -> None:
        traced, self._traced = self._traced, []
        for keys, new_q, new_err, active in traced:  # as end_step: only a step that counts
            def write(keys=keys, new_q=new_q, new_err=new_err) -> None:
                for key, q, e in zip(keys, new_q, new_err):
                    self.q.write(key, q, ok)
                    self.err.write(key, e, ok)
            self.ops.cond(active, write, lambda: None)

    def end_traced_step(self, ok: bool) -> None:
        if ok:  # as end_step: a skipped step does not count
            self.step += 1
        self._restart()


def _arrived(rnd: _Round) -> None:
    """Wait for a round's Q (its delivery is :meth:`LowRank.after_wait`'s)."""
    rnd.q.wait()
