"""``stats.summary()`` says what it measured: what ran on how many ranks, bytes against plain
Horovod's, ``delay=``'s local steps and synchronizations, each counter with its meaning, and
the layers in aligned columns."""

from __future__ import annotations

import ast
import pathlib
import re

import hvdsync
from hvdsync.techniques.sparse.protocol import ROUTES
from hvdsync.core.stats import SyncStats, meaning


def _stats(techniques: list[str], ranks: int) -> SyncStats:
    s = SyncStats(["fc1", "encoder.block.0"], backend="horovod")
    s.describe(techniques, lambda: ranks)
    for _ in range(4):
        s.sent("fc1", 1000 if ranks > 1 else 0, 1)
        s.skipped("encoder.block.0")
        s.dense(4096)
        s.count("clipped")
        s.count("staleness_2")
        s.count("averaged", 0.5)
        s.end_step()
    return s


def test_the_summary_names_what_ran_and_what_it_cost():
    text = _stats(["clip", "delay"], ranks=3).summary()
    lines = text.splitlines()
    assert lines[0] == "hvdsync on horovod, 3 ranks; techniques: clip=, delay="
    assert re.search(r"^  steps +4$", text, re.M)
    assert re.search(r"^  bytes sent +3\.9 KiB \(1000 B a step\) = 0\.244 of plain Horovod's "
                     r"16\.0 KiB", text, re.M), text
    assert re.search(r"^  collectives +1\.0 a step$", text, re.M)
    assert re.search(r"^  delay= +4 local steps, 2 parameter averagings$", text, re.M), text
    assert re.search(r"^  staleness_2 +4  delay=: global gradients applied 2 steps late$",
                     text, re.M), text


def test_one_rank_says_nothing_was_exchanged():
    text = _stats([], ranks=1).summary()
    assert text.startswith("hvdsync on horovod, 1 rank; techniques: nothing (plain averaging)")
    assert "nothing exchanged on one rank" in text and "of plain Horovod" not in text
    assert "delay=" not in text.split("counters")[0]  # (no delay= line without delay=)


def test_columns_are_aligned():
    text = _stats(["clip"], ranks=2).summary()
    table = text.split("per layer:\n")[1].splitlines()
    assert len({len(row) for row in table}) == 1, table  # numbers right-aligned, same width
    counters = text.split("counters (this rank, every step):\n")[1].split("per layer:")[0]
    starts = {row.index(m) for row in counters.splitlines() for m in [row.split("  ")[-1]]}
    assert len(starts) == 1, counters  # every meaning starts in one column


def _counted_names() -> set[str]:
    """Every counter name the library passes to ``stats.count`` as a literal."""
    names = set()
    for path in pathlib.Path(hvdsync.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "count" and node.args
                    and ast.unparse(node.func.value).endswith("stats")
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                names.add(node.args[0].value)
    return names


def test_every_counter_has_a_meaning():
    names = _counted_names() | {f"sparse_{route}" for route in ROUTES} | {"staleness_3"}
    assert {"clipped", "nonfinite_steps", "sparse_duplicate_rows", "averaged"} <= names
    assert not [n for n in names if not meaning(n)], [n for n in names if not meaning(n)]
