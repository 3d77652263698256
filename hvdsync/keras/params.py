"""Which variables a Keras ``DistributedOptimizer`` reduces, grouped how: Horovod's
``groups`` as the name-based grouping of :mod:`hvdsync.core.layers`, and the default grouping by
Keras layer."""

from __future__ import annotations

from typing import Any

from hvdsync.core.layers import Grouping, groups_by_name


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


def slots_of(optimizer_variables: list, model_variables: list) -> dict[str, list]:
    """Each model variable's slot variables in the optimizer (momentum, Adam's moments, ...),
    by path, found by the name Keras gives them (``<variable path>_<slot>``)."""
    prefixes = sorted(((v.path.replace("/", "_") + "_", v.path) for v in model_variables),
                      key=lambda x: -len(x[0]))
    of: dict[str, list] = {v.path: [] for v in model_variables}
    shapes = {v.path: tuple(v.shape) for v in model_variables}
    for s in optimizer_variables:
        if s.name.endswith("gradient_accumulator"):
            continue
        for prefix, path in prefixes:  # longest prefix first
            if s.name.startswith(prefix) and tuple(s.shape) == shapes[path]:
                of[path].append(s)
                break
    return of


def mixed_in(optimizer: Any, mixin: type, name: Any) -> Any:
    """An instance of ``mixin`` in front of the optimizer's class, sharing its state
    (variables, hyper-parameters, tracker); saved, it is the optimizer's class."""
    base = type(optimizer)
    cls = type(base.__name__, (mixin, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    if name is not None:
        wrapped.name = name
    return wrapped


def groups_to_names(groups: Any) -> Grouping:
    """Horovod's ``groups`` (int, or lists of Keras variables) as a name-based grouping."""
    return groups_by_name(groups, "variables", _path_of)


def _path_of(v: Any) -> str:
    if not hasattr(v, "path"):
        raise ValueError(f"groups must consist of Keras variables, got {type(v).__name__}")
    return v.path
