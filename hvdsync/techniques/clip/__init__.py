"""``clip=``: per-layer gradient clipping, pipelined with the sends (a transform; docs/clip.md)."""

from hvdsync.techniques.clip.config import ClipConfig
from hvdsync.techniques.clip.technique import ClipPolicy, Clip

CONFIG = ClipConfig


def build(config: ClipConfig, parts) -> Clip:
    return Clip(config, parts.grads, parts.ops, parts.layer_names, parts.stats)


__all__ = ["CONFIG", "ClipConfig", "ClipPolicy", "Clip", "build"]
