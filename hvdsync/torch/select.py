"""Selected layer pushes for torch (technique 4; the rules live in :mod:`hvdsync.select`).

Memory: ``residual[p]`` holds what a rank computed for ``p`` and has not pushed yet. A layer
chosen for this step sends ``g + residual`` (and its residual empties); a layer not chosen
adds ``g`` to its residual and gets no gradient (``p.grad = None``), so the wrapped optimizer
leaves it -- and its momentum or Adam moments -- untouched this step, identically on every
rank.
"""

from __future__ import annotations

import torch
from horovod.torch.mpi_ops import ProcessSet

from hvdsync.select import LayerSelector, SelectConfig
from hvdsync.stats import SyncStats
from hvdsync.torch.comm import control_allreduce
from hvdsync.torch.util import norm_of


class SelectedPushes:
    """Per-layer residuals, the local statistics the selector needs, and the shared choice."""

    def __init__(self, config: SelectConfig, layer_params: list[list[tuple[str, torch.Tensor]]],
                 process_set: ProcessSet, stats: SyncStats):
        self.selector = LayerSelector(config, len(layer_params))
        self.layer_params = layer_params
        self.process_set = process_set
        self.stats = stats
        self.residual: dict[torch.Tensor, torch.Tensor] = {}
        self._dots: list[torch.Tensor | None] = [None] * len(layer_params)
        #: the last step's local scores, rank-averaged scores, residual norms and (hypernet)
        #: alpha per layer -- for logging and plots
        self.last: dict[str, list[float]] = {}

    def pushes(self, li: int) -> bool:
        """Whether layer ``li`` is pushed this step (decided at the end of the last step)."""
        return self.selector.selected[li]

    def layer_ready(self, li: int) -> None:
        """The layer's local gradient is final: take its statistics, then fold the residual in
        (pushed) or the gradient into the residual (not pushed). No host sync: tensor ops."""
        params = [p for _, p in self.layer_params[li]]
        if any(p.grad.is_sparse for p in params):
            raise ValueError("select= does not support sparse gradients yet; use "
                             "sparse_as_dense=True or no select")
        if self.selector.hypernet is not None:
            # dL/dalpha_l at alpha = 1 for the loss with the layer's weights scaled by alpha
            self._dots[li] = torch.stack([torch.vdot(p.grad.flatten().float(),
                                                     p.detach().flatten().float())
                                          for p in params]).sum()
        push = self.pushes(li)
        for p in params:
            r = self.residual.get(p)
            if push:
                if r is not None:
                    p.grad.add_(r)
                    del self.residual[p]
            elif r is None:
                self.residual[p] = p.grad.detach().clone()
            else:
                r.add_(p.grad)

    def end_step(self) -> None:
        """After the step's pushes finished: withhold gradients of layers not pushed, agree on
        next step's layers (one control-plane allreduce) and record statistics."""
        mask = list(self.selector.selected)
        for li, push in enumerate(mask):
            if not push:
                for _, p in self.layer_params[li]:
                    p.grad = None
        norms = torch.stack([self._residual_norm(li) for li in range(len(mask))]).tolist()
        dots = [float(d) if d is not None else 0.0 for d in self._dots]
        self._dots = [None] * len(mask)
        local = self.selector.local_scores(dots, norms)
        shared = control_allreduce(local, "hvdsync.select.scores", self.process_set, self.stats)
        self.selector.pushed(mask)
        self.selector.choose(shared)
        self.stats.count("residual_norm", sum(n * n for n in norms) ** 0.5)
        self.last = {"local_scores": local, "scores": shared, "residual_norms": norms}
        if self.selector.hypernet is not None:
            self.last["alpha"] = self.selector.prev_alpha.tolist()

    def _residual_norm(self, li: int) -> torch.Tensor:
        rs = [self.residual[p] for _, p in self.layer_params[li] if p in self.residual]
        if not rs:
            return torch.zeros((), device=self.layer_params[li][0][1].device)
        return norm_of(rs)

    def forget(self) -> None:
        self.residual.clear()
        self._dots = [None] * len(self._dots)

    def state_dict(self, names: dict[torch.Tensor, str]) -> dict:
        return {"selector": self.selector.state_dict(),
                "residual": {names[p]: r.clone() for p, r in self.residual.items()}}

    def load_state_dict(self, state: dict, by_name: dict[str, torch.Tensor]) -> None:
        self.selector.load_state_dict(state["selector"])
        self.forget()
        for name, r in state["residual"].items():
            if name not in by_name:
                raise ValueError(f"select state has a residual for unknown parameter {name!r}")
            p = by_name[name]
            self.residual[p] = r.to(device=p.device, dtype=p.dtype).clone()
