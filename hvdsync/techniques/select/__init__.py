"""``select=``: hypernet-selected layer pushes with residuals (a decider; docs/select.md)."""

from hvdsync.techniques.select.config import SelectConfig
from hvdsync.techniques.select.policy import SelectPolicy
from hvdsync.techniques.select.technique import Select

CONFIG = SelectConfig


def build(config: SelectConfig, parts) -> Select:
    return Select(config, parts.grads, parts.ops, parts.comm, parts.layer_names,
                          parts.stats)


__all__ = ["CONFIG", "SelectConfig", "SelectPolicy", "Select", "build"]
