"""``threshold=``: accumulation thresholds (a decider; docs/threshold.md)."""

from hvdsync.techniques.threshold.config import ThresholdConfig
from hvdsync.techniques.threshold.technique import AccumulationThreshold, ThresholdPolicy

CONFIG = ThresholdConfig


def build(config: ThresholdConfig, parts) -> AccumulationThreshold:
    return AccumulationThreshold(config, parts.grads, parts.ops, parts.comm,
                                 len(parts.layer_names))


__all__ = ["CONFIG", "AccumulationThreshold", "ThresholdConfig", "ThresholdPolicy", "build"]
