"""Accumulation-threshold memory for torch: what a rank has not sent yet, and the point each
layer returns to when it next synchronizes (see :mod:`hvdsync.threshold`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from horovod.torch.mpi_ops import ProcessSet

from hvdsync.stats import SyncStats
from hvdsync.threshold import ThresholdConfig, ThresholdPolicy
from hvdsync.torch.comm import control_allreduce
from hvdsync.torch.util import norm_of


class AccumulationThreshold:
    """Per-layer local accumulation, the shared send/skip decision, and reconciliation.

    ``acc[p]`` holds the gradients of ``p`` summed since its layer last synced (present only
    while the layer is skipping: a layer sent every step costs no copy). ``anchor[p]`` holds
    ``p`` and its optimizer state as they were at that sync (taken when the first local-only
    update is about to happen), restored right before the layer's next sync.
    """

    def __init__(self, config: ThresholdConfig, layer_params: list[list[torch.Tensor]],
                 optimizer_state: dict, process_set: ProcessSet, stats: SyncStats):
        self.policy = ThresholdPolicy(config, len(layer_params))
        self.layer_params = layer_params
        self.optimizer_state = optimizer_state
        self.process_set = process_set
        self.stats = stats
        self.acc: dict[torch.Tensor, torch.Tensor] = {}
        self.anchor: dict[torch.Tensor, tuple[torch.Tensor, Any]] = {}

    def forget(self) -> None:
        """Drop unsent accumulations and sync points (after a checkpoint restore they would
        roll layers back to values from before it)."""
        self.acc.clear()
        self.anchor.clear()

    def decide(self) -> list[bool]:
        """Fold this step's gradients into the accumulations and agree on what to send."""
        relative = self.policy.config.relative
        acc_norms, param_norms = [], []
        for params in self.layer_params:
            current = []
            for p in params:
                if p.grad.is_sparse:
                    raise ValueError("threshold= does not support sparse gradients yet; use "
                                     "sparse_as_dense=True with a dense-gradient model or no "
                                     "threshold")
                if p in self.acc:
                    self.acc[p].add_(p.grad)
                current.append(self.acc.get(p, p.grad))
            acc_norms.append(norm_of(current))
            if relative:  # parameters as of the last sync: identical on every rank
                param_norms.append(norm_of([self.anchor[p][0] if p in self.anchor
                                            else p.detach() for p in params]))
        local = torch.stack(acc_norms + param_norms).tolist()
        shared = control_allreduce(local, "hvdsync.control.threshold", self.process_set,
                                   self.stats)
        n = len(self.layer_params)
        return self.policy.decide(shared[:n], shared[n:] if relative else None)

    def before_send(self, layer: int) -> None:
        """The layer syncs now: its gradient becomes the accumulation, and its parameters and
        optimizer state return to the last sync point if they moved locally since."""
        for p in self.layer_params[layer]:
            acc = self.acc.pop(p, None)
            if acc is not None:
                p.grad.copy_(acc)
            anchor = self.anchor.pop(p, None)
            if anchor is not None:
                data, state = anchor
                with torch.no_grad():
                    p.copy_(data)
                if state is None:
                    self.optimizer_state.pop(p, None)
                else:
                    self.optimizer_state[p] = state

    def on_skip(self, layer: int) -> None:
        """The layer stays local this step: keep its gradient, remember the sync point."""
        for p in self.layer_params[layer]:
            if p not in self.acc:
                self.acc[p] = p.grad.detach().clone()
            if p not in self.anchor:
                state = self.optimizer_state.get(p)
                self.anchor[p] = (p.detach().clone(),
                                  copy.deepcopy(state) if state is not None else None)
