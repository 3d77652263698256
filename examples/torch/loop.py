"""The step-based training loop shared by the examples (not part of hvdsync)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn


def fit_steps(model: nn.Module, opt: torch.optim.Optimizer,
              next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], steps: int,
              x_test: torch.Tensor, y_test: torch.Tensor,
              say: Callable[..., None]) -> tuple[float, float]:
    """Train ``steps`` steps on ``next_batch()``; report held-out accuracy five times.
    Returns the last held-out accuracy and training loss."""
    start = time.perf_counter()
    acc = 0.0
    for step in range(1, steps + 1):
        x, y = next_batch()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step % max(steps // 5, 1) == 0 or step == steps:
            with torch.no_grad():
                acc = (model(x_test).argmax(1) == y_test).float().mean().item()
            say(f"step {step:4d}  loss {loss.item():.4f}  test accuracy {acc:.3f}", flush=True)
    say(f"done in {time.perf_counter() - start:.1f}s")
    return acc, loss.item()
