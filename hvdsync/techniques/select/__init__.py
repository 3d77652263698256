"""``select=``: hypernet-selected layer pushes with residuals (a decider; docs/select.md)."""

from hvdsync.techniques.select.config import SelectConfig
from hvdsync.techniques.select.policy import SelectPolicy
from hvdsync.techniques.select.technique import SelectedPushes

CONFIG = SelectConfig


def build(config: SelectConfig, parts) -> SelectedPushes:
    return SelectedPushes(config, parts.grads, parts.ops, parts.comm, parts.layer_names,
                          parts.stats)


__all__ = ["CONFIG", "SelectConfig", "SelectPolicy", "SelectedPushes", "build"]
