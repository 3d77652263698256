"""``delay=``: local steps with a stale global gradient, and the K-step synchronization of the
models (plain averaging or the outer synchronization; a transport; docs/delay.md)."""

from hvdsync.techniques.delay.config import DelayConfig
from hvdsync.techniques.delay.technique import DelayedGradients

CONFIG = DelayConfig


def build(config: DelayConfig, parts) -> DelayedGradients:
    return DelayedGradients(config, parts.grads, parts.ops, parts.comm, parts.layer_names,
                            parts.stats, traces=parts.traces)


__all__ = ["CONFIG", "DelayConfig", "DelayedGradients", "build"]
