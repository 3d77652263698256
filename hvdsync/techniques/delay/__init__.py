"""``delay=``: local steps with a stale global gradient (the transport,
:mod:`hvdsync.techniques.delay.technique`), and the K-step synchronization of the models after
the update, plain averaging or the outer optimizer (:mod:`hvdsync.techniques.outer`): two
techniques of one keyword (docs/delay.md)."""

from __future__ import annotations

import dataclasses

from hvdsync.core.technique import Parts, Technique
from hvdsync.techniques.delay.config import DelayConfig
from hvdsync.techniques.delay.technique import Delay
from hvdsync.techniques.outer.averaging import Averaging
from hvdsync.techniques.outer.technique import OuterSync

CONFIG = DelayConfig


def build(config: DelayConfig, parts: Parts) -> list[Technique]:
    """The transport, then the synchronization after the update: the outer optimizer where
    the config has one; else plain averaging, unless synchronous (every step uses its own
    global gradient: the replicas never differ)."""
    config = config.resolved()
    n = len(parts.layer_names)
    if config.fragments > n:  # a fragment is one layer at least
        config = dataclasses.replace(config, fragments=n)
    delay = Delay(config, parts.grads, parts.ops, parts.comm, parts.layer_names,
                             parts.stats)
    if not config.outer and config.synchronous:
        return [delay]
    sync = OuterSync if config.outer else Averaging
    return [delay, sync(config, parts.grads, parts.ops, parts.comm, parts.layer_names,
                        parts.stats, delay.finished_steps)]


def carry(delay: Delay, other: Technique) -> Technique:
    """Run ``other``'s exchange (``lowrank=``) inside delay's: the rulebook's
    :data:`hvdsync.core.rules.CARRIED`. Returns its carried form."""
    return delay.carry(other)


__all__ = ["CONFIG", "DelayConfig", "Delay", "build", "carry"]
