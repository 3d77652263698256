"""``lowrank=`` inside ``delay=``, traced (Keras' compiled train function; delay's
``fold="due"``).

Delay's traced step exchanges the last step's gradient (id ``t - 1``, *held*) beside this
step's backward and, on a drain, this step's own (id ``t``) after it; each is folded in
``staleness`` (s) steps after its own step. The eager rules in that order: the exchange of id
``j`` warm-starts from the Q of the newest compressed exchange of an id ``<= j - s - 1`` (a
ring of ``s + 1`` Qs, slot ``j mod (s + 1)``); it takes ``E`` as it was when step ``j`` began
(a residual folded in at step ``j`` joins ``E`` one step later: ``late``); until it is folded
in, an exchange keeps its residual and what it took (``res{i}``, ``taken{i}``: due in ``i``
steps), so a flush can give back what it took.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from hvdsync.techniques.lowrank.codec import FACTORS
from hvdsync.techniques.lowrank.factors import two_rounds
from hvdsync.core.ports import TensorOps


def ring_memory(q: dict, err: dict, lag: int) -> dict[str, dict]:
    """The memories a traced step keeps (host values while they hold nothing): a ring of
    ``lag`` Qs, ``err``, ``late`` and, per exchange in flight, ``res{i}`` and ``taken{i}``."""
    in_flight = {f"{kind}{i}": err for kind in ("res", "taken") for i in range(1, lag - 1)}
    return {**{f"q{i}": q for i in range(lag)}, "err": err, "late": err, **in_flight}


def traffic(ops: TensorOps, ranks: list[int], tensors: list,
            wire_bytes: Callable[[Any], int], compressed: Any) -> tuple[Any, Any]:
    """Bytes and collectives of one layer's exchange (``ranks``: each tensor's compression
    rank, 0: plain), where the device boolean ``compressed`` says whether it is compressed:
    the eager exchange's figures."""
    plain = sum(wire_bytes(x) for x in tensors)
    comp = [i for i, r in enumerate(ranks) if r]
    if not comp:
        return plain, 1
    shapes = [(ops.matrix_shape(tensors[i]), ranks[i]) for i in comp]
    p_bytes = sum(wire_bytes(tensors[i]) * r // m for i, ((_, m), r) in zip(comp, shapes))
    rows = sum(n * r for (n, _), r in shapes)
    cols = sum(m * r for (_, m), r in shapes)
    rest = plain - sum(wire_bytes(tensors[i]) for i in comp)
    compressed_bytes = rest + p_bytes + p_bytes * cols // max(rows, 1)
    return (ops.where(compressed, compressed_bytes, plain),
            ops.where(compressed, 2 + (len(comp) < len(tensors)), 1))


@dataclass
class _Build:
    """One traced step's exchanges: the layers ``(li, ks)``, each one's compressed positions,
    their keys, the step's ``reduce`` and flags, and the memory as the step began."""

    layers: list[tuple[int, list[int]]]
    comp: list[list[int]]
    keys: list[str]
    reduce: Callable[[int, str, list], list]
    flags: dict[str, Any]
    read: dict[str, dict[str, Any]]


class TracedRing:
    """The memory of :class:`hvdsync.techniques.lowrank.in_delay.LowRankInDelay` in a traced step's device
    variables (:func:`ring_memory`), and the exchanges built on it."""

    def __init__(self, owner: Any, memory: dict[str, Any], lag: int, keys: list[str]):
        self.owner, self.memory, self.lag, self.keys = owner, memory, lag, keys
        #: the ring of Qs (shared by every rank; the other memories are this rank's)
        self.q_names = [f"q{i}" for i in range(lag)]

    def build(self, layers: list[tuple[int, list[int]]], held: Optional[list[list]],
              own: list[list], reduce: Callable[[int, str, list], list],
              flags: dict[str, Any]) -> tuple[list[list], list[list]]:
        """Delay's exchanges: of ``held`` (per layer, the last step's gradients; ``None`` when
        synchronous) where ``flags["exchange_held"]``, and of ``own`` (this step's) where
        ``flags["drain"]`` (always when synchronous); ``reduce(li, name, tensors)`` averages
        over ranks. Returns each one's rank average per layer -- the held one less the held
        gradients (delay's correction ``G - g``) -- or zeros where it did not run, and writes
        the memory."""
        g, ops = self.owner.grads, self.owner.ops
        comp = [[i for i, k in enumerate(ks) if self.owner.rank_for(li, k)] for li, ks in layers]
        keys = [g.key(li, ks[i]) for (li, ks), c in zip(layers, comp) for i in c]
        read = {name: {k: m.read(k) for k in keys} for name, m in self.memory.items()}
        b = _Build(layers, comp, keys, reduce, flags, read)
        drain = True if held is None else flags["drain"]
        if held is None:  # synchronous: the last step's residual joins before this exchange
            held_out = None
            err = {k: ops.add(read["err"][k], read["late"][k]) for k in keys}
        else:
            held_out = self._exchange(b, "held", held, flags["exchange_held"], read["err"])
            err = {k: ops.add(held_out[4][k], read["late"][k]) for k in keys}
        own_out = self._exchange(b, "own", own, drain, err)
        self._write(b, held_out, own_out, drain)
        return (held_out[0] if held_out is not None else []), own_out[0]

    def _warm(self, b: _Build, slot: Any) -> dict:
        """By key, the Q in the ring slot the one-hot ``slot`` names."""
        ops, out = self.owner.ops, {}
        for k in b.keys:
            q = b.read[f"q{self.lag - 1}"][k]
            for i in range(self.lag - 1):
                q = ops.where(slot[i], b.read[f"q{i}"][k], q)
            out[k] = q
        return out

    def _exchange(self, b: _Build, which: str, tensors: list[list], run: Any, e: dict
                  ) -> tuple:
        """``(delivered per layer, new Qs, residuals, E taken, E left)`` by key."""
        ops, names = self.owner.ops, self.owner.layer_names
        q0 = self._warm(b, b.flags[f"{which}_slot"])
        zeros = {k: ops.zeros_like(e[k]) for k in b.keys}
        at_keys = iter(b.keys)
        mine = [[next(at_keys) for _ in c] for c in b.comp]

        def compressed() -> tuple:
            delivered, new_q, residuals = [], {}, {}  # (delivered: averages, below)
            for (li, ks), c, ks_of, xs in zip(b.layers, b.comp, mine, tensors):
                name = f"{names[li]}.delay.{which}"
                if not c:
                    delivered.append(b.reduce(li, f"hvdsync.{name}", xs))
                    continue
                rest = [x for i, x in enumerate(xs) if i not in c]
                out, qs, rs = two_rounds(
                    ops, [([xs[i] for i in c], [ops.add(ops.matrix(xs[i]), e[k])
                                                for i, k in zip(c, ks_of)],
                           [q0[k] for k in ks_of], rest)],
                    lambda n, ts, li=li: b.reduce(li, n, ts), name)
                got = iter(out[0])
                by_i = {i: next(got) for i in c}
                by_i.update((i, next(got)) for i in range(len(xs)) if i not in c)
                delivered.append([by_i[i] for i in range(len(xs))])
                new_q.update(zip(ks_of, qs))
                residuals.update(zip(ks_of, rs))
            return corrections(delivered), new_q, residuals, dict(e), zeros

        def plain() -> tuple:  # warm-up: every layer plain, nothing taken
            return (corrections([b.reduce(li, f"hvdsync.{names[li]}.delay.{which}", xs)
                                 for (li, _), xs in zip(b.layers, tensors)]),
                    q0, zeros, zeros, dict(e))

        def corrections(averages: list[list]) -> list[list]:
            if which == "own":
                return averages
            return [[ops.accumulate(a, x, sign=-1) for a, x in zip(avg, xs)]
                    for avg, xs in zip(averages, tensors)]

        def idle() -> tuple:
            return ([[ops.zeros_like(x) for x in xs] for xs in tensors], q0, zeros, zeros,
                    dict(e))
        runs = lambda: ops.cond(b.flags[f"{which}_compressed"], compressed, plain)
        return runs() if run is True else ops.cond(run, runs, idle)

    def _write(self, b: _Build, held_out: Optional[tuple], own_out: tuple, drain: Any) -> None:
        """The memory after the step: ``E``, the Q ring, ``late`` and what is in flight."""
        ops, mem, read, flags = self.owner.ops, self.memory, b.read, b.flags
        for k in b.keys:
            mem["err"].write(k, own_out[4][k], True)
            for i in range(self.lag):
                if held_out is not None:
                    mem[f"q{i}"].write(k, held_out[1][k], flags["held_slot"][i])
                mem[f"q{i}"].write(k, own_out[1][k], flags["own_slot"][i])
            if held_out is None:
                mem["late"].write(k, own_out[2][k], True)
                continue
            # residuals in flight, due in 1 .. s-1 steps; the held exchange's is due in s
            res = [read[f"res{i}"][k] for i in range(1, self.lag - 1)] + [held_out[2][k]]
            taken = [read[f"taken{i}"][k] for i in range(1, self.lag - 1)] + [held_out[3][k]]
            drained = own_out[2][k]
            for r in res:
                drained = ops.add(drained, r)
            mem["late"].write(k, ops.where(drain, drained, res[0]), True)
            for i in range(1, self.lag - 1):  # a drain folds every one in: nothing left
                for kind, xs in (("res", res), ("taken", taken)):
                    mem[f"{kind}{i}"].write(k, ops.where(drain, ops.zeros_like(xs[i]), xs[i]),
                                            True)

    def discard(self, held: Optional[dict[str, Any]], newest: int) -> None:
        """Delay dropped its exchanges in flight (a flush): what they took goes back to
        ``E``, with the residual folded in last (``late``). ``held``: by key, the newest
        step's (``newest``) gradients where the traced step left their exchange to the next
        step -- it runs now, as the eager step ran it in that step: its Q is a warm start of
        later exchanges (and what a checkpoint keeps)."""
        mem, ops, comm = self.memory, self.owner.ops, self.owner.comm
        if held and newest > self.owner.config.warmup_steps:
            slot = mem[f"q{newest % self.lag}"]
            ms = [ops.add(ops.matrix(held[key]), mem["err"].read(key)) for key in self.keys]
            sent, ctx = FACTORS.encode(ops, ms, [slot.read(key) for key in self.keys])
            ps = [comm.allreduce(f"hvdsync.lowrank.flush.P.{key}", [p])
                  for key, p in zip(self.keys, sent)]
            comm.dispatch()
            sent, _ = FACTORS.next_round(ops, [p.wait()[0] for p in ps], ctx)
            qs = [comm.allreduce(f"hvdsync.lowrank.flush.Q.{key}", [q])
                  for key, q in zip(self.keys, sent)]
            comm.dispatch()
            for key, q in zip(self.keys, qs):
                slot[key] = q.wait()[0]
        for key, total in self.owed().items():
            mem["err"][key] = total
        self.clear(keep=[*self.q_names, "err"])

    def owed(self) -> dict[str, Any]:
        """By key, ``E`` plus what the exchanges in flight took of it."""
        ops, mem, owed = self.owner.ops, self.memory, {}
        for key in self.keys:
            total = ops.add(mem["err"].read(key), mem["late"].read(key))
            for i in range(1, self.lag - 1):
                total = ops.add(total, mem[f"taken{i}"].read(key))
            owed[key] = total
        return owed

    def newest_q(self, newest: int) -> dict[str, Any]:
        """By key, the Q the exchange of id ``newest`` left in the ring."""
        slot = self.memory[f"q{newest % self.lag}"]
        return {key: slot.read(key) for key in self.keys}

    def fill(self, q: dict[str, Any]) -> None:
        """Every warm start from ``q`` (where it has a matrix's Q; else the seeded one)."""
        for key, value in q.items():
            for i in range(self.lag):
                self.memory[f"q{i}"][key] = value

    def clear(self, keep: tuple | list = ()) -> None:
        """Empty every memory but those named in ``keep``."""
        for name, memory in self.memory.items():
            if name not in keep:
                memory.clear()
