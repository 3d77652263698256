"""One step of hvdsync, framework-neutral: which technique is asked what, and when.

The adapters feed it: torch calls :meth:`StepPipeline.layer_ready` from its backward hooks
and :meth:`finish_backward` from ``synchronize()``; Keras calls both from its eager step. It
never names a technique: it asks each one, in the rulebook's order (:mod:`hvdsync.core.rules`),
what its role does at that moment (:mod:`hvdsync.core.technique`). The no-hang rule holds here:
which collectives run depends only on shared decisions, shared layouts and the fixed layer
order, and where the engine pairs collectives by order (torch.distributed) layers are taken
in one fixed order, last first, a layer ready early held until those before it are. Layers
go a *ready group* at a time (``group_bytes`` of gradients; ``0``: each alone), so the
techniques' tensor work is a few multi-tensor ops per group. docs/walk.md walks a gradient
through; docs/design.md has "Ready groups" and "The no-hang rule".
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Optional

from hvdsync.safety import checkpoint
from hvdsync.safety.agreement import RanksDisagree
from hvdsync.core.stats import SyncStats
from hvdsync.core.pending import Pending, finish_dropped
from hvdsync.core.ports import Communicator, Gradients, TensorOps
from hvdsync.core.technique import DECIDER, TRANSFORM, TRANSPORT, Decider, Technique, Transport


#: the default size of a ready group (torch DDP's bucket size: large enough that a model of
#: a few tens of MB is clipped in one or two groups, small enough that big models still send
#: while backward runs)
DEFAULT_GROUP_BYTES = 25 * 2**20
#: the step's first ready group closes sooner (DDP's first bucket): the layers backward makes
#: first start their sends while the rest of backward runs, even in a model of a few MB
FIRST_GROUP_BYTES = 2**20


class StepPipeline:
    """Runs the techniques' moments for every step of one wrapped optimizer."""

    def __init__(self, layer_names: list[str], techniques: list[Technique], grads: Gradients,
                 ops: TensorOps, stats: SyncStats, comm: Optional[Communicator] = None,
                 group_bytes: int = DEFAULT_GROUP_BYTES,
                 first_group_bytes: Optional[int] = None):
        self.layer_names = layer_names
        #: a ready group closes once its layers' gradients reach this many bytes (the step's
        #: first one at ``first_group_bytes``, if given)
        self.group_bytes = group_bytes
        self.first_group_bytes = group_bytes if first_group_bytes is None else first_group_bytes
        self.ops = ops
        self.comm = comm
        #: whether the last step's gradients were finite on every rank (else it was skipped
        #: everywhere: the adapter does not let the wrapped optimizer step)
        self.step_ok = True
        #: whether a technique replaced a non-finite gradient of this rank by zeros in the
        #: last step (delay=: the step is not skipped; a loss scaler should back off)
        self.local_nonfinite = False
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
        self._layer_bytes: dict[int, int] = {}  # each layer's parameters' bytes (static)
        local = [t for t in self.transports if t.updates_locally]
        beside = [t for t in self.transports if local and t is not local[0]
                  and t.name not in local[0].carries]
        if len(local) > 1 or beside:
            raise ValueError("a transport that updates locally must be the step's only one "
                             "(but for those it carries)")
        #: the transport of a step that updates locally (:attr:`Transport.updates_locally`),
        #: or None. A tracing adapter builds such a step as: its ``trace_local``
        #: (:class:`hvdsync.core.traced.TracedLocalStep`)
        #: on every layer (graph ops: the gradients to apply), then on the host
        #: :meth:`before_local_update` (before the update where the transport needs it there,
        #: else after it), the update, :meth:`end_local_step`, the step's statistics closed,
        #: :meth:`after_local_update` -- the eager step's moments in its order
        self.local_step: Optional[Transport] = local[0] if local else None
        # [0..n-1] by n, built once and shared (read only): a layer's positions, on the hot
        # path (sizes are known only per step in Keras, so not precomputed per layer)
        self._ranges: dict[int, list[int]] = {}
        #: ``(layer name, time.perf_counter())`` when each layer's first send of the current
        #: (or last) step started: shows sends overlapping backward
        self.send_times: list[tuple[str, float]] = []
        #: the fixed order layers are taken in where collectives pair by order (None: as they
        #: come, Horovod)
        self._order: Optional[list[int]] = (
            None if comm is None or comm.matches_by_name
            else list(reversed(range(len(layer_names)))))
        if comm is not None:
            comm.entries.name_after(layer_names)
        self._new_step()

    def _new_step(self) -> None:
        n = len(self.layer_names)
        self._ready = [False] * n
        self._parts: list[list[tuple[Transport, list[int]]]] = [[] for _ in range(n)]
        self._governed: list[list[int]] = [[] for _ in range(n)]
        self._kept: list = []  # this rank's gradients of the layers the decider kept back
        #: layer -> parameters exchanged this step, whose values tell whether it was finite
        self._sent: dict[int, list[int]] = {}
        self._pending: dict[int, list[Pending]] = {}
        self._started = [False] * n
        self._any_started = False
        self._arrived = [False] * n  # ready from backward, maybe not taken yet (_order)
        self._taken = 0  # how many of _order are taken
        self._group: list[int] = []  # taken, waiting for the rest of their ready group
        self._group_size = 0  # their bytes
        self._group_limit = self.first_group_bytes  # when the group goes
        self._bytes = [0] * n  # each layer's gradient bytes this step (as plain Horovod's)
        self._begun = False  # the step's entry is declared (hvdsync.safety.entries)

    def _begin(self) -> None:
        """The step's first moment on this rank: its collectives, and the ones after its
        update, are a training step's (compared between ranks: hvdsync.safety.entries)."""
        self._begun = True
        if self.comm is not None:
            self.comm.entries.begin("step", self.stats.total.step + 1)

    @property
    def busy(self) -> bool:
        """Whether the current step has begun (backward made layers ready, or started
        sends)."""
        return bool(self._pending or self._group)

    # -- in backward ---------------------------------------------------------------------------
    def layer_ready(self, li: int) -> None:
        """Layer ``li``'s local gradient is final: transform it and send it (or decide) --
        now, or where collectives pair by order, once the layers before it in ``_order`` are
        taken."""
        if not self._begun:
            self._begin()
        if self._after_load is not None:  # before any layer of the step uses the memory
            self.check_load()
        if self._order is None:
            self._join(li)
            return
        self._arrived[li] = True
        order = self._order
        while self._taken < len(order) and self._arrived[order[self._taken]]:
            self._taken += 1
            self._join(order[self._taken - 1])

    def _join(self, li: int) -> None:
        """Layer ``li`` joins the ready group; the group goes once it is big enough."""
        self._group.append(li)
        self._bytes[li] = self.grads.payload_bytes(li)
        # by the parameters' bytes, not this step's payload (a sparse gradient's varies): where
        # collectives pair by order, every rank cuts the same groups from the same order
        size = self._layer_bytes.get(li)
        if size is None:
            size = self._layer_bytes[li] = self.grads.layer_bytes(li)
        self._group_size += size
        if self._group_size >= self._group_limit:
            self._take_group()

    def _take_group(self, share: bool = False) -> None:
        if self._group:
            group, self._group, self._group_size = self._group, [], 0
            self._group_limit = self.group_bytes
            self.stats.count("ready_groups")
            with self.grads.working():
                self._take(group, share)

    def _take(self, group: list[int], share: bool = False) -> None:
        """A ready group: each layer's transports, then the group's transforms (clip) and the
        decider's statistics at once, then each layer sent (or kept back) in turn; ``share``:
        the step's last group, the decider's control round starts before its data."""
        grads = self.grads
        for li in group:
            grads.prepare(li)
            self.stats.dense(self._bytes[li])  # what plain Horovod would send
            parts = self._parts[li] = self._split(li)
            self._governed[li] = [k for t, ks in parts if t.decidable for k in ks]
            # transports first: sparse sums duplicate rows before anything measures them
            if len(self.transports) == 1:
                self.transports[0].layer_ready(li, parts[0][1])
            else:
                owned = dict(parts)
                for t in self.transports:
                    t.layer_ready(li, owned.get(t, []))
        # then the transforms (clip), then the decider (its statistics see the clipped
        # gradients): each once for the group
        if self.transforms:
            everything = [(li, self._positions(li)) for li in group]
            for t in self.transforms:
                t.group_ready(everything)
        decider = self.decider
        if decider is not None:
            decider.group_ready([(li, self._governed[li]) for li in group])
        sends = []
        for li in group:
            self._ready[li] = True
            for t, ks in self._parts[li]:  # not decidable: goes every step (sparse rows)
                if not t.decidable and ks:
                    self._start(li, t, ks)
            if not self._governed[li]:
                continue
            if decider is None or decider.decision(li):
                sends.append(li)
            else:
                self._keep(li)
        if decider is not None and sends:  # what they kept back joins them, at once
            decider.on_send_group([(li, self._governed[li]) for li in sends])
        if share:
            decider.share(self.ops.bad(self._kept))
        for li in sends:
            for t, part in self._parts[li]:
                if t.decidable and part:
                    self._start(li, t, part)
        for t in self.transports:
            t.group_started()

    def _split(self, li: int) -> list[tuple[Transport, list[int]]]:
        """Each parameter of the layer to the first transport that owns it."""
        last = self.transports[-1]
        if len(self.transports) == 1:
            return [(last, self._positions(li))]
        owned: dict[Transport, list[int]] = {}
        for k in range(self.grads.size(li)):
            t = next((t for t in self.transports[:-1] if t.owns(li, k)), last)
            owned.setdefault(t, []).append(k)
        return list(owned.items())

    def _positions(self, li: int) -> list[int]:
        n = self.grads.size(li)
        r = self._ranges.get(n)
        if r is None:
            r = self._ranges[n] = list(range(n))
        return r

    def _keep(self, li: int) -> None:
        """The decider keeps layer ``li`` back this step."""
        ks = self._governed[li]
        # checked for NaN/Inf by the decider's control plane (no data goes to tell)
        self._kept.extend(self.grads.get(li, k) for k in ks)
        self.decider.on_skip(li, ks)
        self.stats.skipped(self.layer_names[li])

    def _start(self, li: int, t: Transport, ks: list[int]) -> None:
        if not t.checks_own:
            self._sent.setdefault(li, []).extend(ks)
        if not self._started[li]:
            if not self._any_started:
                self.send_times = []
                self._any_started = True
            self._started[li] = True
            self.send_times.append((self.layer_names[li], time.perf_counter()))
        pending = t.start(li, ks)
        if pending is not None:
            self._pending.setdefault(li, []).append(pending)

    def _add(self, pendings: dict[int, Pending]) -> None:
        for li, p in pendings.items():
            self._pending.setdefault(li, []).append(p)

    def _fill(self, li: int) -> None:
        """Give layer ``li``'s parameters without a gradient one (what a transport knows of
        its layout, else zeros) and let it join the ready group."""
        for k in self.grads.missing(li):
            value = next((v for v in (t.fill(li, k) for t in self.transports) if v is not None),
                         None)
            self.grads.set(li, k, value if value is not None else self.grads.zeros(li, k))
        self._join(li)

    # -- synchronize() -----------------------------------------------------------------------
    def finish_backward(self) -> None:
        """Make every layer ready (parameters without a gradient get zeros, as in Horovod),
        send everything queued, start the decider's control exchange, wait for all of it, and
        close the step up to the wrapped optimizer's update."""
        with self.grads.working():
            self._finish_backward()
        self.grads.joined()

    def _finish_backward(self) -> None:
        if not self._begun:  # (a step in which no layer became ready in backward)
            self._begin()
        self.check_load()
        n = len(self.layer_names)
        waiting = set(self._group)
        # The last group backward made ready. If it is the step's last one, the decider's
        # control round starts before its data, so that Horovod takes both in one cycle (and
        # fuses them) instead of the control round waiting a cycle after the data: measured,
        # threshold=0 on a 2.4 ms step 1.24x -> 1.15x plain Horovod (median). Only where
        # collectives pair by name: whether a layer is missing is this rank's own.
        shared = (self.decider is not None and self._order is None and bool(self._group)
                  and all(self._ready[li] or li in waiting for li in range(n)))
        self._take_group(share=shared)
        missing = [li for li in range(n) if not self._ready[li]]
        for t in self.transports:
            t.backward_done()
        held = [li for li in missing if any(t.holds(li) for t in self.transports)]
        # fixed order, so every rank starts the rest alike
        rest = missing if self._order is None else self._order[self._taken:]
        for li in rest:
            if li in held:
                continue
            if self._arrived[li]:  # ready, held back by an earlier layer (_order)
                self._join(li)
            else:
                self._fill(li)
        self._take_group()
        for t in self.transports:
            self._add(t.start_early())
        for li in held:
            self._fill(li)
        self._take_group()
        for t in self.transports:
            self._add(t.flush())
        if self.decider is not None and not shared:  # in flight with the data, waited on in
            self.decider.share(self.ops.bad(self._kept))  # _settle
        for li in sorted(self._pending):
            ps = self._pending[li]
            self.stats.sent(self.layer_names[li], sum(p.nbytes for p in ps),
                            sum(p.collectives for p in ps))
        arrived = sorted(self._pending)
        for li in arrived:
            for p in self._pending[li]:
                p.wait()
        for t in self.transforms:
            t.after_wait(arrived)
        self._pending.clear()
        self.step_ok = self._settle()
        for t in self.techniques:
            t.before_optimizer_step()
        self.grads.before_optimizer_step(self.step_ok)
        for t in self.techniques:
            t.end_step(self.step_ok)
        self.local_nonfinite = any(t.local_nonfinite for t in self.techniques)
        self.stats.end_step()
        self._new_step()

    def _settle(self) -> bool:
        """Whether the step's gradients were finite on every rank -- from values every rank
        has alike: the exchanged gradients (a NaN anywhere is in every rank's sum) and, for
        layers a decider kept back, the decider's control plane. A bad step is skipped on
        every rank; warned once, counted as ``nonfinite_steps``."""
        sent = [self.grads.get(li, k) for li, ks in sorted(self._sent.items()) for k in ks]
        data_ok = self.ops.all_finite(sent)  # one check, one device read
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
        for t in self.techniques:
            t.after_optimizer_step()

    def abandon_step(self) -> None:
        """Finish what is in flight and forget the step (before loading a checkpoint). A
        collective that fails here is dropped with the step (:func:`finish_dropped`)."""
        finish_dropped([p for ps in self._pending.values() for p in ps],
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
    def before_local_update(self) -> None:
        """Host, before the update of a traced step that updates locally -- or, where
        its ``host_before_update`` (:class:`hvdsync.core.traced.TracedLocalStep`) says it need
        not, after the update."""
        self.local_step.before_optimizer_step()

    def end_local_step(self, bad: int) -> None:
        """Host, after that update: ``bad``, the count of the step's ``trace_local``."""
        t = self.local_step
        t.end_local_step(bad)
        self.local_nonfinite = t.local_nonfinite

    def after_local_update(self) -> None:
        """Host, after the step's statistics are closed (as the eager step's moments run)."""
        self.local_step.after_optimizer_step()

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
            if any(type(t).flush_replicas is not Technique.flush_replicas
                   for t in self.techniques):
                # told (and checked) now, before the flush waits for anything: with the
                # first collective, a rank that first waits for a round another rank starts
                # only after its own tag would wait for ever
                entries.before("flush()'s collectives")
        return sum(t.flush_replicas() for t in self.techniques)

    def status(self, name: str) -> dict[str, Any]:
        t = self.by_name.get(name)
        return t.status() if t is not None else {}
