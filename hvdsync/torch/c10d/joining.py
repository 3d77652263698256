"""Horovod's ``hvd.join()`` on the torch engine: a rank out of data answers the others'
collectives until every rank has joined, then each learns the rank that joined last.

c10d pairs collectives by order, so the joined rank takes part in exactly what the others
start. A script's collective begins with its check, a descriptor gathered from every rank
(:mod:`hvdsync.torch.c10d.checks`); hvdsync's entry tags are gathered in the same shape. The
joined rank loops on that gather with a descriptor of its own ("join"). An allreduce alike on
the others: it reduces zeros of the call's dtypes and shapes in the same data allreduce
(``Average`` divides by every rank: Horovod's result). A step of hvdsync's optimizer: the
optimizer (``step_with``) takes it with zero gradients, its tag being this round
(hvdsync.torch.joined). Anything else is refused, as Horovod answers only allreduce while a
rank has joined: a script's call on the calling ranks, ``flush()`` or a save on every rank.
The checks must be on (``HVDSYNC_CHECK_COLLECTIVES``): unchecked calls pair with nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from hvdsync.safety import entries
from hvdsync.torch.c10d import checks
from hvdsync.torch.c10d.calls import HorovodInternalError

#: the descriptor kinds of a joined rank and of hvdsync's entry tags
JOIN, ENTRY = checks.KINDS.index("join"), checks.KINDS.index("entry")


def answer_until_all_joined(me: int, gather: Callable[[list[int]], list[list[int]]],
                            exchange: Callable[[dict], list[dict]],
                            reduce_zeros: Callable[[dict], None],
                            step_with: Callable[[int, int], bool]) -> int:
    """A joined rank's loop (``me``: its rank in the set): ``gather(descriptor)`` pairs with
    the others' checks, ``exchange(readable)`` with their readable forms,
    ``reduce_zeros(call)`` takes part in an allreduce ``call`` (its readable form) with zeros,
    and ``step_with(optimizer, step)`` in a step of hvdsync's optimizer (``False``: none
    here can). Returns the rank that joined last, once every rank has joined."""
    first = True
    while True:
        # root_rank: this rank, in its first round only (the round that finds every rank
        # joined names the rank that joined last)
        desc = checks.readable("join", [], None, root=me if first else None)
        first = False
        everyone = gather(checks.descriptor(desc))
        if all(e[0] == JOIN for e in everyone):
            return max(e[2] for e in everyone)
        if any(e[0] == ENTRY for e in everyone):
            steps = {tuple(e[1:4]) for e in everyone if e[0] != JOIN}
            kind, step, optimizer = next(iter(steps))
            if (len(steps) > 1 or any(e[0] != ENTRY for e in everyone if e[0] != JOIN)
                    or kind != entries.CODE["step"] or not step_with(optimizer, step)):
                raise HorovodInternalError(entered_message(everyone))
            continue
        call = answered(exchange(desc))
        if call is not None:
            reduce_zeros(call)


def differ(desc: dict, everyone: list[list[int]], exchange: Callable[[dict], list[dict]],
           ranks: list[int]) -> None:
    """A script's call whose check found the ranks' descriptors differ (``everyone``): raises
    the error every calling rank raises, or returns where the call goes on (an allreduce, alike
    on every rank not in ``hvd.join()``)."""
    if any(e[0] == ENTRY for e in everyone):  # (no readable round: the tag's ranks do not run it)
        raise HorovodInternalError(entered_message(everyone))
    readable = exchange(desc)
    if answered(readable) is None:
        raise HorovodInternalError(checks.message(readable, ranks))


def answered(readable: list[dict]) -> Optional[dict]:
    """The call a joined rank answers with zeros: an allreduce, alike on every rank that has
    not joined, while some have (``None``: not so)."""
    calls = [d for d in readable if d["collective"] != "join"]
    if (calls and len(calls) < len(readable) and calls[0]["collective"] == "allreduce"
            and all(c == calls[0] for c in calls)):
        return calls[0]
    return None


def entry_kinds(everyone: list[list[int]]) -> tuple[list[int], list[int]]:
    """Every rank's row of an entry-tag gather as :mod:`hvdsync.safety.entries` reads it: its
    entry kind and step (a joined rank reads as ``hvd.join()``, a script's own call as one)."""
    kinds = [e[1] if e[0] == ENTRY else 0 if e[0] == JOIN else entries.CODE["script"]
             for e in everyone]
    return kinds, [e[2] if e[0] == ENTRY else 0 for e in everyone]


def entered_message(everyone: list[list[int]]) -> str:
    """The error of a gather that met hvdsync's entry tags on some ranks."""
    return entries.describe(*entry_kinds(everyone))
