"""Which engine moves the torch adapter's bytes: Horovod (``horovodrun``) or
``torch.distributed`` (``torchrun``, :mod:`hvdsync.torch.c10d`). Chosen once per process, at
``hvd.init()`` (or at the first call that needs it), by this rule:

1. ``hvd.init(backend="torch" | "horovod")``, else the ``HVDSYNC_BACKEND`` environment variable;
2. else a rank started by horovodrun (``HOROVOD_RANK`` set, not by c10d.launch) uses Horovod;
3. else a rank started by ``torchrun`` (``TORCHELASTIC_RUN_ID``, or ``RANK`` and
   ``WORLD_SIZE``), or any process where Horovod is not installed, uses torch.distributed;
4. else Horovod (a lone process with Horovod installed: a job of one).

Both engines offer the same names (Horovod's torch API); the adapter calls :func:`ops` when it
needs one, never at import (docs/backends.md). A thread may run on an engine of its own
(:func:`on_this_thread`: the simulated ranks of :func:`hvdsync.testing.run_threads`); it never
changes the process's choice.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Optional

ENV = "HVDSYNC_BACKEND"
#: the mark on the HOROVOD_* variables the torch engine's init() set (horovodrun did not):
#: :func:`hvdsync.torch.c10d.launch.export_horovod_environment`
EXPORTED = "HVDSYNC_HOROVOD_ENVIRONMENT"
BACKENDS = {"horovod": "horovod.torch", "torch": "hvdsync.torch.c10d"}

_chosen: dict[str, ModuleType] = {}
_thread = threading.local()  # .engine: (name, module) for this thread only


@contextmanager
def on_this_thread(name: str, module: ModuleType) -> Iterator[None]:
    """Within the block, this thread's collectives run on ``module`` (Horovod's torch API),
    reported as ``name``; other threads and the process's own choice are unaffected."""
    outer = _own()
    _thread.engine = (name, module)
    try:
        yield
    finally:
        _thread.engine = outer


def _own() -> Optional[tuple[str, ModuleType]]:
    """This thread's own engine (:func:`on_this_thread`), if any."""
    return getattr(_thread, "engine", None)


def horovod_installed() -> bool:
    """Whether ``horovod.torch`` imports (Horovod built with PyTorch support)."""
    try:
        importlib.import_module("horovod.torch")
    except ImportError:
        return False
    return True


def default_backend() -> str:
    """The backend this process would use with no explicit choice (see the module doc)."""
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted:
        if wanted not in BACKENDS:
            raise ValueError(f"{ENV} must be one of {sorted(BACKENDS)}, got {wanted!r}")
        return wanted
    if "HOROVOD_RANK" in os.environ and (
            EXPORTED not in os.environ  # (c10d.launch set them)
            or "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ):  # (horovodrun started it after)
        return "horovod"
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ
                                                and "WORLD_SIZE" in os.environ):
        return "torch"
    return "horovod" if horovod_installed() else "torch"


def select(backend: Optional[str] = None) -> ModuleType:
    """Fix this process's backend (``None``: :func:`default_backend`) and return its module.
    Choosing a different one later is an error: tensors already sent went one way."""
    own = _own()
    if own is not None:
        if backend is not None and str(backend).strip().lower() != own[0]:
            raise RuntimeError(f"this thread runs on the {own[0]!r} engine; it cannot use "
                               f"{backend!r}")
        return own[1]
    name = default_backend() if backend is None else str(backend).strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if _chosen and name not in _chosen:
        raise RuntimeError(f"hvdsync already runs on the {active_name()!r} backend in this "
                           f"process; it cannot switch to {name!r}")
    if not _chosen:
        if name == "horovod" and not horovod_installed():
            raise ImportError(
                "backend 'horovod' needs Horovod built with PyTorch support "
                "(scripts/install_horovod.sh, docs/install.md); or use the torch backend: "
                f"launch with torchrun, or set {ENV}=torch")
        _chosen[name] = importlib.import_module(BACKENDS[name])
    return _chosen[name]


def ops() -> ModuleType:
    """The active backend's module (Horovod's torch API, or :mod:`hvdsync.torch.c10d`)."""
    own = _own()
    if own is not None:
        return own[1]
    if _chosen:
        return next(iter(_chosen.values()))
    return select()


def active_name() -> str:
    """``"horovod"`` or ``"torch"``: the backend :func:`ops` gives."""
    own = _own()
    if own is not None:
        return own[0]
    ops()
    return next(iter(_chosen))
