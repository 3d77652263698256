"""``lowrank=``: low-rank gradient compression (PowerSGD-style) inside the layer pipeline (a
transport).

A layer's weight matrix ``M`` (``n x m``; conv kernels are viewed as matrices, the adapter
says how) is sent as two thin factors instead of ``n * m`` numbers. Per step and parameter,
with ``Q`` (``m x r``) kept from the last step (warm start) and ``E`` this rank's error
feedback (what earlier steps' compression left out)::

    M = grad + E                      this rank's gradient plus what it still owes
    P = allreduce(M Q)                started in backward, the moment the layer is ready
    P = orthonormal(P)                the same on every rank (same input)
    Q = allreduce(M^T P)              started as soon as P has arrived
    grad <- P Q^T                     identical on every rank: the replicas stay identical
    E <- M - P Q^T                    nothing is lost: it goes in a later step

so a layer costs ``r (n + m)`` numbers in two rounds instead of ``n m`` in one. ``P Q^T`` is
the projection of the rank-averaged ``M`` on the span of ``P``: with ``r >= min(n, m)`` it is
the plain average (up to rounding), and error feedback makes the sum of what is delivered
plus the ranks' averaged residual equal the sum of the averaged gradients, step after step.

What is not compressed: vectors (biases, norms), row-sparse gradients, matrices the factors
would not shrink by ``min_compression`` (``r (n + m) * min_compression > n m``), and every
layer during the first ``warmup_steps`` steps (the first steps move the model most;
PowerSGD's ``start_powerSGD_iter``). Those of a layer with a compressed matrix ride plain in
its P round (one collective fewer per layer); the rest take the next transport.
``bucket_bytes`` lets consecutive layers share their rounds. How it differs from DDP's
PowerSGD hook, and why: docs/lowrank.md.

Composition: ``clip=`` clips before (a transform); ``threshold=``/``select=`` decide which
layers go, and a layer that goes is compressed (what it kept back joins its gradient first);
``fp16`` (``compression=``) carries the factors in half precision. A step that is non-finite
on any rank commits neither ``E`` nor ``Q`` (the step is skipped everywhere).

With ``delay=`` the compressed exchange runs in delay's background instead
(:meth:`LowRankCompression.exchange`): step ``t`` starts its P rounds in backward, each Q round
starts once its P has arrived (whenever this rank next looks, at the latest when the step's
global gradient is due), and the global gradient ``P Q^T`` is folded in later like any delayed
one. Two things change because rounds now overlap later steps: step ``t``'s ``Q`` warm start
is the one produced by step ``t - 1 - staleness`` (the newest every rank is sure to have: delay
has waited for it), and ``E`` collects each exchange's residual when that exchange completes
on this rank and is added to the next exchange started after that (per rank, like ``E``
itself). Every residual is still added exactly once; an exchange that is discarded (a flush
before its global gradient was used) gives back the ``E`` it had taken.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from hvdsync.config import coerce_config
from hvdsync.technique import (Communicator, Gradients, Pending, TensorOps, Transport,
                               refill)


@dataclass(frozen=True)
class LowRankConfig:
    """Low-rank compression of weight matrices; see the module docstring.

    ``rank``: columns of the factors (higher: closer to the plain average, more bytes).
    ``warmup_steps``: steps sent plain before compression starts. ``min_compression``: a
    matrix is compressed only when its factors are at least this many times smaller than it
    (``0``: every matrix, whatever the rank). ``seed``: of the first ``Q`` (the same on every
    rank). ``bucket_bytes``: consecutive layers (in backward order) share their P and Q
    rounds until their factors reach this many bytes -- fewer collectives, each a little
    later; ``0``: every layer has its own rounds (as in Keras' compiled step beside a
    decider, whose branches send one layer each).
    """

    rank: int = 4
    warmup_steps: int = 10
    min_compression: float = 2.0
    seed: int = 0
    bucket_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "warmup_steps", "seed", "bucket_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"lowrank {name} must be an int, got {type(v).__name__} {v!r}")
        if self.rank < 1:
            raise ValueError(f"lowrank rank must be >= 1, got {self.rank}")
        if self.warmup_steps < 0:
            raise ValueError(f"lowrank warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.bucket_bytes < 0:
            raise ValueError(f"lowrank bucket_bytes must be >= 0, got {self.bucket_bytes}")
        c = self.min_compression
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) \
                or c < 0:
            raise ValueError(f"lowrank min_compression must be a finite number >= 0, got {c!r}")

    @classmethod
    def coerce(cls, value: Any) -> Optional["LowRankConfig"]:
        """``None``, a :class:`LowRankConfig`, a dict of its fields, or an int (the rank)."""
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return coerce_config(cls, value, "lowrank", "rank")


def _project(ops: TensorOps, m: Any, p: Any, q: Any) -> tuple[Any, Any]:
    """From a matrix ``M`` (this rank's, error feedback included), its orthonormal ``P`` and
    the rank-averaged ``Q``: what is delivered, ``P Q^T``, and what this rank still owes,
    ``M - P Q^T`` -- the same arithmetic in every path (eager, inside ``delay=``, traced)."""
    approx = ops.matmul(p, q, transpose_b=True)
    return approx, ops.accumulate(ops.clone(m), approx, sign=-1)


class _Round:
    """One bucket's compression in flight this step: the P round of its layers that go, then
    (once P has arrived) their Q round."""

    def __init__(self, name: str, layers: list[tuple[int, list[int], list, list[int]]],
                 p: Pending):
        # layers: (li, compressed ks, their matrices, ks that ride plain in the P round)
        self.name, self.layers, self.p = name, layers, p
        self.q: Optional[Pending] = None  # the Q round
        self.result: Optional[Pending] = None  # the Q round, then the gradients delivered


class _DelayedLowRank(Pending):
    """One layer's exchange of one step inside ``delay=`` (see
    :meth:`LowRankCompression.exchange`)."""

    def __init__(self, owner: "LowRankCompression", step: int, ks: list[int], grads: list,
                 plain: list[int], plain_p: Pending, compressed: list[int], keys: list[str],
                 ms: list, taken: list, p_round: Pending, name: str, q_bytes: int):
        super().__init__(self._finish, self._poll, plain_p.nbytes + p_round.nbytes + q_bytes,
                         plain_p.collectives + p_round.collectives + 1,
                         what=f"the low-rank exchange {name!r}")
        self.owner, self.step, self.ks, self.grads = owner, step, ks, grads
        self.plain, self.plain_p, self.compressed = plain, plain_p, compressed
        self.keys, self.ms, self.taken, self.p_round, self.name = keys, ms, taken, p_round, name
        self._q: Optional[Pending] = None
        self._p: list = []
        self._residuals: list = []
        # Keras: eager Horovod ops block its background thread, so the Q round runs there
        # right behind the step's flush (the same order on every rank); torch starts it when
        # this rank first sees P arrived (Horovod matches async collectives by name)
        self._chained = owner.comm.after_flush(self._q_round_blocking)

    def _q_round_blocking(self, reduce) -> None:
        ops = self.owner.ops
        self._p = [ops.orthonormal(p) for p in self.p_round.wait()]
        qs = [ops.matmul(m, p, transpose_a=True) for m, p in zip(self.ms, self._p)]
        self._q = Pending.resolved(reduce(f"{self.name}.Q", qs))

    def _start_q(self) -> None:
        if self._chained is not None:
            self._chained.result()
        elif self._q is None:
            ops, comm = self.owner.ops, self.owner.comm
            self._p = [ops.orthonormal(p) for p in self.p_round.wait()]
            self._q = comm.allreduce(f"{self.name}.Q", [ops.matmul(m, p, transpose_a=True)
                                                         for m, p in zip(self.ms, self._p)])

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
        for i, key, m, p, q in zip(self.compressed, self.keys, self.ms, self._p, q_avg):
            approx, residual = _project(ops, m, p, q)
            # Q is shared: recorded whenever it arrives (the warm start reads only the ones
            # every rank has); the residual is this rank's, committed when used
            self.owner._q_at.setdefault(key, {})[self.step] = q
            self._residuals.append(residual)
            full[i] = ops.from_matrix(approx, self.grads[i])
        return full

    def used(self) -> None:
        """Folded in: each matrix's residual joins ``E``."""
        self.wait()
        self.owner.settled(self)
        err, ops = self.owner.err, self.owner.ops
        for key, r in zip(self.keys, self._residuals):
            err[key] = ops.add(err[key], r) if key in err else r

    def discard(self) -> None:
        """Dropped before use (a flush averages the replicas instead): the ``E`` it took
        comes back."""
        self.wait()
        self.owner.settled(self)
        err, ops = self.owner.err, self.owner.ops
        for key, e in zip(self.keys, self.taken):
            if e is not None:
                err[key] = ops.add(err[key], e) if key in err else e


class LowRankCompression(Transport):
    """Owns the compressible matrices after warm-up; per layer: P round, then Q round.

    ``q[key]`` is the last ``Q`` of a parameter (shared: every rank has the same), ``err[key]``
    this rank's error feedback (both as the adapter's matrices). Keys are
    :meth:`Gradients.key`.
    """

    name = "lowrank"
    per_rank = ("err",)

    def __init__(self, config: LowRankConfig, grads: Gradients, ops: TensorOps,
                 comm: Communicator, layer_names: list[str]):
        self.config = config
        self.grads = grads
        self.ops = ops
        self.comm = comm
        self.layer_names = layer_names
        self.step = 0  # finished steps
        self.q: dict[str, Any] = {}
        self.err: dict[str, Any] = {}
        self._rank: dict[tuple[int, int], int] = {}  # (li, k) -> rank used, 0: goes plain
        #: inside ``delay=``: delay runs the exchange (:meth:`exchange`) and this owns nothing;
        #: Q per matrix by the step that produced it
        self.delayed = False
        self._q_at: dict[str, dict[int, Any]] = {}
        #: traced inside ``delay=``: its memories (:meth:`memory_to_trace`) and their keys
        self._in_trace: Optional[dict[str, Any]] = None
        self._trace_keys: list[str] = []
        self._no_q: list[_DelayedLowRank] = []  # torch: exchanges whose Q round waits for P
        self._live: list[_DelayedLowRank] = []  # started, not yet used or discarded
        #: a traced step's memory updates, for trace_commit: (keys, Q, E, whether compressing)
        self._traced: list[tuple[list, list, list, Any]] = []
        self._bucket_of: Optional[dict[int, int]] = None  # see _buckets
        self._members: list[list[int]] = []
        self._new_step()

    def _new_step(self) -> None:
        self._ready: set[int] = set()  # layers ready this step
        #: started in the current ready group, their P not computed yet: (li, compressed ks,
        #: plain ks)
        self._new_layers: list[tuple[int, list[int], list[int]]] = []
        self._filling: dict[int, list] = {}  # bucket -> (li, ks, matrices, P) not sent yet
        self._waiting: list[_Round] = []  # P in flight, Q not started yet (in sending order)
        self._started: list[_Round] = []
        self._new_q: dict[str, Any] = {}
        self._new_err: dict[str, Any] = {}

    # -- which parameters -------------------------------------------------------------------
    def rank_for(self, li: int, k: int) -> int:
        """The rank parameter ``k`` of layer ``li`` is compressed to (0: it goes plain)."""
        r = self._rank.get((li, k))
        if r is None:
            r = self._rank[(li, k)] = self._rank_of(self.grads.value(li, k))
        return r

    def _rank_of(self, t: Any) -> int:
        """The rank a parameter shaped like ``t`` is compressed to (0: it goes plain)."""
        shape = self.ops.matrix_shape(t)
        if shape is None:
            return 0
        n, m = shape
        r = min(self.config.rank, n, m)
        return 0 if r * (n + m) * self.config.min_compression > n * m else r

    def owns(self, li: int, k: int) -> bool:
        """After warm-up: the compressible matrices, and the other dense parameters of their
        layers (biases, small matrices), which ride plain in the P round instead of a
        collective of their own."""
        return (not self.delayed and self.step >= self.config.warmup_steps
                and li in self._buckets() and not self.grads.is_row_sparse(li, k))

    # -- buckets ----------------------------------------------------------------------------
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
        label = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        p = self.comm.allreduce(f"hvdsync.lowrank.P.{label}",
                                [t for _, _, _, sent, _ in entries for t in sent])
        self._waiting.append(_Round(label, [(li, ks, ms, plain)
                                            for li, ks, ms, _, plain in entries], p))

    # -- the step ---------------------------------------------------------------------------
    def start(self, li: int, ks: list[int]) -> Optional[Pending]:
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
        matrices, ps = iter(ms), iter(ops.matmul_all(ms, qs) if ms else [])
        for li, compressed, plain in layers:
            layer_ms = [next(matrices) for _ in compressed]
            layer_ps = [next(ps) for _ in compressed]
            self._filling.setdefault(self._buckets()[li], []).append(
                (li, compressed, layer_ms, layer_ps + [g.get(li, k) for k in plain], plain))

    def _advance(self) -> None:
        """Start the Q rounds of the waiting buckets whose P has arrived, in sending order
        (only where collectives pair by name: elsewhere they start in :meth:`flush`, in the
        same order on every rank)."""
        arrived = []
        while self.comm.matches_by_name and self._waiting and self._waiting[0].p.ready():
            arrived.append(self._waiting.pop(0))
        if arrived:
            self._start_q(arrived)

    def _start_q(self, rounds: list[_Round]) -> None:
        """The Q rounds of ``rounds`` (their P arrived): every P orthonormalized and every
        ``M^T P`` computed at once; each round's Q allreduce; the delivery of all of them at
        the first wait (``P Q^T`` and the residuals, at once)."""
        g, ops = self.grads, self.ops
        ms, ps = [], []
        for rnd in rounds:
            arrived = iter(rnd.p.wait())
            for li, _, layer_ms, plain in rnd.layers:
                ps += [next(arrived) for _ in layer_ms]
                ms += layer_ms
                for k in plain:  # averaged already: delivered now
                    g.set(li, k, next(arrived))
        ps = ops.orthonormal_all(ps) if ps else []
        qs = iter(ops.matmul_all(ms, ps, transpose_a=True) if ms else [])
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
            approx = ops.matmul_all(ps, q_avg, transpose_b=True) if ps else []
            owed = iter(ops.sub_all(ms, approx))  # M - P Q^T: this rank still owes it
            at = iter(zip(q_avg, approx))
            for rnd in rounds:
                for li, ks, _, _ in rnd.layers:
                    for k in ks:
                        key = g.key(li, k)
                        q, x = next(at)
                        self._new_q[key], self._new_err[key] = q, next(owed)
                        g.set(li, k, ops.from_matrix(x, g.get(li, k)))
        for rnd in rounds:
            rnd.result = Pending(deliver, lambda: all(r.q.ready() for r in rounds),
                                 what=f"the low-rank Q round {rnd.name!r}")
        self._started += rounds

    def flush(self) -> dict[int, Pending]:
        """Every P is computed: send the buckets still filling, then start the Q rounds still
        to start (each waits for its P). A bucket's rounds are counted on its first layer;
        its other layers wait for the same rounds."""
        self._compute_p()  # (every group ended with group_started: nothing left, normally)
        for b in sorted(self._filling):
            self._send(b)
        if self._waiting:
            self.comm.flush()  # queued P rounds go now (Keras)
            rounds, self._waiting = self._waiting, []
            self._start_q(rounds)
            self.comm.flush()  # and the Q rounds
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
        self._new_step()

    # -- the traced step (Keras' compiled train function) ------------------------------------
    # The same rounds as :meth:`start` / :meth:`flush` / :meth:`end_step`, built into the step:
    # ``Q`` and ``E`` live in the adapter's device variables (every matrix holds its seeded
    # ``Q`` and a zero ``E`` while it holds nothing: adding a zero ``E`` changes no bit), and
    # warm-up is a branch on a flag the host writes (:meth:`host_flags`). The memory's next
    # values are staged and written once, after every exchange (:meth:`trace_commit`): an
    # assignment inside a branch with collectives made the step slower than the eager
    # pipeline (21.5 vs 17.1 ms, docs/keras.md). Beside a decider each layer's rounds sit in
    # the branch that sends it, so the traced step gives every layer its own rounds whatever
    # ``bucket_bytes`` says (a bucket of layers the plan splits would need rounds whose
    # members are known at run time only; a bucket only shares collectives, so the numbers
    # are the eager step's); what the rounds staged leaves that branch (:meth:`staged`,
    # :meth:`restage`). ``delay=`` carries the exchange across steps.
    traceable = True
    traced_with = ("clip", "plain", "delay", "sparse", "threshold", "select")

    def host_flags(self) -> dict[str, bool]:
        if self.delayed:  # delay's traced step asks (delay_flags)
            return {}
        return {"compressing": self.step >= self.config.warmup_steps}

    def traced_groups(self, one_layer_each: bool = False) -> list[list[int]]:
        if self.delayed:  # delay builds the exchange (trace_in_delay)
            return []
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
        """``q`` and ``err`` per compressible matrix; inside ``delay=`` (:meth:`trace_in_delay`)
        a ring of ``staleness + 1`` Qs, ``err``, ``late`` and, per exchange in flight,
        ``res{i}`` and ``taken{i}``."""
        q, err = {}, {}
        for key, p in params.items():
            r = self._rank_of(p)
            if r:
                n, m = self.ops.matrix_shape(p)
                q[key] = self._seeded_q(key, m, r)
                err[key] = np.zeros((n, m))
        if not self.delayed:
            return {"q": q, "err": err}
        self._trace_keys = list(q)
        in_flight = {f"{kind}{i}": err for kind in ("res", "taken")
                     for i in range(1, self._lag - 1)}
        return {**{f"q{i}": q for i in range(self._lag)}, "err": err, "late": err, **in_flight}

    def use_memory(self, memory: dict[str, Any]) -> None:
        if self.delayed:
            self.err, self._in_trace = memory["err"], memory
            return
        self.q, self.err = memory["q"], memory["err"]

    def trace_exchange(self, layers: list[tuple[int, list[int]]],
                       reduce: Callable[[str, list], list],
                       plain: Callable[[int, list], list], flags: dict[str, Any],
                       count: Optional[Callable[[int, Any, int], None]] = None
                       ) -> dict[int, list]:
        g, ops = self.grads, self.ops
        names = [self.layer_names[li] for li, _ in layers]
        label = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        split = self._split(layers)
        keys = [g.key(li, k) for li, comp, _ in split for k in comp]

        def compressed() -> tuple[list, list, list]:
            # the eager step's rounds (start, flush), in its order
            rounds = [([g.get(li, k) for k in comp],
                       [ops.add(ops.matrix(g.get(li, k)), self.err.read(g.key(li, k)))
                        for k in comp], [self.q.read(g.key(li, k)) for k in comp],
                       [g.get(li, k) for k in dense]) for li, comp, dense in split]
            delivered, qs, residuals = self._rounds(rounds, reduce, label)
            return [x for layer in delivered for x in layer], qs, residuals

        def warming_up() -> tuple[list, list, list]:  # every layer plain, memory as it is
            return ([x for li, comp, dense in split
                     for x in plain(li, [g.get(li, k) for k in comp + dense])],
                    [self.q.read(k) for k in keys], [self.err.read(k) for k in keys])
        active = flags["compressing"]
        # the memory's next values come out of the branch, written by trace_commit (an
        # assignment inside a branch with collectives made the step 2.4x slower, measured)
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
        if built:  # the last trace_exchange's (these layers'): new Qs, then residuals
            _, new_q, new_err, _ = self._traced.pop()
            return [*new_q, *new_err]
        keys = self._compressed_keys(layers)
        return [*(self.q.read(k) for k in keys), *(self.err.read(k) for k in keys)]

    def restage(self, layers: list[tuple[int, list[int]]], values: list, taken: Any) -> None:
        keys = self._compressed_keys(layers)
        n = len(keys)
        # (warm-up writes back the memory as it was: a no-op, and no flag to read here)
        self._traced.append((keys, values[:n], values[n:], taken))

    def _rounds(self, layers: list[tuple[list, list, list, list]],
                reduce: Callable[[str, list], list], label: str
                ) -> tuple[list[list], list, list]:
        """One P and one Q round over ``layers``, built into a trace (the eager step's
        arithmetic): per layer ``(gradients, matrices, warm Qs, other dense gradients)`` --
        its compressed parameters' gradients, their matrices (error feedback included) and
        the Q each starts from, then the parameters that ride plain in the P round. Returns
        per layer what is delivered (its compressed parameters, then the rest), the new Qs
        and the residuals (``M - P Q^T``), both in the matrices' order."""
        ops = self.ops
        sent = []
        for _, ms, qs, dense in layers:
            sent += [ops.matmul(m, q) for m, q in zip(ms, qs)] + list(dense)
        arrived = iter(reduce(f"hvdsync.lowrank.P.{label}", sent))
        orth, rest = [], []
        for _, ms, _, dense in layers:
            orth += [ops.orthonormal(next(arrived)) for _ in ms]
            rest.append([next(arrived) for _ in dense])
        ms = [m for _, layer_ms, _, _ in layers for m in layer_ms]
        new_q = list(reduce(f"hvdsync.lowrank.Q.{label}",
                            [ops.matmul(m, p, transpose_a=True) for m, p in zip(ms, orth)]))
        projected = iter([_project(ops, m, p, q) for m, p, q in zip(ms, orth, new_q)])
        residuals, delivered = [], []
        for (xs, _, _, _), dense in zip(layers, rest):
            approx = [next(projected) for _ in xs]
            residuals += [r for _, r in approx]
            delivered.append([ops.from_matrix(a, x) for (a, _), x in zip(approx, xs)] + dense)
        return delivered, new_q, residuals

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
        self._new_step()

    # -- inside delay=, traced (Keras' compiled train function; delay's fold="due") -----------
    # delay's traced step exchanges the last step's gradient (id t-1) beside this step's
    # backward and, on a drain, this step's own (id t) after it; each is folded in exactly
    # ``staleness`` (s) steps after its own step. The eager step's rules (module docstring)
    # in that order: the exchange of id j starts from the Q of the newest compressed exchange
    # of an id <= j - s - 1 (a ring of s + 1 Qs, slot j mod (s + 1), written by every
    # exchange); it takes ``E`` as it was when step j began -- a residual folded in at step j
    # joins ``E`` only after the exchange of id j took it (``late``: one step later); until
    # it is folded in, an exchange keeps its residual and what it took (``res{i}``,
    # ``taken{i}``: due in i steps), so a flush can give back what it took.
    def in_delay(self, staleness: int, finished_steps: Callable[[], int]) -> None:
        """``delay=`` runs this technique's exchange (:meth:`exchange`; traced:
        :meth:`trace_in_delay`), each global gradient folded in at most ``staleness``
        steps after its step; ``finished_steps()``: delay's step count (ids are 1, 2, ...)."""
        self.delayed = True
        self._lag = staleness + 1
        self._finished = finished_steps

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
        """Build delay's exchanges of a traced step: of ``held`` (per layer, the last step's
        gradients; ``None`` when synchronous) where ``flags["exchange_held"]``, and of
        ``own`` (this step's) where ``flags["drain"]`` (always when synchronous); ``layers``:
        ``(li, ks)``; ``reduce(li, name, tensors)`` averages over ranks. Returns each one's
        rank average per layer -- the held one less the held gradients (delay's correction
        ``G - g``) -- or zeros where it did not run, and writes the memory: ``E``,
        ``late``, the residuals and takes in flight, the Q ring."""
        g, ops, mem = self.grads, self.ops, self._in_trace
        comp = [[i for i, k in enumerate(ks) if self.rank_for(li, k)] for li, ks in layers]
        keys = [g.key(li, ks[i]) for (li, ks), c in zip(layers, comp) for i in c]
        lag, drain = self._lag, (True if held is None else flags["drain"])
        read = {name: {k: m.read(k) for k in keys} for name, m in mem.items()}
        late = read["late"]

        def warm(slot: Any) -> dict:  # the Q in the ring slot the one-hot ``slot`` names
            out = {}
            for k in keys:
                q = read[f"q{lag - 1}"][k]
                for i in range(lag - 1):
                    q = ops.where(slot[i], read[f"q{i}"][k], q)
                out[k] = q
            return out

        def exchange(which: str, tensors: list[list], run: Any, e: dict) -> tuple:
            """``(delivered per layer, new Qs, residuals, E taken, E left)`` by key."""
            q0 = warm(flags[f"{which}_slot"])
            zeros = {k: ops.zeros_like(e[k]) for k in keys}
            at_keys = iter(keys)
            mine = [[next(at_keys) for _ in c] for c in comp]

            def compressed() -> tuple:
                delivered, new_q, residuals = [], {}, {}  # (delivered: averages, below)
                for (li, ks), c, ks_of, xs in zip(layers, comp, mine, tensors):
                    name = f"{self.layer_names[li]}.delay.{which}"
                    if not c:
                        delivered.append(reduce(li, f"hvdsync.{name}", xs))
                        continue
                    rest = [x for i, x in enumerate(xs) if i not in c]
                    out, qs, rs = self._rounds(
                        [([xs[i] for i in c], [ops.add(ops.matrix(xs[i]), e[k])
                                               for i, k in zip(c, ks_of)],
                          [q0[k] for k in ks_of], rest)],
                        lambda n, ts, li=li: reduce(li, n, ts), name)
                    got = iter(out[0])
                    by_i = {i: next(got) for i in c}
                    by_i.update((i, next(got)) for i in range(len(xs)) if i not in c)
                    delivered.append([by_i[i] for i in range(len(xs))])
                    new_q.update(zip(ks_of, qs))
                    residuals.update(zip(ks_of, rs))
                return corrections(delivered), new_q, residuals, dict(e), zeros

            def plain() -> tuple:  # warm-up: every layer plain, nothing taken
                return (corrections([reduce(li, f"hvdsync.{self.layer_names[li]}.delay.{which}",
                                            xs) for (li, _), xs in zip(layers, tensors)]),
                        q0, zeros, zeros, dict(e))

            def corrections(averages: list[list]) -> list[list]:
                if which == "own":
                    return averages
                return [[ops.accumulate(a, x, sign=-1) for a, x in zip(avg, xs)]
                        for avg, xs in zip(averages, tensors)]

            def idle() -> tuple:
                return ([[ops.zeros_like(x) for x in xs] for xs in tensors], q0, zeros, zeros,
                        dict(e))
            runs = lambda: ops.cond(flags[f"{which}_compressed"], compressed, plain)
            return runs() if run is True else ops.cond(run, runs, idle)
        if held is None:  # synchronous: the last step's residual joins before this exchange
            err = {k: ops.add(read["err"][k], late[k]) for k in keys}
            held_out = None
        else:
            held_out = exchange("held", held, flags["exchange_held"], read["err"])
            err = {k: ops.add(held_out[4][k], late[k]) for k in keys}
        own_out = exchange("own", own, drain, err)
        for k in keys:
            mem["err"].write(k, own_out[4][k], True)
            for i in range(lag):
                if held_out is not None:
                    mem[f"q{i}"].write(k, held_out[1][k], flags["held_slot"][i])
                mem[f"q{i}"].write(k, own_out[1][k], flags["own_slot"][i])
            if held_out is None:
                mem["late"].write(k, own_out[2][k], True)
                continue
            # residuals in flight, due in 1 .. s-1 steps; the held exchange's is due in s
            res = [read[f"res{i}"][k] for i in range(1, lag - 1)] + [held_out[2][k]]
            taken = [read[f"taken{i}"][k] for i in range(1, lag - 1)] + [held_out[3][k]]
            drained = own_out[2][k]
            for r in res:
                drained = ops.add(drained, r)
            mem["late"].write(k, ops.where(drain, drained, res[0]), True)
            for i in range(1, lag - 1):  # a drain folds every one in: nothing left in flight
                for kind, xs in (("res", res), ("taken", taken)):
                    mem[f"{kind}{i}"].write(k, ops.where(drain, ops.zeros_like(xs[i]), xs[i]),
                                            True)
        return (held_out[0] if held_out is not None else []), own_out[0]

    def delay_traffic(self, li: int, tensors: list, wire_bytes: Callable[[Any], int],
                      compressed: Any) -> tuple[Any, Any]:
        """Bytes and collectives of one step's exchange of layer ``li`` inside ``delay=``
        (counted at its step, as the eager step counts them), where the device boolean
        ``compressed`` says whether it is compressed (``wire_bytes``: a tensor's bytes on the
        wire): the eager exchange's figures."""
        ops = self.ops
        plain = sum(wire_bytes(x) for x in tensors)
        comp = [i for i, x in enumerate(tensors) if self.rank_for(li, i)]
        if not comp:
            return plain, 1
        shapes = [(ops.matrix_shape(tensors[i]), self.rank_for(li, i)) for i in comp]
        p_bytes = sum(wire_bytes(tensors[i]) * r // m for i, ((_, m), r) in zip(comp, shapes))
        rows = sum(n * r for (n, _), r in shapes)
        cols = sum(m * r for (_, m), r in shapes)
        rest = plain - sum(wire_bytes(tensors[i]) for i in comp)
        compressed_bytes = rest + p_bytes + p_bytes * cols // max(rows, 1)
        return (ops.where(compressed, compressed_bytes, plain),
                ops.where(compressed, 2 + (len(comp) < len(tensors)), 1))

    def discard_in_delay(self, held: Optional[dict[str, Any]] = None) -> None:
        """Traced: delay dropped its exchanges in flight (a flush): what they took goes back
        to ``E``, with the residual folded in last (``late``). ``held``: by key, the newest
        step's gradients where the traced step left their exchange to the next step -- it
        runs now, as the eager step ran it in that step: its Q is a warm start of later
        exchanges (and what a checkpoint keeps)."""
        mem, ops, comm = self._in_trace, self.ops, self.comm
        lag = self._lag
        newest = self._finished()
        if held and newest > self.config.warmup_steps:
            slot = mem[f"q{newest % lag}"]
            ms = {key: ops.add(ops.matrix(held[key]), mem["err"].read(key))
                  for key in self._trace_keys}
            ps = {key: comm.allreduce(f"hvdsync.lowrank.flush.P.{key}",
                                      [ops.matmul(m, slot.read(key))]) for key, m in ms.items()}
            comm.flush()
            qs = {key: comm.allreduce(f"hvdsync.lowrank.flush.Q.{key}", [ops.matmul(
                m, ops.orthonormal(ps[key].wait()[0]), transpose_a=True)])
                  for key, m in ms.items()}
            comm.flush()
            for key, q in qs.items():
                slot[key] = q.wait()[0]
        for key, total in self._owed().items():
            mem["err"][key] = total
        for name in ["late"] + [f"{kind}{i}" for kind in ("res", "taken")
                                for i in range(1, lag - 1)]:
            mem[name].clear()

    # -- inside delay= ----------------------------------------------------------------------
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
        ms, ps, taken, keys = [], [], [], []
        for i in compressed:
            key = g.key(li, ks[i])
            m = ops.matrix(grads[i])
            e = self.err.pop(key, None)  # every residual joins exactly one later exchange
            taken.append(e)
            ms.append(m if e is None else ops.add(m, e))
            keys.append(key)
            ps.append(ops.matmul(ms[-1], self._warm_q(key, li, ks[i], m, step - lag)))
        p_round = self.comm.allreduce(f"{name}.P", ps)
        rows = sum(ops.matrix_shape(p)[0] * ops.matrix_shape(p)[1] for p in ps)
        cols = sum(ops.matrix_shape(m)[1] * ops.matrix_shape(p)[1] for m, p in zip(ms, ps))
        exchange = _DelayedLowRank(self, step, ks, grads, plain, plain_p, compressed, keys, ms,
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

    def _initial_q(self, key: str, li: int, k: int, m: Any) -> Any:
        """The matrix's last Q, or the seeded first one (the same on every rank)."""
        q = self.q.get(key)
        if q is None:
            q = self.q[key] = self.ops.from_host(
                self._seeded_q(key, self.ops.matrix_shape(m)[1], self.rank_for(li, k)), m)
        return q

    def _seeded_q(self, key: str, cols: int, rank: int) -> np.ndarray:
        """A matrix's first Q, drawn on the host: the same numbers in every adapter, on every
        rank."""
        seed = (self.config.seed * 1_000_003 + zlib.crc32(key.encode())) % 2**31
        return np.random.default_rng(seed).standard_normal((cols, rank))

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Shared: the step count and each matrix's Q. Per rank: the residuals (``err``).
        Inside ``delay=`` (saved after a flush, so every rank has every Q): the newest Q."""
        g = self.grads
        for key, versions in self._q_at.items():
            if versions:
                self.q[key] = versions[max(versions)]
        self._q_at.clear()
        if self._in_trace is not None:  # traced: the newest Q, and every warm start from it
            self.discard_in_delay()
            newest = self._finished()
            self.q.clear()
            if newest > self.config.warmup_steps:
                self.q.update((key, self._in_trace[f"q{newest % self._lag}"].read(key))
                              for key in self._trace_keys)
            self._fill_ring()
        return {"step": self.step, "q": {k: g.to_saved(k, v) for k, v in self.q.items()},
                "err": {k: g.to_saved(k, v) for k, v in self.err.items()}}

    def load_state_dict(self, state: dict) -> None:
        g = self.grads
        self._new_step()
        self.step = int(state["step"])
        # in place: the mappings may be a traced step's variables (use_memory)
        refill(self.q, {k: g.from_saved(k, v) for k, v in state["q"].items()})
        refill(self.err, {k: g.from_saved(k, v) for k, v in state.get("err", {}).items()})
        self._no_q.clear()
        self._live.clear()
        self._q_at.clear()  # inside delay=: the checkpoint's Q is every warm start's now
        if self._in_trace is not None:
            for name, memory in self._in_trace.items():
                if name != "err":
                    memory.clear()
            self._fill_ring()

    def _fill_ring(self) -> None:
        """Traced inside ``delay=``: every warm start from :attr:`q` (where it has a matrix's
        Q; else the seeded one), as the eager exchange after a checkpoint."""
        for key, q in self.q.items():
            for i in range(self._lag):
                self._in_trace[f"q{i}"][key] = q

    def settled(self, exchange: _DelayedLowRank) -> None:
        """Inside ``delay=``: ``exchange`` was used or discarded (no longer in flight)."""
        if exchange in self._live:
            self._live.remove(exchange)

    def forget(self) -> None:
        """Start over: no residuals, fresh Q (every rank alike)."""
        self.q.clear()
        self.err.clear()
        self._q_at.clear()
        self._no_q.clear()
        self._live.clear()
        self._new_step()
        for memory in (self._in_trace or {}).values():
            memory.clear()

    def drop_per_rank(self) -> None:
        """Drop this rank's residuals; Q is shared and stays."""
        self.err.clear()
        self._live.clear()
        for name, memory in (self._in_trace or {}).items():
            if not name.startswith("q"):
                memory.clear()

    def _owed(self) -> dict[str, Any]:
        """By key, what this rank's compression has not delivered yet: ``E`` and, inside
        ``delay=``, what the exchanges in flight took of it (they give it back if dropped)."""
        ops = self.ops
        if self._in_trace is not None:
            mem = self._in_trace
            owed = {}
            for key in self._trace_keys:
                total = ops.add(mem["err"].read(key), mem["late"].read(key))
                for i in range(1, self._lag - 1):
                    total = ops.add(total, mem[f"taken{i}"].read(key))
                owed[key] = total
            return owed
        owed = dict(self.err)
        for exchange in self._live:
            for key, e in zip(exchange.keys, exchange.taken):
                if e is not None:
                    owed[key] = ops.add(owed[key], e) if key in owed else e
        return owed

    def status(self) -> dict:
        """``residual_norm``: of what this rank still owes (:meth:`_owed`)."""
        compressed = sorted({self.layer_names[li] for (li, _), r in self._rank.items() if r})
        owed = list(self._owed().values())
        return {"step": self.step, "compressing": self.step >= self.config.warmup_steps,
                "layers": compressed, "residual_norm": float(self.ops.to_host(
                    [self.ops.norm(owed)])[0]) if owed else 0.0}
