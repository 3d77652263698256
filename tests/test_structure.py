"""The house rules, checked on hvdsync/'s source (issues 68 and 80): no function over 80 lines,
no file over 500, module docstrings of at most 15 lines (the long form lives in docs/), no
import circle among hvdsync's modules, the layering of the tree (the core imports no
technique, a technique no adapter, nothing of the product the tools or the test support),
and no technique named or its config read in the adapters (hvdsync/torch, hvdsync/keras):
they run techniques through the interfaces only.
``KNOWN`` lists what is still to mend; an entry that no longer breaks its rule fails the test
too, so the list only shrinks."""

from __future__ import annotations

import ast
import pathlib

import pytest

import hvdsync
from hvdsync.core.rules import TECHNIQUES

ROOT = pathlib.Path(hvdsync.__file__).parent
MODULES = sorted(ROOT.rglob("*.py"))
MAX_FUNCTION_LINES, MAX_FILE_LINES, MAX_DOCSTRING_LINES = 80, 500, 15

#: still to mend: a rule's exceptions, each to be taken off once mended (empty: none)
KNOWN = {
    "function": set(),
    "file": set(),
    "docstring": set(),
    "technique": set(),
}


def _name(path: pathlib.Path) -> str:
    """The path inside hvdsync/ (elsewhere: the file's name)."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def long_functions(path: pathlib.Path, limit: int = MAX_FUNCTION_LINES) -> set[str]:
    """``file:function`` for each function (or method) of more than ``limit`` lines."""
    tree = ast.parse(path.read_text())
    return {f"{_name(path)}:{node.name}" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The hvdsync modules ``path`` imports, anywhere in it (a function-level import counts:
    it is a circle too, only a later one). A package a module lives in is not counted:
    Python runs its ``__init__`` first anyway."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
            out |= subs
            if base in known and len(subs) < len(node.names):
                out.add(base)
    return {m for m in out if m != name and not name.startswith(m + ".")}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def technique_reads(path: pathlib.Path) -> list[str]:
    """Where an adapter module names a technique (a string that is a technique's keyword) or
    reads a technique's ``config``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in TECHNIQUES:
            out.append(f"{_name(path)}:{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr == "config":
            out.append(f"{_name(path)}:{node.lineno}: {ast.unparse(node)}")
    return out


def _check(rule: str, broken: set[str]) -> None:
    known = KNOWN[rule]
    assert broken <= known, f"breaks the {rule} rule: {sorted(broken - known)}"
    assert known <= broken, f"mended, take it off KNOWN[{rule!r}]: {sorted(known - broken)}"


def test_no_function_over_80_lines():
    _check("function", set().union(*(long_functions(p) for p in MODULES)))


def test_no_file_over_500_lines():
    _check("file", {_name(p) for p in MODULES
                    if len(p.read_text().splitlines()) > MAX_FILE_LINES})


def docstring_lines(path: pathlib.Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    return doc.count("\n") + 1 if doc else 0


def test_module_docstrings_are_short():
    _check("docstring", {_name(p) for p in MODULES
                         if docstring_lines(p) > MAX_DOCSTRING_LINES})


def test_no_import_circle():
    known = {module_name(p) for p in MODULES}
    graph = {module_name(p): imports_of(p, known) for p in MODULES}
    assert sum(len(v) for v in graph.values()) > len(MODULES)  # it sees the imports
    assert circles(graph) == []


def test_the_adapters_name_no_technique():
    adapters = [p for p in MODULES if _name(p).split("/")[0] in ("torch", "keras")]
    reads = [r for p in adapters for r in technique_reads(p)]
    _check("technique", {r.split(":")[0] for r in reads})


def test_the_checks_see_what_they_look_for(tmp_path):
    """Not vacuous: a circle and a technique read are each reported."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    bad = tmp_path / "probe.py"
    bad.write_text("def f(by_name):\n    return by_name.get('clip').config.mode\n")
    assert sorted(technique_reads(bad)) == ["probe.py:2: 'clip'",
                                            "probe.py:2: by_name.get('clip').config"]


@pytest.mark.parametrize("lines, over", [(80, False), (81, True)])
def test_the_function_check_counts_lines(tmp_path, lines, over):
    path = tmp_path / "probe.py"
    path.write_text("def f():\n" + "    x = 1\n" * (lines - 1))
    assert long_functions(path) == ({"probe.py:f"} if over else set())


#: the tree's layers, lowest first: what each may import of hvdsync (docs/internals.md)
LAYERS = {
    "core": ("core", "safety"),
    "safety": ("core", "safety"),
    "techniques": ("core", "safety", "techniques"),
    "torch": ("core", "safety", "techniques", "torch"),
    "keras": ("core", "safety", "techniques", "torch", "keras"),
    "tools": ("core", "tools"),
    "testing": ("core", "safety", "torch", "testing"),
}
#: imports between two techniques' packages, each with its reason (empty: none)
BETWEEN_TECHNIQUES = {
    ("delay", "outer"): "delay='s K-step synchronization runs the outer synchronization",
}
#: what the framework-neutral layers must never import
FRAMEWORKS = ("torch", "tensorflow", "keras", "horovod")


def _layer(module: str) -> str:
    """The layer a module of hvdsync belongs to (``""``: the package's own ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _technique(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "techniques" else ""


def layering_breaks(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import the layers do not allow."""
    out = []
    for importer, imported in sorted(graph.items()):
        layer = _layer(importer)
        if not layer:
            continue
        for other in sorted(imported):
            theirs = _layer(other)
            if theirs and theirs not in LAYERS[layer]:
                out.append(f"{importer} -> {other}")
            mine, its = _technique(importer), _technique(other)
            if mine and its and mine != its and (mine, its) not in BETWEEN_TECHNIQUES:
                out.append(f"{importer} -> {other} (another technique)")
    return out


def framework_imports(path: pathlib.Path) -> list[str]:
    """The frameworks a module imports at its top level or in a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        found += [n for n in names if n.split(".")[0] in FRAMEWORKS]
    return found


def test_the_tree_is_layered():
    """The core imports no technique and no adapter; a technique no adapter and no other
    technique (but the pairs of BETWEEN_TECHNIQUES); nothing imports the tools but the tools,
    nor the test support but itself."""
    known = {module_name(p) for p in MODULES}
    graph = {module_name(p): imports_of(p, known) for p in MODULES}
    assert set(LAYERS) == {_layer(m) for m in known} - {""}, "a folder without a layer"
    assert layering_breaks(graph) == []
    for pair in BETWEEN_TECHNIQUES:
        assert any(_technique(a) == pair[0] and _technique(b) == pair[1]
                   for a, bs in graph.items() for b in bs), f"{pair} is not imported: drop it"


def test_the_neutral_layers_import_no_framework():
    """The core and the techniques import no framework; safety only Horovod (Elastic's reset
    loop is Horovod's)."""
    neutral = [p for p in MODULES if _name(p).split("/")[0] in ("core", "safety", "techniques")]
    found = {_name(p): [n for n in framework_imports(p)
                        if not (_name(p).startswith("safety/") and n.startswith("horovod"))]
             for p in neutral}
    assert neutral and {k: v for k, v in found.items() if v} == {}


def test_the_layering_check_sees_a_break():
    graph = {"hvdsync.core.pipeline": {"hvdsync.techniques.clip.technique"},
             "hvdsync.techniques.clip.technique": {"hvdsync.torch.ops",
                                                   "hvdsync.techniques.select.policy"},
             "hvdsync.torch.optimizer": {"hvdsync.tools.advise"}}
    assert layering_breaks(graph) == [
        "hvdsync.core.pipeline -> hvdsync.techniques.clip.technique",
        "hvdsync.techniques.clip.technique -> hvdsync.techniques.select.policy (another "
        "technique)",
        "hvdsync.techniques.clip.technique -> hvdsync.torch.ops",
        "hvdsync.torch.optimizer -> hvdsync.tools.advise"]
