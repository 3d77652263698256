"""What the launcher tells a process of the torch engine, and what the engine tells the
processes after it: torchrun's restarts (a store per attempt), other launchers refused, and
horovodrun's ``HOROVOD_*`` variables set from torchrun's (docs/backends.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hvdsync.torch.engine import EXPORTED
#: what ``horovodrun`` tells each rank in its environment: variable -> the job's fact
HOROVOD_ENVIRONMENT = {"HOROVOD_RANK": "rank", "HOROVOD_SIZE": "size",
                       "HOROVOD_LOCAL_RANK": "local_rank", "HOROVOD_LOCAL_SIZE": "local_size",
                       "HOROVOD_CROSS_RANK": "cross_rank", "HOROVOD_CROSS_SIZE": "cross_size"}
#: how other launchers tell a process it is one of several
_OTHER_LAUNCHERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")


def export_horovod_environment(facts: Mapping[str, int]) -> None:
    """Set the variables ``horovodrun`` gives its ranks (a script or library may read them
    after ``init()``) from this job's ``facts`` (``rank``, ``size``...). Processes this one
    starts inherit them, and the mark that hvdsync set them, so that such a process does not
    take ``HOROVOD_RANK`` for a sign of horovodrun
    (:func:`hvdsync.torch.engine.default_backend`)."""
    for var, fact in HOROVOD_ENVIRONMENT.items():
        os.environ[var] = str(facts[fact])
    os.environ[EXPORTED] = "torch"


def refuse_other_launchers() -> None:
    """A process that mpirun or srun started as one of several is not a job of one: each
    would train alone, silently. Say how to start the job instead."""
    for var in _OTHER_LAUNCHERS:
        if os.environ.get(var, "1") not in ("", "0", "1"):
            raise RuntimeError(
                f"this process is one of {os.environ[var]} ({var}), but the torch engine joins "
                "the ranks torchrun starts (RANK, WORLD_SIZE): launch with torchrun "
                "--nproc-per-node N, or with horovodrun where Horovod is installed "
                "(docs/backends.md)")


def attempt_store(timeout: timedelta) -> dict[str, Any]:
    """After ``torchrun --max-restarts`` started the workers again: a store whose keys are
    this attempt's. torchrun's agent keeps one store across attempts, so a restarted worker
    could read a previous attempt's address of a peer before the peer wrote its new one and
    fail to connect (seen here with Gloo: "Connection refused" at init; docs/elastic.md).
    Nothing to change on a first attempt."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dict(store=dist.PrefixStore(f"hvdsync/attempt{attempt}", store),
                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
