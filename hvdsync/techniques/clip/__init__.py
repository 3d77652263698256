"""``clip=``: per-layer gradient clipping, pipelined with the sends (a transform; docs/clip.md)."""

from hvdsync.techniques.clip.config import ClipConfig
from hvdsync.techniques.clip.technique import ClipPolicy, LayerClip

CONFIG = ClipConfig


def build(config: ClipConfig, parts) -> LayerClip:
    return LayerClip(config, parts.grads, parts.ops, parts.clip_layers, parts.layer_names,
                     parts.stats)


__all__ = ["CONFIG", "ClipConfig", "ClipPolicy", "LayerClip", "build"]
