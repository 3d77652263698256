"""Horovod's error semantics on the torch engine: ranks that call a collective differently all
raise the same clear error, within one round trip, instead of pairing wrong tensors or hanging.

Horovod's coordinator matches every rank's request by name and refuses mismatched shapes,
dtypes, reduce ops or root ranks on every rank. c10d pairs collectives by order and checks
nothing: a shape that differs can hang or abort the process. So before each collective a
script starts, :mod:`hvdsync.torch.c10d` gathers a small fixed-size *descriptor* of it from
every rank (this module builds and compares them; docs/backends.md, "Errors"). When they
differ, the ranks exchange a readable form (JSON, never a pickle) and each raises
``HorovodInternalError`` naming, per rank, what it passed.

hvdsync's own collectives (names under ``hvdsync.``) skip the descriptor: the pipeline starts
them in the same order on every rank by construction, and a step or flush entered on some
ranks only is refused by entry tags (:mod:`hvdsync.safety.entries`).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Any, Optional

#: the descriptor's length (int64 values), the same for every kind of collective, so that two
#: ranks that call different collectives still pair their descriptors and see the difference
LENGTH = 9
KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier",
         "join", "entry")  # (the last two: a rank in hvd.join(), hvdsync's entry tags)
ENV = "HVDSYNC_CHECK_COLLECTIVES"
INTERNAL = "hvdsync."


def wanted(name: Optional[str]) -> bool:
    """Whether a collective named ``name`` is checked: every call a script makes, unless
    ``HVDSYNC_CHECK_COLLECTIVES=0``; never hvdsync's own (see the module doc)."""
    if name is not None and name.startswith(INTERNAL):
        return False
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "False")


def readable(kind: str, tensors: list, name: Optional[str], op: Any = None,
             root: Optional[int] = None, scales: tuple = (1.0, 1.0), uneven: bool = False
             ) -> dict[str, Any]:
    """What this rank asked for, as plain data (what the error message shows)."""
    shapes = [list(t.shape[1:]) if uneven else list(t.shape) for t in tensors]
    return dict(collective=kind, name=name, op=op, root_rank=root,
                dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
                shapes=[["*", *s] for s in shapes] if uneven else shapes,
                scale_factors=list(scales))


def descriptor(desc: dict[str, Any]) -> list[int]:
    """``desc`` (:func:`readable`) as :data:`LENGTH` integers: equal exactly when the
    descriptions are (up to crc32 collisions of names, dtypes and shapes)."""
    def crc(value: Any) -> int:
        return zlib.crc32(repr(value).encode())

    def bits(x: float) -> int:
        return struct.unpack("<q", struct.pack("<d", float(x)))[0]
    return [KINDS.index(desc["collective"]), -1 if desc["op"] is None else int(desc["op"]),
            -1 if desc["root_rank"] is None else int(desc["root_rank"]), len(desc["dtypes"]),
            crc(desc["dtypes"]), crc(desc["shapes"]),
            0 if desc["name"] is None else crc(desc["name"]),
            bits(desc["scale_factors"][0]), bits(desc["scale_factors"][1])]


_HINTS = {
    "collective": "every rank must call the same collectives in the same order",
    "name": "every rank must give the same name (or none); on torchrun, start collectives "
            "in the same order on every rank too (c10d pairs them by order, Horovod by name)",
    "op": "every rank must reduce with the same op",
    "root_rank": "every rank must name the same root rank",
    "dtypes": "every rank must pass the same dtypes",
    "shapes": "every rank must pass the same shapes (allgather and alltoall: the same but for "
              "the first dimension, '*')",
    "scale_factors": "every rank must pass the same prescale_factor and postscale_factor",
}
_OP_NAMES = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product"}


def message(descs: list[dict[str, Any]], ranks: list[int]) -> str:
    """The error every rank raises for these per-rank descriptions (``ranks``: their global
    ranks)."""
    lines = []
    for field, hint in _HINTS.items():
        values = [d[field] for d in descs]
        if any(v != values[0] for v in values):
            shown = "; ".join(f"rank {r}: {_show(field, v)}" for r, v in zip(ranks, values))
            lines.append(f"  {field} differ -- {shown} ({hint})")
    kinds = sorted({d["collective"] for d in descs})
    joined = [r for r, d in zip(ranks, descs) if d["collective"] == "join"]
    if joined:
        lines.append(f"  rank(s) {', '.join(map(str, joined))} in hvd.join(): until every "
                     "rank has joined, the others may call allreduce only, alike (Horovod "
                     "answers nothing else)")
    return (f"ranks called {' / '.join('hvd.' + k for k in kinds)} differently; no data was "
            "sent:\n" + "\n".join(lines))


def entry_row(kind: int, step: int, optimizer: int) -> list[int]:
    """hvdsync's entry tag (``kind``, ``step``: hvdsync.safety.entries; ``optimizer``: whose,
    :meth:`~hvdsync.safety.entries.Entries.identity`) as a descriptor, so that a rank in
    ``hvd.join()`` or in a script's own call pairs with it (:mod:`hvdsync.torch.c10d.joining`)."""
    return [KINDS.index("entry"), int(kind), int(step), int(optimizer)] + [0] * (LENGTH - 4)


def in_flight(kind: str, name: str) -> str:
    """The error for a name still in flight on this rank (raised there at once, as Horovod's
    ``ValueError``: nothing is sent)."""
    return (f"hvd.{kind}: the name {name!r} is already in use by a collective still in flight "
            "on this rank; a name may be in flight once (synchronize the first, or leave "
            "name=None). Horovod refuses it alike.")


def _show(field: str, value: Any) -> str:
    if field in ("dtypes", "shapes") and len(value) == 1:  # one tensor: its own
        value = value[0]
    if field == "op":
        return _OP_NAMES.get(value, str(value))
    return repr(value)


def gather_json(obj: Any, process_set: Any) -> list[Any]:
    """Every rank's ``obj`` as JSON (nothing a peer sends runs code here), in rank order: the
    readable descriptions, once descriptors differed."""
    from hvdsync.torch.functions import gather_bytes
    return [json.loads(b) for b in gather_bytes(json.dumps(obj).encode(), f"{INTERNAL}check",
                                                process_set)]
