"""Which variables a Keras ``DistributedOptimizer`` reduces, grouped how: Horovod's
``groups`` as the name-based grouping of :mod:`hvdsync.layers`, and the default grouping by
Keras layer."""

from __future__ import annotations

from typing import Any

from hvdsync.layers import Grouping, groups_by_name


def keras_layer_of(path: str) -> str:
    """Default layer of a variable: its Keras layer (``"dense_1/kernel"`` -> ``"dense_1"``)."""
    return path.rsplit("/", 1)[0] if "/" in path else path


def relative_names(names: list[str]) -> list[str]:
    """Layer names without their common first path component when they all have one (the
    model's name, which Keras numbers by creation order: ``sequential_1/fc1`` -> ``fc1``)."""
    heads = {n.split("/", 1)[0] for n in names}
    if len(heads) == 1 and all("/" in n for n in names):
        stripped = [n.split("/", 1)[1] for n in names]
        if len(set(stripped)) == len(stripped):
            return stripped
    return list(names)


def groups_to_names(groups: Any) -> Grouping:
    """Horovod's ``groups`` (int, or lists of Keras variables) as a name-based grouping."""
    return groups_by_name(groups, "variables", _path_of)


def _path_of(v: Any) -> str:
    if not hasattr(v, "path"):
        raise ValueError(f"groups must consist of Keras variables, got {type(v).__name__}")
    return v.path
