"""``hvd.SyncBatchNorm``: batch normalization whose statistics are those of the whole global
batch, on either engine (Horovod or torch.distributed), on CPU tensors as on CUDA ones.

Horovod's constructor (``num_features, eps, momentum, affine, track_running_stats``, plus
``process_set``). Horovod's own class and torch's ``nn.SyncBatchNorm`` accept CUDA tensors
only; this one computes the per-channel sums and sums of squares of its input (in float64),
adds them over the ranks in one allreduce, and normalizes with the global mean and variance.
The allreduce's gradient is an allreduce of the gradients, so ``backward`` gives every rank
the gradient of all ranks' losses, as torch's and Horovod's kernels do. In evaluation (or on a
job of one) it is plain batch normalization with the running statistics.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch.nn.modules.batchnorm import _BatchNorm

from hvdsync.torch import engine


class _SumOverRanks(Function):
    """``x`` summed over the ranks of ``ps``; its gradient, the gradients summed alike."""

    @staticmethod
    def forward(ctx, x, ps):
        ctx.ps = ps
        return _sum(x, ps, "hvdsync.sync_batch_norm.stats")

    @staticmethod
    def backward(ctx, grad):
        return _sum(grad, ctx.ps, "hvdsync.sync_batch_norm.grad"), None


def _sum(x: torch.Tensor, ps: Any, name: str) -> torch.Tensor:
    ops = engine.ops()
    return ops.synchronize(ops.allreduce_async(x.detach().contiguous(), name=name, op=ops.Sum,
                                               process_set=ps))


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the global batch (module doc). Input ``(N, C, ...)``."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: Any = None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average, as torch's BatchNorm
                factor = 1.0 / float(self.num_batches_tracked)
        ps = self.process_set or engine.ops().global_process_set
        if (not self.training and self.track_running_stats) or ps.size() == 1:
            use_batch = self.training or not self.track_running_stats
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, use_batch, factor, self.eps)
        return self._synced(input, ps, factor)

    def _synced(self, x: torch.Tensor, ps: Any, factor: float) -> torch.Tensor:
        c = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        wide = x.double()
        local = torch.cat([wide.sum(dims), (wide * wide).sum(dims),
                           torch.full((1,), float(x.numel() // c), dtype=torch.float64)])
        total = _SumOverRanks.apply(local, ps)
        count = total[-1].detach()
        mean = total[:c] / count
        var = (total[c:2 * c] / count - mean * mean).clamp_min(0)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                unbiased = var * (count / (count - 1).clamp_min(1))
                self.running_mean.mul_(1 - factor).add_(factor * mean.to(x.dtype))
                self.running_var.mul_(1 - factor).add_(factor * unbiased.to(x.dtype))
        shape = [1, c] + [1] * (x.dim() - 2)
        scale = torch.rsqrt(var + self.eps).to(x.dtype).view(shape)
        y = (x - mean.to(x.dtype).view(shape)) * scale
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y
