"""Another checkout's hvdsync beside this one, in the same processes: its package copied as
``hvdsync_base`` (its imports renamed), so a benchmark can interleave the two versions round by
round on the same ranks -- a change's cost measured against the code before it, the machine's
drift cancelling in the ratio (``bench_overhead --baseline-tree``)."""

from __future__ import annotations

import pathlib
import re
import shutil
import sys
import tempfile

NAME = "hvdsync_base"
#: what names the package in its own source: imports, and the modules it imports by name (the
#: torch engine, the rulebook's technique packages) -- not its collectives' names
_SELF = re.compile(r"(\bfrom hvdsync\b|\bimport hvdsync\b|\"hvdsync\.torch\.c10d\"|"
                   r"\"hvdsync\.techniques\.)")


def install(tree: str) -> str:
    """Copy ``tree``'s ``hvdsync/`` as :data:`NAME` into a temporary folder put first on
    ``sys.path`` (rank processes inherit it); returns that folder."""
    src = pathlib.Path(tree).resolve() / "hvdsync"
    if not (src / "__init__.py").exists():
        raise ValueError(f"{tree} holds no hvdsync package")
    root = pathlib.Path(tempfile.mkdtemp(prefix="hvdsync-base-"))
    shutil.copytree(src, root / NAME, ignore=shutil.ignore_patterns("__pycache__"))
    for path in (root / NAME).rglob("*.py"):
        text = path.read_text()
        path.write_text(_SELF.sub(lambda m: m.group(0).replace("hvdsync", NAME), text))
    sys.path.insert(0, str(root))
    return str(root)
