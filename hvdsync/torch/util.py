"""Small tensor helpers shared by the torch techniques."""

from __future__ import annotations

import torch


def norm_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``tensors`` together, as a float32 0-d tensor on their device."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)).float())
