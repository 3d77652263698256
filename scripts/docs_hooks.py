"""MkDocs hooks for hvdsync's site (mkdocs.yml; built by scripts/docs.sh).

The pages stay readable on GitHub as they are: README.md becomes the home page and
benchmarks/results/ the lab notes (results/ on the site), and every relative link between them
is rewritten to where the page lands. A link to anything else in the repository is a warning,
which the strict build turns into a failure. Before the build, every public name of
``hvdsync.torch`` and ``hvdsync.keras`` that hvdsync defines must have a docstring and be
rendered by an ``::: name`` block of docs/api/, and Horovod's names dispatched to the active
engine must be listed on docs/api/torch.md.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.plugins.hvdsync")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
FENCE = re.compile(r"^(```|~~~)")
#: the adapters' submodules that are part of their API (Horovod has them too); the others are
#: internal, on docs/internals.md
PUBLIC_MODULES = {"hvdsync.torch": ("compression", "elastic", "functions", "sync_batch_norm"),
                  "hvdsync.keras": ("callbacks", "elastic")}


def on_files(files, config):
    """README.md is the home page; benchmarks/results/ is published under results/."""
    files.append(File.generated(config, "index.md", abs_src_path=str(ROOT / "README.md")))
    for path in sorted((ROOT / RESULTS).iterdir()):
        if path.suffix in (".md", ".png", ".json"):
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    return files


def repo_path(site_uri: str) -> str:
    """Where a page of the site lives in the repository."""
    if site_uri == "index.md":
        return "README.md"
    if site_uri.startswith("results/"):
        return f"{RESULTS}/{site_uri[len('results/'):]}"
    return f"docs/{site_uri}"


def site_path(repo: str) -> str | None:
    """Where a file of the repository lands on the site; None: not published."""
    if repo == "README.md":
        return "index.md"
    if repo.startswith("docs/"):
        return repo[len("docs/"):]
    if repo.startswith(RESULTS + "/"):
        return "results/" + repo[len(RESULTS) + 1:]
    return None


def relink(target: str, page_uri: str) -> str:
    """A link as the page's repository file has it, as the page's site location needs it."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return target
    path, _, anchor = target.partition("#")
    here = posixpath.dirname(repo_path(page_uri))
    repo = posixpath.normpath(posixpath.join(here, path))
    dest = site_path(repo)
    if dest is None:
        log.warning("%s links to %s, which is not on the site", repo_path(page_uri), repo)
        return target
    new = posixpath.relpath(dest, posixpath.dirname(page_uri) or ".")
    return new + (f"#{anchor}" if anchor else "")


def results_index() -> str:
    """A table of every Markdown file of benchmarks/results/ with its title."""
    rows = ["| file | title |", "| --- | --- |"]
    for path in sorted((ROOT / RESULTS).glob("*.md")):
        title = next((line.lstrip("# ").strip() for line in path.read_text().splitlines()
                      if line.startswith("#")), path.stem)
        rows.append(f"| [{path.name}](results/{path.name}) | {title.replace('|', '/')} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):
    """Rewrite the page's relative links (outside code blocks) for the site; fill in the lab
    notes' index of result files (whose links are the site's own already)."""
    blocks, fenced = [[]], False  # alternately prose and code blocks (a link may wrap lines)
    for line in markdown.split("\n"):
        if FENCE.match(line.lstrip()) and not fenced:
            blocks.append([])
        blocks[-1].append(line)
        if FENCE.match(line.lstrip()) and fenced:
            blocks.append([])
        fenced = fenced != bool(FENCE.match(line.lstrip()))
    markdown = "\n".join(
        "\n".join(b) if i % 2 else LINK.sub(
            lambda m: m[1] + relink(m[2], page.file.src_uri) + m[3], "\n".join(b))
        for i, b in enumerate(blocks))
    if page.file.src_uri == "lab-notes.md":
        markdown = re.sub(r"<!-- results-index:.*?-->", results_index(), markdown)
    return markdown


def on_pre_build(config):
    """Every public name hvdsync defines in its adapters is documented and rendered."""
    api = "\n".join(p.read_text() for p in sorted((ROOT / "docs/api").glob("*.md")))
    rendered = {id(resolve(name)) for name in re.findall(r"^::: ([\w.]+)", api, re.M)}
    for module_name in ("hvdsync.torch", "hvdsync.keras"):
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            log.warning("cannot import %s to check its API reference: %s", module_name, e)
            continue
        for name in sorted(dir(module)):
            if not name.startswith("_"):
                check_name(module, name, getattr(module, name), rendered, api)


def resolve(dotted: str):
    """The object an ``::: a.b.c`` block renders (its longest importable module, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def check_name(module, name: str, obj, rendered: set, api: str) -> None:
    """Warn where a public name of ``module`` has no docstring or no place on the API pages."""
    where = getattr(obj, "__name__", "") if inspect.ismodule(obj) else getattr(
        obj, "__module__", "") or ""
    if not where.startswith("hvdsync") or not (inspect.isclass(obj) or callable(obj)
                                              or inspect.ismodule(obj)):
        return  # Horovod's own name, or a constant
    if inspect.ismodule(obj) and name not in PUBLIC_MODULES[module.__name__]:
        return  # an internal module, bound by its import
    full = f"{module.__name__}.{name}"
    home = inspect.getmodule(obj)
    if name in getattr(module, "_DISPATCHED", ()):
        if f"`{name}`" not in api:
            log.warning("%s (Horovod's, on the active engine) is not listed on docs/api", full)
        return
    if not inspect.getdoc(obj):
        log.warning("%s has no docstring", full)
    if not {id(obj), id(home)} & rendered:
        log.warning("%s is not rendered on docs/api (add '::: %s')", full, full)
    if inspect.isclass(obj):
        for attr, member in vars(obj).items():
            if (not attr.startswith("_") and inspect.isfunction(member)
                    and not inspect.getdoc(member)):
                log.warning("%s.%s has no docstring", full, attr)


def on_page_content(html, page, config, files):
    """Docstrings use Sphinx roles (:class:`X`); on the site they read as plain code."""
    return re.sub(r":(?:mod|class|func|meth|attr|data|exc|obj):(?=<code>)", "", html)
