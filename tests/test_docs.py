"""The documentation: the site builds strictly (scripts/docs.sh, as a user runs it), its checks
catch what they are for, and the pages keep the sizes a reader can take in (README under 120
lines with short table cells, each guide at most 250 lines)."""

from __future__ import annotations

import importlib.util
import logging
import re
import subprocess
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: pages that are not guides: the generated API reference and the lab notes' index
NOT_GUIDES = ("api/", "lab-notes.md")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built by scripts/docs.sh (which installs MkDocs if needed) into a fresh folder."""
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run(["bash", "scripts/docs.sh", "-d", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def hooks(site) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts/docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_has_every_page_and_the_api_reference(site):
    for page in ("index.html", "getting-started/index.html", "delay/index.html",
                 "api/torch/index.html", "api/keras/index.html", "api/configs/index.html",
                 "lab-notes/index.html", "results/delay_notes/index.html",
                 "results/suite_lm_outer_np2_accuracy.png", "screenshots/home.png"):
        assert (site / page).exists(), page
    api = (site / "api/torch/index.html").read_text()
    assert 'id="hvdsync.torch.DistributedOptimizer"' in api and "named_parameters" in api
    configs = (site / "api/configs/index.html").read_text()
    assert "max_norm" in configs and ":class:" not in configs
    # the lab notes list every result file; a guide's link into benchmarks/results resolves
    notes = (site / "lab-notes/index.html").read_text()
    assert all(p.name in notes for p in (ROOT / "benchmarks/results").glob("*.md"))
    assert 'href="../results/delay_notes/' in (site / "delay/index.html").read_text()


def test_a_link_off_the_site_is_a_warning(hooks, caplog):
    with caplog.at_level(logging.WARNING, logger="mkdocs.plugins.hvdsync"):
        assert hooks.relink("../benchmarks/results/x.md#a", "delay.md") == "results/x.md#a"
        assert hooks.relink("../../docs/clip.md", "results/x.md") == "../clip.md"
        assert hooks.relink("docs/clip.md", "index.md") == "clip.md"
        assert caplog.records == []
        hooks.relink("../hvdsync/core/pipeline.py", "design.md")
    assert "hvdsync/core/pipeline.py, which is not on the site" in caplog.text


def test_a_public_name_without_docstring_or_api_entry_is_a_warning(hooks, caplog):
    module = types.ModuleType("hvdsync.fake")

    def undocumented():
        pass

    undocumented.__module__ = "hvdsync.fake"
    with caplog.at_level(logging.WARNING, logger="mkdocs.plugins.hvdsync"):
        hooks.check_name(module, "undocumented", undocumented, set(), "")
    assert "hvdsync.fake.undocumented has no docstring" in caplog.text
    assert "is not rendered on docs/api" in caplog.text


def guide_pages() -> list[Path]:
    return [p for p in (ROOT / "docs").rglob("*.md")
            if not str(p.relative_to(ROOT / "docs")).startswith(NOT_GUIDES)]


@pytest.mark.parametrize("page", guide_pages(), ids=lambda p: p.name)
def test_a_guide_fits_in_250_lines(page):
    assert len(page.read_text().splitlines()) <= 250, "move the diary to benchmarks/results/"


def test_the_readme_is_short_and_its_table_cells_too():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 120
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    cells = [c for row in rows for c in row.strip("|").split(" | ")]
    assert rows and max(len(re.sub(r"\]\([^)]*\)", "]", c).split()) for c in cells) <= 30


def test_every_figure_file_a_guide_names_is_committed():
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.split())
    named = set()
    for page in guide_pages() + [ROOT / "README.md"]:
        named |= set(re.findall(r"benchmarks/results/[\w.-]+\.(?:md|png|json)", page.read_text()))
    missing = sorted(n for n in named if n not in tracked)
    assert not missing, missing
