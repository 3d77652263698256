"""Grouping of parameters into *layers*: the unit on which hvdsync decides and sends.

Every rank must see the same layers in the same order (collectives are matched by name and
later techniques decide per layer), so layers are built only from parameter *names*, in the
order the parameters are given, never from a set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

#: How parameters are grouped into layers. ``None``: by module (the name up to the last dot, so
#: ``fc1.weight`` and ``fc1.bias`` form layer ``fc1``); a callable or mapping from parameter
#: name to layer name; an int ``n``: ``n`` contiguous chunks of the parameter list (Horovod's
#: ``groups=n``); a sequence of sequences of names: each inner sequence is a layer, every other
#: parameter is a layer of its own (Horovod's ``groups=[[...], ...]``).
Grouping = Union[None, int, Callable[[str], str], Mapping[str, str], Sequence[Sequence[str]]]


@dataclass(frozen=True)
class Layer:
    """One layer: a name, its position, and the names of its parameters (in model order)."""

    name: str
    index: int
    param_names: tuple[str, ...]


def groups_by_name(groups: Any, kind: str, name_of: Callable[[Any], Optional[str]],
                   top: tuple[type, ...] = (list, tuple)) -> Grouping:
    """Horovod's ``groups`` -- an int, or (a ``top`` of) lists of the framework's ``kind``
    objects -- as a name-based grouping; ``name_of(x)``: ``x``'s name (``None``: left out),
    raising ``ValueError`` for what is no parameter of the optimizer."""
    if groups is None:
        return None
    if isinstance(groups, int) and not isinstance(groups, bool):
        return groups
    if isinstance(groups, top):
        out = []
        for group in groups:
            if not isinstance(group, (list, tuple)):
                raise ValueError(f"groups should be a positive int or a list of lists of {kind}")
            out.append([n for n in map(name_of, group) if n is not None])
        return out
    raise ValueError(f"groups should be a positive int or a list of lists of {kind}, "
                     f"got {groups!r}")


def module_of(param_name: str) -> str:
    """Default layer of a parameter: its owning module's name (``"fc1.weight"`` -> ``"fc1"``)."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def _chunks(names: Sequence[str], n: int) -> list[list[str]]:
    # Same split as horovod.common.util.split_list: n nearly equal contiguous parts.
    k, m = divmod(len(names), n)
    return [list(names[i * k + min(i, m):(i + 1) * k + min(i + 1, m)]) for i in range(n)]


def build_layers(param_names: Sequence[str], grouping: Grouping = None) -> list[Layer]:
    """Group ``param_names`` (unique, in model order) into layers, see :data:`Grouping`.

    Raises ``ValueError`` naming the problem for duplicate names, unknown names in explicit
    groups, a parameter in two groups, or a non-positive chunk count.
    """
    names = list(param_names)
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise ValueError(f"parameter names must be unique; {n!r} appears twice")
        seen.add(n)

    if isinstance(grouping, bool):
        raise TypeError("layer grouping must not be a bool")
    if isinstance(grouping, int):
        if grouping <= 0:
            raise ValueError(f"groups must be a positive number of groups, got {grouping}")
        parts = [p for p in _chunks(names, min(grouping, max(len(names), 1))) if p]
        return [Layer(f"group{i}", i, tuple(p)) for i, p in enumerate(parts)]

    if grouping is None or callable(grouping) or isinstance(grouping, Mapping):
        if grouping is None:
            key = module_of
        elif isinstance(grouping, Mapping):
            mapping = grouping
            missing = [n for n in names if n not in mapping]
            if missing:
                raise ValueError(f"layers mapping has no entry for parameters {missing[:5]}")
            key = mapping.__getitem__
        else:
            key = grouping
        order: dict[str, list[str]] = {}
        for n in names:
            layer = key(n)
            if not isinstance(layer, str):
                raise TypeError(f"layer name for {n!r} must be a str, got {type(layer).__name__}")
            order.setdefault(layer, []).append(n)
        return [Layer(k, i, tuple(v)) for i, (k, v) in enumerate(order.items())]

    # Explicit groups of names; parameters not named in any group stand alone.
    groups = [list(g) for g in grouping]
    owner: dict[str, int] = {}
    for gi, group in enumerate(groups):
        for n in group:
            if n not in seen:
                raise ValueError(f"groups name a parameter that is not optimized: {n!r}")
            if n in owner:
                raise ValueError(f"a parameter can only appear once in groups: {n!r}")
            owner[n] = gi
    position = {n: i for i, n in enumerate(names)}
    units: list[list[str]] = [sorted(g, key=position.__getitem__) for g in groups if g]
    units += [[n] for n in names if n not in owner]
    units.sort(key=lambda u: position[u[0]])
    return [Layer(u[0] if len(u) == 1 else f"group:{u[0]}", i, tuple(u))
            for i, u in enumerate(units)]
