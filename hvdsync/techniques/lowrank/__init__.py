"""``lowrank=``: low-rank (PowerSGD-style) compression of weight matrices (a transport;
docs/lowrank.md)."""

from hvdsync.techniques.lowrank.config import LowRankConfig
from hvdsync.techniques.lowrank.in_step import LowRank

CONFIG = LowRankConfig


def build(config: LowRankConfig, parts) -> LowRank:
    return LowRank(config, parts.grads, parts.ops, parts.comm, parts.layer_names)


__all__ = ["CONFIG", "LowRank", "LowRankConfig", "build"]
