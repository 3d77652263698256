"""Which parameters a torch ``DistributedOptimizer`` reduces, by which names, grouped how:
Horovod's ``named_parameters`` and ``groups`` checked as Horovod checks them, as the
name-based grouping of :mod:`hvdsync.core.layers`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, Optional

import torch

from hvdsync.core.layers import Grouping, groups_by_name


def parameter_names(params: list[torch.Tensor],
                     named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]]
                     ) -> dict[torch.Tensor, str]:
    """Name of every optimized parameter, validating ``named_parameters`` like Horovod."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
    if isinstance(named_parameters, (str, bytes, dict)) or not isinstance(named_parameters, Iterable):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually produced by model.named_parameters()")
    pairs = list(named_parameters)
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError("named_parameters should be a sequence of (name, parameter) "
                             "tuples, usually produced by model.named_parameters(); got an "
                             f"item of type {type(item).__name__}")
    dups = sorted(n for n, c in Counter(n for n, _ in pairs).items() if c > 1)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(dups)}")
    names = {p: n for n, p in pairs}
    unnamed = [f"param_groups position {i} (shape {tuple(p.shape)})"
               for i, p in enumerate(params) if p not in names]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         f"were not named: {'; '.join(unnamed[:5])}")
    return {p: names[p] for p in params}


def groups_to_names(groups: Any, names: dict[torch.Tensor, str]) -> Grouping:
    """Horovod's ``groups`` (int, or lists of tensors) as a name-based grouping."""
    def name_of(p: Any) -> Optional[str]:
        if not isinstance(p, torch.Tensor):
            raise ValueError("groups must consist of torch.Tensor")
        if p not in names:
            raise ValueError("groups contains a tensor that the optimizer does not optimize "
                             f"(shape {tuple(p.shape)})")
        return names[p] if p.requires_grad else None
    return groups_by_name(groups, "torch.Tensor", name_of, top=(list,))
