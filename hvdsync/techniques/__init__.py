"""The techniques, one package each (the rulebook, :mod:`hvdsync.core.rules`, lists them in
the order they run): each holds its config, its policy (decisions on numbers every rank
shares), the technique's moments and its traced form, over the core's interfaces only.
:class:`TechniqueKeywords` is what both adapters' ``DistributedOptimizer`` take beside
Horovod's arguments."""

from __future__ import annotations

from typing import TypedDict

from hvdsync.core.layers import Grouping
from hvdsync.techniques.clip import ClipConfig
from hvdsync.techniques.delay import DelayConfig
from hvdsync.techniques.lowrank import LowRankConfig
from hvdsync.techniques.select import SelectConfig
from hvdsync.techniques.sparse import SparseConfig
from hvdsync.techniques.threshold import ThresholdConfig


class TechniqueKeywords(TypedDict, total=False):
    """What both adapters' ``DistributedOptimizer`` take beside Horovod's arguments.

    ``layers``: hvdsync's grouping of parameters into layers, sent and decided on together
    (by module or Keras layer, or a callable / mapping: :data:`hvdsync.core.layers.Grouping`).
    ``clip``, ``threshold``, ``select``, ``sparse``, ``lowrank``, ``delay``: the techniques
    (docs/<name>.md), each a config object (``hvd.ClipConfig`` ...), a dict of its fields or
    a number (its main field); which combine: the rulebook (:mod:`hvdsync.core.rules`).
    """

    layers: Grouping
    clip: ClipConfig | dict | float | None
    threshold: ThresholdConfig | dict | float | None
    select: SelectConfig | dict | float | None
    sparse: SparseConfig | dict | bool | float | None
    lowrank: LowRankConfig | dict | int | None
    delay: DelayConfig | dict | bool | int | str | None


__all__ = ["ClipConfig", "DelayConfig", "LowRankConfig", "SelectConfig", "SparseConfig",
           "TechniqueKeywords", "ThresholdConfig"]
