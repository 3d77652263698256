"""The torch-only install, as a user without a compiler gets it: the README's command on a fresh
copy of the repository (its own virtualenv, Horovod and TensorFlow absent, not just hidden),
then the demo on ``torchrun`` with every technique and a Keras ``fit`` on Keras' torch backend,
and the Keras example."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tracked_files() -> list[str]:
    """The repository's files as a fresh clone has them (without git: the tree, less what a
    setup or a run leaves behind)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
        if listed.returncode == 0 and listed.stdout:
            return listed.stdout.decode().split("\0")
    except FileNotFoundError:  # no git here
        pass
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", "build"}
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
            and not any(part in skip or part.endswith(".egg-info")
                        for part in p.relative_to(ROOT).parts)]


def test_torch_only_setup_and_demo_from_scratch(tmp_path):
    files = _tracked_files()
    repo = tmp_path / "hvdsync"
    for name in filter(None, files):
        if (ROOT / name).is_file():  # a file deleted in the working tree is not part of it
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    demo = subprocess.run(["bash", "scripts/demo.sh", "--torch-only", "--epochs", "1"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    out = demo.stdout + demo.stderr
    assert demo.returncode == 0, out[-6000:]
    venv_python = str(repo / ".venv" / "bin" / "python")
    absent = subprocess.run(
        [venv_python, "-c", "import importlib.util as u; "
         "print(u.find_spec('horovod'), u.find_spec('tensorflow'))"],
        capture_output=True, text=True, check=True).stdout.split()
    assert absent == ["None", "None"], absent
    assert "2 ranks on torch.distributed" in out, out[-3000:]
    # quiet: the table and what to read next, no warning or log line around them
    noise = [line for line in out.splitlines() if not line.startswith("[setup]")
             and re.search(r"Warning|^W\d{4} |tensorflow|absl", line)]
    assert not noise, noise
    assert "Next: which technique for your model and network" in out, out[-3000:]
    rows = {}
    for method in ("DDP (baseline)", "hvdsync, nothing on", "clip", "threshold", "select",
                   "lowrank", "delay", "local steps", "Keras fit, torch backend"):
        rows[method] = next((ln for ln in out.splitlines() if ln.startswith(method)), "")
        assert rows[method].endswith("%"), (method, out[-3000:])
    # nothing enabled: the same accuracy as DDP (the parity tests check the parameters)
    assert rows["DDP (baseline)"].split()[-2] == rows["hvdsync, nothing on"].split()[-2]
    # and sparse=, the one technique the digits MLP has no use for, on its own example
    sparse = subprocess.run(
        [str(repo / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc-per-node", "2",
         "-m", "examples.torch.train_zipf_embeddings", "--steps", "20"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert sparse.returncode == 0, (sparse.stdout + sparse.stderr)[-6000:]
    assert re.search(r"^hvdsync on torch, 2 ranks; techniques: sparse=", sparse.stdout,
                     re.M), sparse.stdout[-3000:]
    assert re.search(r"^  sparse_gather +20  sparse gradients sent as their rows", sparse.stdout,
                     re.M), sparse.stdout[-3000:]
    # the Keras example, on Keras' torch backend (no TensorFlow in this environment)
    keras_run = subprocess.run(
        [str(repo / ".venv" / "bin" / "torchrun"), "--standalone", "--nproc-per-node", "2",
         "-m", "examples.keras.train_digits", "--epochs", "2", "--threshold", "0.6"],
        cwd=repo, env={**env, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300)
    assert keras_run.returncode == 0, (keras_run.stdout + keras_run.stderr)[-6000:]
    assert re.search(r"^hvdsync on torch, 2 ranks; techniques: threshold=", keras_run.stdout,
                     re.M), keras_run.stdout[-3000:]
    accuracy = re.search(r"^test accuracy (\S+)", keras_run.stdout, re.M)
    assert accuracy and float(accuracy.group(1)) > 0.5, keras_run.stdout[-3000:]
