"""One step of hvdsync, framework-neutral: which technique is asked what, and when.

The adapters feed it: torch calls :meth:`StepPipeline.layer_ready` from its backward hooks
and :meth:`finish_backward` from ``synchronize()``; Keras calls both from its eager step. It
never names a technique: it asks each one, in the rulebook's order (:mod:`hvdsync.core.rules`),
what its role does at that moment (:mod:`hvdsync.core.technique`), and only the techniques
that do something then. Layers go a *ready group* at a time (:mod:`hvdsync.core.groups`:
which go together, and the fixed order where collectives pair by order), so the techniques'
tensor work is a few multi-tensor ops per group; what the step has done so far is its
:class:`StepState`. The end of backward is a sequence of named phases
(:meth:`finish_backward`). docs/walk.md walks a gradient through; docs/design.md has "Ready
groups" and "The no-hang rule".
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Optional

from hvdsync.core.groups import DEFAULT_GROUP_BYTES, FIRST_GROUP_BYTES, ReadyGroups
from hvdsync.core.wire import Pending, finish_dropped, wait_all
from hvdsync.core.ports import Communicator, Gradients, TensorOps
from hvdsync.core.rules import CARRIED, UPDATES_LOCALLY, decided
from hvdsync.core.stats import SyncStats
from hvdsync.core.technique import (BEFORE_UPDATE, DECIDER, SYNC, TRANSFORM, TRANSPORT, Decider,
                                    Technique, Transform, Transport)
from hvdsync.safety import checkpoint
from hvdsync.safety.agreement import RanksDisagree

__all__ = ["DEFAULT_GROUP_BYTES", "FIRST_GROUP_BYTES", "StepPipeline", "StepState"]


class StepState:
    """What one step has done so far, layer by layer (a new one each step)."""

    def __init__(self, n: int):
        #: layers taken in a group and handled (sent, kept back or left to their transport)
        self.ready = [False] * n
        #: per layer, each transport's parameters (``(transport, ks)``)
        self.parts: list[list[tuple[Transport, list[int]]]] = [[] for _ in range(n)]
        #: per layer, the parameters a decider governs (not those of rules.UNDECIDED)
        self.governed: list[list[int]] = [[] for _ in range(n)]
        self.kept: list = []  # this rank's gradients of the layers the decider kept back
        #: layer -> parameters exchanged this step, whose values tell whether it was finite
        self.sent: dict[int, list[int]] = {}
        #: layer -> what it waits for: ``(pending, ks)``, the parameters it reduces (a
        #: pending's result is their reduced gradients, or ``None``: the transport wrote them)
        self.pending: dict[int, list[tuple[Pending, list[int]]]] = {}
        self.started = [False] * n
        self.any_started = False
        self.dense_bytes = 0  # what plain Horovod would have sent this step
        self.skipped: list[str] = []  # the layers the decider kept back
        self.groups = 0
        #: per layer sent: ``(name, bytes, collectives)`` (for the statistics)
        self.sent_stats: list[tuple[str, int, int]] = []
        self.begun = False  # the step's entry is declared (hvdsync.safety.entries)


class StepPipeline:
    """Runs the techniques' moments for every step of one wrapped optimizer."""

    def __init__(self, layer_names: list[str], techniques: list[Technique], grads: Gradients,
                 ops: TensorOps, stats: SyncStats, comm: Optional[Communicator] = None,
                 group_bytes: int = DEFAULT_GROUP_BYTES,
                 first_group_bytes: Optional[int] = None):
        self.layer_names = layer_names
        self.ops = ops
        self.comm = comm
        #: whether the last step's gradients were finite on every rank (else it was skipped
        #: everywhere: the adapter does not let the wrapped optimizer step)
        self.step_ok = True
        self._warned_nonfinite = False
        self._after_load: Optional[bool] = None
        self.techniques = list(techniques)
        self.grads = grads
        self.stats = stats
        self.transforms = [t for t in techniques if t.role == TRANSFORM]
        deciders = [t for t in techniques if t.role == DECIDER]
        self.decider: Optional[Decider] = deciders[0] if deciders else None
        self.transports: list[Transport] = [t for t in techniques if t.role == TRANSPORT]
        if len(deciders) > 1 or not self.transports:
            raise ValueError("a pipeline takes at most one decider and at least one transport")
        self.by_name = {t.name: t for t in techniques}
        self._set_local_step()
        # each moment asks only the techniques that do something then
        self._doing = {moment: [t for t in techniques if _does(t, moment)] for moment in (
            "layer_ready", "group_started", "backward_done", "start_early", "fill",
            "before_optimizer_step", "end_step", "after_optimizer_step", "after_wait")}
        # the transports finish what arrived before a transform changes it (global clip)
        self._doing["after_wait"].sort(key=lambda t: t.role != TRANSPORT)
        self._ready_transports = [t for t in self._doing["layer_ready"] if t.role == TRANSPORT]
        #: the transports whose layers go every step, whatever the decider plans (rules.UNDECIDED)
        self._undecided = tuple(t for t in self.transports if not decided(t))
        self._ranges: dict[int, list[int]] = {}  # [0..n-1] by n, shared (read only)
        #: ``(layer name, time.perf_counter())`` when each layer's first send of the current
        #: (or last) step started: shows sends overlapping backward
        self.send_times: list[tuple[str, float]] = []
        #: which layers go together (and in which order, where collectives pair by order)
        self.groups = ReadyGroups(len(layer_names), grads.layer_bytes, group_bytes,
                                  first_group_bytes,
                                  in_order=comm is not None and not comm.matches_by_name)
        if comm is not None:
            comm.entries.name_after(layer_names)
        self.state = StepState(len(layer_names))

    def _set_local_step(self) -> None:
        local = [t for t in self.transports if t.name in UPDATES_LOCALLY]
        beside = [t for t in self.transports if local and t is not local[0]
                  and CARRIED.get(t.name, ("",))[0] != local[0].name]
        if len(local) > 1 or beside:
            raise ValueError("a transport that updates locally must be the step's only one "
                             "(but for those it carries)")
        #: the transport of a step that updates locally (:data:`rules.UPDATES_LOCALLY`),
        #: or None. A tracing adapter builds such a step as: its traced form's ``trace_local``
        #: (``local_step.traced``: :class:`hvdsync.techniques.delay.traced.TracedDelay`) on
        #: every layer (graph ops: the gradients to apply), then on the host
        #: :meth:`before_local_update` (before the update where :meth:`host_before_update`
        #: asks, else after it), the update, the traced form's ``end_local_step``, the step's
        #: statistics closed, :meth:`after_local_update` -- the eager step's moments in order
        self.local_step: Optional[Transport] = local[0] if local else None
        #: what a traced local step runs on the host around its update: the local step's
        #: transport, then the techniques that synchronize the replicas after the update
        self._around_update = ([self.local_step] if self.local_step else []) + [
            t for t in self.techniques if t.role == SYNC]

    def _new_step(self) -> None:
        self.state = StepState(len(self.layer_names))
        self.groups.new_step()

    def _begin(self) -> None:
        """The step's first moment on this rank: its collectives, and the ones after its
        update, are a training step's (compared between ranks: hvdsync.safety.entries)."""
        self.state.begun = True
        if self.comm is not None and self.comm.size > 1:  # (alone, no rank to tell)
            self.comm.entries.begin("step", self.stats.total.step + 1)

    @property
    def busy(self) -> bool:
        """Whether the current step has begun (backward made layers ready, or started
        sends)."""
        return bool(self.state.pending or self.groups.open)

    # -- in backward ---------------------------------------------------------------------------
    def layer_ready(self, li: int) -> None:
        """Layer ``li``'s local gradient is final: it joins the open ready group, and every
        group that closes goes (transformed, decided, sent) -- now, or where collectives pair
        by order, once the layers before it are taken."""
        if not self.state.begun:
            self._begin()
        if self._after_load is not None:  # before any layer of the step uses the memory
            self.check_load()
        for group in self.groups.arrive(li):
            self._take_group(group)

    def _take_group(self, group: list[int], share: bool = False) -> None:
        if group:
            self.state.groups += 1
            with self.grads.working():
                self._take(group, share)

    def _take(self, group: list[int], share: bool = False) -> None:
        """A ready group: each layer's transports, then the group's transforms (clip) and the
        decider's statistics at once, then each layer sent (or kept back) in turn; ``share``:
        the step's last group, the decider's control round starts before its data."""
        state = self.state
        state.dense_bytes += sum(self.grads.ready(group))  # what plain Horovod would send
        sizes = [len(layer) for layer in self.grads.layers(group)]
        for li, n in zip(group, sizes):
            parts = state.parts[li] = self._split(li, n)
            state.governed[li] = [k for t, ks in parts if t not in self._undecided for k in ks]
        # transports first: sparse sums duplicate rows before anything measures them (each
        # is told of every layer: lowrank's buckets wait for layers it owns nothing of now)
        for t in self._ready_transports:
            for li in group:
                t.layer_ready(li, next((ks for owner, ks in state.parts[li] if owner is t), []))
        # then the transforms (clip), then the decider (its statistics see the clipped
        # gradients): each once for the group
        if self.transforms:
            everything = [(li, self._positions(n)) for li, n in zip(group, sizes)]
            for t in self.transforms:
                t.group_ready(everything)
        sends = self._decide(group)
        if share:
            self.decider.share(self.ops.bad(state.kept))
        self._start(group, sends)
        for t in self._doing["group_started"]:
            t.group_started()

    def _decide(self, group: list[int]) -> list[int]:
        """The group's layers that a transport no decider governs sends go at once; of the
        rest, those the decider's plan sends (what they kept back joins them), the others
        are kept back. Returns the layers the decider lets go."""
        state, decider = self.state, self.decider
        if decider is not None:
            decider.group_ready([(li, state.governed[li]) for li in group])
        sends = []
        for li in group:
            state.ready[li] = True
            if not state.governed[li]:
                continue
            if decider is None or decider.decision(li):
                sends.append(li)
            else:
                self._keep(li)
        if decider is not None and sends:  # what they kept back joins them, at once
            decider.on_send_group([(li, state.governed[li]) for li in sends])
        return sends

    def _start(self, group: list[int], sends: list[int]) -> None:
        """The group's sends start, its gradients as they are now read at once: what no
        decider governs (sparse rows: every step), then what the decider lets go."""
        parts = self.state.parts
        layers = dict(zip(group, self.grads.layers(group)))
        for li in group:
            for t, ks in parts[li]:
                if ks and t in self._undecided:
                    self._send(li, t, ks, layers[li])
        for li in sends:
            for t, part in parts[li]:
                if part and t not in self._undecided:
                    self._send(li, t, part, layers[li])

    def _split(self, li: int, n: int) -> list[tuple[Transport, list[int]]]:
        """Each of the layer's ``n`` parameters to the first transport that owns it."""
        last = self.transports[-1]
        if len(self.transports) == 1:
            return [(last, self._positions(n))]
        owned: dict[Transport, list[int]] = {}
        for k in range(n):
            t = next((t for t in self.transports[:-1] if t.owns(li, k)), last)
            owned.setdefault(t, []).append(k)
        return list(owned.items())

    def _positions(self, n: int) -> list[int]:
        """``[0, .., n-1]``, made once per ``n`` and shared (read only)."""
        r = self._ranges.get(n)
        if r is None:
            r = self._ranges[n] = list(range(n))
        return r

    def _keep(self, li: int) -> None:
        """The decider keeps layer ``li`` back this step."""
        ks = self.state.governed[li]
        # checked for NaN/Inf by the decider's control plane (no data goes to tell)
        self.state.kept.extend(self.grads.get(li, k) for k in ks)
        self.decider.on_skip(li, ks)
        self.state.skipped.append(self.layer_names[li])

    def _send(self, li: int, t: Transport, ks: list[int], layer: list) -> None:
        state = self.state
        if t.name not in UPDATES_LOCALLY:  # (else it checks its own NaN/Inf)
            state.sent.setdefault(li, []).extend(ks)
        if not state.started[li]:
            if not state.any_started:
                self.send_times, state.any_started = [], True
            state.started[li] = True
            self.send_times.append((self.layer_names[li], time.perf_counter()))
        pending = t.start(li, ks, layer)
        if pending is not None:
            state.pending.setdefault(li, []).append((pending, ks))

    def _add(self, pendings: dict[int, Pending]) -> None:
        for li, p in pendings.items():
            self.state.pending.setdefault(li, []).append((p, []))

    def _fill(self, li: int) -> list[list[int]]:
        """Give layer ``li``'s parameters without a gradient one (what a transport knows of
        its layout, else zeros); it joins the open ready group (the groups that closed)."""
        for k in self.grads.missing(li):
            value = next((v for v in (t.fill(li, k) for t in self._doing["fill"])
                          if v is not None), None)
            self.grads.set(li, k, value if value is not None else self.grads.zeros(li, k))
        return self.groups.join(li)

    # -- synchronize(): the end of backward, in named phases ---------------------------------
    def finish_backward(self) -> None:
        """Make every layer ready (parameters without a gradient get zeros, as in Horovod),
        send everything queued, start the decider's control exchange, wait for all of it, and
        close the step up to the wrapped optimizer's update."""
        with self.grads.working():
            if not self.state.begun:  # (a step in which no layer became ready in backward)
                self._begin()
            self.check_load()
            shared = self._last_group()
            self._fill_missing()
            self._send_rest(shared)
            self._wait()
            self._close()
        self.grads.joined()

    def _last_group(self) -> bool:
        """Phase 1: the last group backward made ready goes. If it is the step's last one,
        the decider's control round starts before its data, so that Horovod takes both in
        one cycle (and fuses them) instead of the control round waiting a cycle after the
        data: measured, threshold=0 on a 2.4 ms step 1.24x -> 1.15x plain Horovod (median).
        Only where collectives pair by name: whether a layer is missing is this rank's own.
        Returns whether the control round has started."""
        open_ = set(self.groups.open)
        shared = (self.decider is not None and self.groups.order is None and bool(open_)
                  and all(r or li in open_ for li, r in enumerate(self.state.ready)))
        self._take_group(self.groups.close(), share=shared)
        return shared

    def _fill_missing(self) -> None:
        """Phase 2: the layers backward did not make ready on this rank, filled and taken in
        one fixed order, so every rank starts the rest alike -- those whose layout a
        transport learns only from its early round (what ``backward_done`` returns) after
        that round."""
        missing = [li for li, r in enumerate(self.state.ready) if not r]
        waiting = {li for t in self._doing["backward_done"] for li in t.backward_done(missing)}
        held = [li for li in missing if li in waiting]
        for li, arrived in self.groups.rest(missing):
            if li in held:
                continue
            for group in (self.groups.join(li) if arrived else self._fill(li)):
                self._take_group(group)
        self._take_group(self.groups.close())
        for t in self._doing["start_early"]:
            self._add(t.start_early())
        for li in held:
            for group in self._fill(li):
                self._take_group(group)
        self._take_group(self.groups.close())

    def _send_rest(self, shared: bool) -> None:
        """Phase 3: what the transports queued goes; the decider's control round starts with
        the data (unless phase 1 started it)."""
        for t in self.transports:
            self._add(t.send_rest())
        if self.decider is not None and not shared:  # in flight with the data, waited on in
            self.decider.share(self.ops.bad(self.state.kept))  # _settle

    def _wait(self) -> None:
        """Phase 4: every layer's exchange arrives (in layer order); the reduced gradients a
        transport's pendings return are written back at once; the transforms that change an
        average (clip's global mode) run on them."""
        state, names = self.state, self.layer_names
        arrived = sorted(state.pending)
        state.sent_stats = [(names[li], sum(p.nbytes for p, _ in state.pending[li]),
                             sum(p.collectives for p, _ in state.pending[li])) for li in arrived]
        waits = [(li, p, ks) for li in arrived for p, ks in state.pending[li]]
        results = wait_all([p for _, p, _ in waits])
        writes = [(li, ks, result) for (li, _, ks), result in zip(waits, results)
                  if result is not None]
        if writes:
            self.grads.write(writes)
        for t in self._doing["after_wait"]:
            t.after_wait(arrived)
        state.pending.clear()

    def _close(self) -> None:
        """Phase 5: the step's shared verdict, the techniques' moments before the update,
        the step's statistics."""
        self.step_ok = self._settle()
        for t in self._doing["before_optimizer_step"]:
            t.before_optimizer_step()
        self.grads.before_optimizer_step(self.step_ok)
        for t in self._doing["end_step"]:
            t.end_step(self.step_ok)
        state = self.state
        if state.groups:
            self.stats.count("ready_groups", state.groups)
        self.stats.end_step(state.dense_bytes, state.sent_stats, state.skipped)
        self._new_step()

    def _settle(self) -> bool:
        """Whether the step's gradients were finite on every rank -- from values every rank
        has alike: the exchanged gradients (a NaN anywhere is in every rank's sum) and, for
        layers a decider kept back, the decider's control plane. A bad step is skipped on
        every rank; warned once, counted as ``nonfinite_steps``."""
        sent = sorted(self.state.sent.items())
        layers = self.grads.layers([li for li, _ in sent]) if sent else []
        tensors = [layer[k] for (_, ks), layer in zip(sent, layers) for k in ks]
        data_ok = self.ops.all_finite(tensors)  # one check, one device read
        ok = self.decider.settle(data_ok) if self.decider else data_ok
        if not ok:
            self.note_nonfinite()
        return ok

    def note_nonfinite(self) -> None:
        """Count a step skipped because a gradient was non-finite on some rank; warn once."""
        self.stats.count("nonfinite_steps")
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn("hvdsync: a gradient held NaN or Inf on some rank: the step is "
                          "skipped on every rank (counted in stats as 'nonfinite_steps'; "
                          "further warnings suppressed; docs/failures.md)", RuntimeWarning,
                          stacklevel=3)

    def after_optimizer_step(self) -> None:
        self.grads.after_optimizer_step()
        for t in self._doing["after_optimizer_step"]:
            t.after_optimizer_step()

    def abandon_step(self) -> None:
        """Finish what is in flight and forget the step (before loading a checkpoint). A
        collective that fails here is dropped with the step (:func:`finish_dropped`)."""
        finish_dropped([p for ps in self.state.pending.values() for p, _ in ps],
                       "the abandoned step")
        self._new_step()

    def leave_world(self) -> None:
        """Horovod is about to shut down and start again with other ranks (an Elastic
        reset): the step in flight and every technique's exchanges in flight are finished
        or, where they fail, dropped -- none may outlive the world that started it."""
        self.abandon_step()
        for t in self.techniques:
            t.discard()

    # -- a traced step that updates locally (delay= in Keras' compiled function) -------------
    def host_before_update(self) -> bool:
        """Whether the next traced step that updates locally must run
        :meth:`before_local_update` on the host before its update (a technique reads the
        parameters as they are then: its host flag :data:`BEFORE_UPDATE`); if not, it runs
        after the update, in the step's one host call."""
        return any(t.host_flags().get(BEFORE_UPDATE, False) for t in self._around_update)

    def before_local_update(self) -> None:
        """Host, before the update of a traced step that updates locally -- or, where
        :meth:`host_before_update` says it need not, after the update: the local step's
        transport, then the synchronization after it, as the eager step runs them."""
        for t in self._around_update:
            t.before_optimizer_step()

    def after_local_update(self) -> None:
        """Host, after the step's statistics are closed (as the eager step's moments run)."""
        for t in self._around_update:
            t.after_optimizer_step()

    # -- checkpoints ---------------------------------------------------------------------------
    def after_load(self, restored_own: Optional[bool]) -> None:
        """A checkpoint was restored (``restored_own``: with this rank's own memory). The next
        step checks, where every rank is, that all ranks restored the same shared state, and
        that either every rank has its own memory back or none keeps any. ``None``: no check
        is due (every rank just took the same shared state and dropped its own)."""
        self._after_load = restored_own

    def check_load(self) -> None:
        if self._after_load is None:
            return
        restored, self._after_load = self._after_load, None
        if self.comm is None or self.comm.size == 1:
            return
        everyone = self.comm.gather_json(
            {"restored": restored, "digest": checkpoint.shared_digest(self.techniques)},
            "hvdsync.checkpoint.check")
        digests = [e["digest"] for e in everyone]
        if len(set(digests)) > 1:
            groups = {d: [r for r, x in enumerate(digests) if x == d] for d in digests}
            raise RanksDisagree(
                "hvdsync: the ranks restored different technique state (ranks "
                + " / ".join(str(rs) for rs in groups.values()) + " agree among themselves): "
                "load the same checkpoint on every rank, or broadcast it with "
                "hvd.broadcast_optimizer_state (docs/checkpoints.md)")
        if not all(e["restored"] for e in everyone):
            lost = checkpoint.drop_per_rank(self.techniques)
            if lost:
                warnings.warn("hvdsync: not every rank has its own memory back (a checkpoint "
                              "restored on some ranks only, of another rank count, or a "
                              "Horovod Elastic reset), so every rank drops its own; this "
                              f"rank dropped {'; '.join(lost)} (docs/checkpoints.md)",
                              RuntimeWarning, stacklevel=3)

    # -- outside the step ------------------------------------------------------------------------
    def flush_replicas(self) -> int:
        if self.comm is not None:
            entries = self.comm.entries
            entries.begin("flush", self.stats.total.step)
            if any(_does(t, "flush_replicas") for t in self.techniques):
                # told (and checked) now, before the flush waits for anything: with the
                # first collective, a rank that first waits for a round another rank starts
                # only after its own tag would wait for ever
                entries.before("flush()'s collectives")
        return sum(t.flush_replicas() for t in self.techniques)

    def status(self, name: str) -> dict[str, Any]:
        t = self.by_name.get(name)
        return t.status() if t is not None else {}


def _does(t: Technique, moment: str) -> bool:
    """Whether technique ``t`` does something at ``moment``: it has the moment and does not
    leave it to its role's default (which does nothing)."""
    own = getattr(type(t), moment, None)
    base = getattr(_ROLES.get(t.role, Technique), moment, None)
    return own is not None and own is not base


_ROLES = {TRANSFORM: Transform, DECIDER: Decider, TRANSPORT: Transport}
