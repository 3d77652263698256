"""``threshold=``: accumulation thresholds (a decider; docs/threshold.md)."""

from hvdsync.techniques.threshold.config import ThresholdConfig
from hvdsync.techniques.threshold.technique import Threshold, ThresholdPolicy

CONFIG = ThresholdConfig


def build(config: ThresholdConfig, parts) -> Threshold:
    return Threshold(config, parts.grads, parts.ops, parts.comm,
                                 len(parts.layer_names))


__all__ = ["CONFIG", "Threshold", "ThresholdConfig", "ThresholdPolicy", "build"]
