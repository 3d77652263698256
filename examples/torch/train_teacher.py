"""Data-parallel training of a deep MLP on planted-teacher data with hvdsync.

    horovodrun -np 2 -H localhost:2 --gloo python examples/torch/train_teacher.py
    horovodrun -np 2 -H localhost:2 --gloo python examples/torch/train_teacher.py --select 0.25

The data is synthetic but learnable: inputs are Gaussian, labels come from a fixed random
"teacher" network (planted, so the task has an exact answer); each rank draws its own
stream of examples. The student is a ``--depth``-layer MLP (12 by default), deep enough for
per-layer techniques (which layers to send) to matter. Rank 0 prints held-out accuracy and
the communication stats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

import hvdsync.torch as hvd

if __package__ in (None, ""):  # run as a script: make the examples package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.torch.loop import fit_steps  # noqa: E402

INPUTS, CLASSES = 32, 8


class Teacher:
    """A fixed random 2-layer network labelling Gaussian inputs."""

    def __init__(self, seed: int = 4321):
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.randn(INPUTS, 64, generator=g) / INPUTS ** 0.5
        self.w2 = torch.randn(64, CLASSES, generator=g) / 8.0

    def batch(self, g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, INPUTS, generator=g)
        return x, (torch.tanh(x @ self.w1) @ self.w2).argmax(1)


def student(depth: int = 12, width: int = 64) -> nn.Sequential:
    mods: list[nn.Module] = [nn.Linear(INPUTS, width), nn.ReLU()]
    for _ in range(depth - 2):
        mods += [nn.Linear(width, width), nn.ReLU()]
    mods.append(nn.Linear(width, CLASSES))
    return nn.Sequential(*mods)


def train(steps: int = 600, batch_size: int = 64, lr: float = 3e-3, seed: int = 0,
          depth: int = 12, select: Optional[dict] = None, threshold: Optional[dict] = None,
          clip: Optional[dict] = None, verbose: bool = True) -> dict[str, Any]:
    """Train on this rank's stream; return held-out accuracy, loss and the stats."""
    hvd.init()
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    say = print if verbose and hvd.rank() == 0 else (lambda *a, **k: None)
    teacher = Teacher()
    x_test, y_test = teacher.batch(torch.Generator().manual_seed(10**6 + seed), 4000)
    g = torch.Generator().manual_seed(seed * 1000 + hvd.rank())

    model = student(depth)
    # Adam: plain SGD does not get a 12-layer ReLU MLP with PyTorch's default init going.
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   select=select, threshold=threshold, clip=clip)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    acc, loss = fit_steps(model, opt, lambda: teacher.batch(g, batch_size), steps, x_test,
                          y_test, say)
    say(opt.stats.summary())
    return dict(accuracy=acc, loss=loss, stats=opt.stats.as_dict())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--select", type=float, default=None,
                    help="push only this many layers per step (or a fraction < 1)")
    ap.add_argument("--selector", default="hypernet", choices=["hypernet", "norm", "random"])
    args = ap.parse_args()
    k = args.select if args.select is None or args.select < 1 else int(args.select)
    select = None if k is None else dict(k=k, selector=args.selector)
    train(args.steps, args.batch_size, args.lr, args.seed, args.depth, select)


if __name__ == "__main__":
    main()
