"""Local updates with stale global gradients for torch (technique 2; the schedule lives in
:mod:`hvdsync.delay`).

Memory: for every step ``j`` whose global gradient has not been folded in yet, each layer's
local gradients ``g_j`` (kept as backward left them) and a copy being allreduced in the
background into ``G_j``. Folding in is local arithmetic on those tensors; the collectives (one
gradient allreduce per layer per step, one parameter allreduce per layer every K steps) are
the same on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
from horovod.torch.mpi_ops import Average, ProcessSet, grouped_allreduce_async_, synchronize

from hvdsync.delay import DelayConfig, DelayPolicy, staleness_histogram
from hvdsync.stats import SyncStats
from hvdsync.torch.comm import GradientAllreduce, Pending, payload_bytes


@dataclass
class _InFlight:
    """One layer's part of one step's global gradient."""

    params: list[torch.Tensor]
    local: list[torch.Tensor]  # g_j, as the update of step j used it
    reduced: list[torch.Tensor]  # becomes G_j once ``pending`` is finished
    pending: Pending


class DelayedGradients:
    """Starts each step's background allreduce, folds arrived global gradients into the
    update, and averages the parameters on the shared schedule."""

    def __init__(self, config: DelayConfig, allreduce: GradientAllreduce,
                 layer_params: list[list[tuple[str, torch.Tensor]]], layer_names: list[str],
                 process_set: ProcessSet, stats: SyncStats):
        self.config = config
        self.policy = DelayPolicy(config, stats)
        self.allreduce = allreduce
        self.layer_params = layer_params
        self.layer_names = layer_names
        self.process_set = process_set
        self.stats = stats
        self._in_flight: dict[int, dict[int, _InFlight]] = {}  # step id -> layer -> part
        self._average_after_step = False

    @property
    def outstanding(self) -> list[int]:
        """Ids (step numbers) of the global gradients not folded in yet."""
        return sorted(self._in_flight)

    # -- during backward --------------------------------------------------------------------
    def start(self, li: int, name: str, params: list[tuple[str, torch.Tensor]]) -> Pending:
        """Start the background allreduce of layer ``li``'s local gradient for this step; the
        returned Pending only carries the byte and collective counts (nothing to wait for)."""
        for pname, p in params:
            if p.grad.is_sparse:
                raise ValueError(f"delay= supports dense gradients only; {pname} has a sparse "
                                 "gradient (pass sparse_as_dense=True or no delay)")
        step = self.policy.current
        local = [p.grad for _, p in params]
        reduced = [g.detach().clone() for g in local]
        # In-flight ids span at most staleness + 1 consecutive steps, so this slot keeps
        # collective names unique while letting Horovod's response cache reuse them.
        slot = step % (self.config.staleness + 1)
        pending = self.allreduce.start_tensors(
            f"{name}.delay{slot}", [(pname, r) for (pname, _), r in zip(params, reduced)])
        self._in_flight.setdefault(step, {})[li] = _InFlight(
            [p for _, p in params], local, reduced, pending)
        return Pending(nbytes=pending.nbytes, collectives=pending.collectives)

    # -- synchronize(): fold in, then (after the optimizer step) average -------------------
    def fold(self, state: dict) -> None:
        """Every layer of this step has been started: set ``p.grad`` to this step's update
        ``g_t + sum_j (G_j - g_j)`` over the arrived (or due) global gradients. ``state`` is
        the optimizer's (for the size of an averaging step)."""
        t = self.policy.current
        ids = self.outstanding
        ready = {j for j in ids if all(part.pending.ready() for part in self._in_flight[j].values())}
        wait_for, fold = self.policy.plan(ids, ready)
        waited: Optional[float] = None
        if wait_for:
            start = time.perf_counter()
            for j in wait_for:
                for part in self._in_flight[j].values():
                    part.pending.wait()
            waited = time.perf_counter() - start
        parts = [self._in_flight.pop(j) for j in fold]
        for part in parts:
            for layer in part.values():
                layer.pending.wait()  # arrived: returns at once
        own = fold and fold[0] == t  # this step's global gradient is back: use it directly
        current = parts[0] if own else self._in_flight[t]
        corrections = parts[1:] if own else parts
        for li, layer in current.items():
            for k, p in enumerate(layer.params):
                update = layer.reduced[k] if own else layer.local[k].clone()
                for part in corrections:
                    update.add_(part[li].reduced[k]).sub_(part[li].local[k])
                p.grad = update
        self._average_after_step = self.policy.averages_now()
        if self._average_after_step:
            self.stats.count("averaged")
            self.stats.control(*self._averaging_size(state))
        self.policy.finish_step(fold, waited, len(self._in_flight))

    def after_optimizer_step(self, state: dict) -> None:
        """Average the parameters (and, if configured, the optimizer state) when this step
        was an averaging step."""
        if self._average_after_step:
            self._average_after_step = False
            self._average(state)

    def flush(self, state: dict) -> int:
        """Wait for every outstanding global gradient and average the replicas; returns how
        many outstanding global gradients this rank discarded (see ``DistributedOptimizer.flush``).
        A no-op (on every rank alike) right after an averaging step or when synchronous."""
        if self.config.synchronous or self.policy.step % self.config.average_every == 0:
            return 0
        dropped = self.discard()
        self.stats.control(*self._averaging_size(state))
        self._average(state)
        return dropped

    def discard(self) -> int:
        """Finish and drop every outstanding global gradient (e.g. before loading a checkpoint)."""
        n = len(self._in_flight)
        for part in self._in_flight.values():
            for layer in part.values():
                layer.pending.wait()
        self._in_flight.clear()
        self._average_after_step = False
        if n:
            self.stats.count("discarded", n)
        return n

    def status(self) -> dict:
        return {"step": self.policy.step, "outstanding": self.outstanding,
                "last_folded": list(self.policy.last_folded),
                "staleness": staleness_histogram(self.stats.total.counters)}

    # -- parameter averaging ----------------------------------------------------------------
    def _averaged_tensors(self, state: dict) -> list[tuple[str, list[torch.Tensor]]]:
        """Per layer and dtype, the tensors averaged: parameters, then (``"average"``) every
        floating-point state tensor shaped like its parameter, in a fixed order."""
        groups = []
        for name, params in zip(self.layer_names, self.layer_params):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for _, p in params:
                tensors = [p.data]
                if self.config.optimizer_state == "average":
                    tensors += [v for _, v in sorted(state.get(p, {}).items())
                                if torch.is_tensor(v) and v.is_floating_point()
                                and v.shape == p.shape]
                for t in tensors:
                    by_dtype.setdefault(t.dtype, []).append(t)
            groups += [(f"hvdsync.average.{name}.{str(d)[6:]}", ts) for d, ts in by_dtype.items()]
        return groups

    def _averaging_size(self, state: dict) -> tuple[int, int]:
        """Bytes and collectives of one averaging."""
        if self.process_set.size() == 1:
            return 0, 0
        groups = self._averaged_tensors(state)
        return sum(payload_bytes(t) for _, ts in groups for t in ts), len(groups)

    def _average(self, state: dict) -> None:
        if self.process_set.size() == 1:
            return
        handles = [grouped_allreduce_async_(tensors, name=name, op=Average,
                                            process_set=self.process_set)
                   for name, tensors in self._averaged_tensors(state)]
        for h in handles:
            synchronize(h)
