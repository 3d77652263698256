"""Argument validation shared by the adapters: bad input fails at construction, naming the
argument, instead of surfacing as a hang or a wrong result many steps later."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable
from typing import Any, Optional, TypeVar

C = TypeVar("C")


def reject_unknown_kwargs(unknown: dict[str, Any], known: Iterable[str], where: str) -> None:
    """Raise ``TypeError`` for keyword arguments ``where`` does not take, with a suggestion."""
    if not unknown:
        return
    known = sorted(known)
    raise TypeError(f"{where}() got unknown keyword argument(s) {_suggested(unknown, known)}; "
                    f"it accepts: {', '.join(known)}")


def _suggested(unknown: Iterable[str], known: list[str]) -> str:
    """``'max_nrm' (did you mean 'max_norm'?)``, for each unknown name."""
    msgs = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        msgs.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(msgs)


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1, else ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def positive_float(name: str, value: Any) -> float:
    """``value`` as a finite float > 0, else an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def non_negative_float(name: str, value: Any) -> float:
    """``value`` as a finite float >= 0, else an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_reduce_op(op: Any, *, average: Any, sum_: Any, adasum: Any, others: Iterable[Any],
                    gradient_predivide_factor: float) -> None:
    """Horovod's reduction ``op``: Average or Sum for gradients (Min/Max/Product pass through).

    Adasum is refused: it needs Horovod's MPI build and its own optimizer class; use
    ``horovod.*.DistributedOptimizer`` for it.
    """
    if op is adasum or (op == adasum and not isinstance(op, bool)):
        raise ValueError("op=Adasum is not supported by hvdsync (it needs Horovod's MPI build and "
                         "its own optimizer); use Horovod's DistributedOptimizer for Adasum")
    valid = [average, sum_, *others]
    if isinstance(op, bool) or op not in valid:
        raise ValueError(f"op must be one of Horovod's reduction ops (Average, Sum, Min, Max, "
                         f"Product), got {op!r}")
    if gradient_predivide_factor != 1.0 and op != average:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")


def coerce_config(cls: type[C], value: Any, arg: str, number_field: str) -> Optional[C]:
    """A technique's config from what a user may pass: ``None``, the config object, a dict of
    its fields, or a bare number meaning ``number_field``."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        fields = sorted(f.name for f in dataclasses.fields(cls) if f.init)  # type: ignore[arg-type]
        unknown = [k for k in value if k not in fields]
        if unknown:
            raise TypeError(f"{arg}= got unknown key(s) {_suggested(unknown, fields)} for "
                            f"{cls.__name__}; it has: {', '.join(fields)}")
        return cls(**value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return cls(**{number_field: value})
    raise TypeError(f"{arg} must be a {cls.__name__}, a dict of its fields, or a number "
                    f"({number_field}); got {type(value).__name__}")
