"""Horovod's ``hvd.Compression`` for the torch backend without Horovod: the same two
compressors with the same behaviour (``none``; ``fp16``: floating-point tensors travel as
float16 and come back in their own dtype). With Horovod installed, ``hvd.Compression`` is
Horovod's own class."""

from __future__ import annotations

from typing import Any

import torch


class NoneCompressor:
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor:
    """Floating-point tensors travel as float16 (half the bytes)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """``hvd.Compression.none`` and ``hvd.Compression.fp16``, as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor
