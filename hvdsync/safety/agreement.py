"""Ranks must agree on what decides the collectives, or fail loudly.

Every rank of a wrapped optimizer must run the same collectives in the same order: the same
layers with the same parameters (shapes, dtypes, order), the same techniques with the same
settings, the same Horovod options. If one rank is configured differently -- ``select=dict(k=1)``
on rank 0 and ``k=2`` on rank 1, a model built in another order -- the job would hang at the
first collective that differs. So at construction (Keras: when the optimizer is built) every
rank shares a :func:`fingerprint` of that, and on any difference every rank raises the same
:class:`RanksDisagree`, naming the field and what each rank has.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, is_dataclass
from typing import Any


class RanksDisagree(ValueError):
    """The ranks of one optimizer were set up differently (raised on every rank alike)."""


def fingerprint(layers: Sequence[tuple[str, Sequence[str]]], techniques: dict[str, Any],
                horovod: dict[str, Any]) -> dict[str, str]:
    """What every rank must have alike, as strings by field: the layers in order (name and
    each parameter's ``"(shape) dtype"``), each technique's config, the Horovod options."""
    out = {"layers": json.dumps([[name, list(params)] for name, params in layers])}
    for name, cfg in techniques.items():
        out[f"{name}="] = json.dumps(asdict(cfg) if is_dataclass(cfg) else cfg, default=str,
                                     sort_keys=True)
    out["horovod options"] = json.dumps(horovod, default=_name, sort_keys=True)
    return out


def check(mine: dict[str, str], gather: Callable[[dict[str, str]], list[dict[str, str]]]
          ) -> None:
    """Share ``mine`` (``gather``: every rank's, in rank order -- a collective) and raise
    :class:`RanksDisagree` on every rank if any rank's differs."""
    everyone = gather(mine)
    fields = sorted({k for fp in everyone for k in fp}, key=lambda k: (k != "layers", k))
    for field in fields:
        values = [fp.get(field, "(not configured)") for fp in everyone]
        if len(set(values)) > 1:
            raise RanksDisagree(
                f"hvdsync: the ranks were set up differently, which would hang the first "
                f"collective that differs -- {field}: "
                + "; ".join(f"rank {r}: {_short(v, values)}" for r, v in enumerate(values))
                + ". Build the model and the DistributedOptimizer identically on every rank.")


def require(comm: Any, layers: Sequence[tuple[str, Sequence[str]]], techniques: dict[str, Any],
            horovod: dict[str, Any]) -> None:
    """:func:`check` this rank's :func:`fingerprint` against every rank's, through ``comm``
    (an adapter's communicator; nothing to do on one rank)."""
    if comm.size > 1:
        check(fingerprint(layers, techniques, horovod),
              lambda fp: comm.gather_json(fp, "hvdsync.agreement"))


def _name(x: Any) -> str:
    return getattr(x, "__name__", None) or str(x)


def _short(value: str, values: Sequence[str], width: int = 160) -> str:
    """``value`` around its first difference from the other ranks' values."""
    if len(value) <= width:
        return value
    first = min((_first_diff(value, v) for v in values if v != value), default=0)
    start = max(first - width // 2, 0)
    return ("..." if start else "") + value[start:start + width] + "..."


def _first_diff(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
