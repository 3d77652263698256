"""Small models and learnable data shared by the tests (no downloads)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

import pytest
import torch
from torch import nn

from hvdsync.testing import run_ranks, run_threads


class MLP(nn.Module):
    """A 3-layer MLP; ``extra`` is used only when ``use_extra`` is true (unused-parameter tests)
    and ``never`` is never used."""

    def __init__(self, d_in: int = 12, hidden: int = 16, d_out: int = 4, with_unused: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, d_out)
        self.with_unused = with_unused
        if with_unused:
            self.extra = nn.Linear(hidden, hidden)
            self.never = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        if self.with_unused and use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.out(h)


def sparse_embedding(sparse: bool = True) -> nn.Module:
    """``python -m hvdsync.tools.advise --model tests.models:sparse_embedding``: a 200k-row table
    (row-sparse gradients) and a small head."""
    return nn.Sequential(nn.EmbeddingBag(200_000, 64, mode="mean", sparse=sparse),
                         nn.Linear(64, 10))


def dense_embedding() -> nn.Module:
    """The same, built without ``sparse=True``: its gradient is dense."""
    return sparse_embedding(sparse=False)


def teacher_batches(rank: int, steps: int, batch: int = 16, d_in: int = 12, d_out: int = 4,
                    seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-rank batches labelled by a fixed random teacher (learnable, different on each rank)."""
    teacher = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, d_out, generator=teacher)
    g = torch.Generator().manual_seed(seed + 1 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, d_in, generator=g)
        out.append((x, (x @ w).argmax(dim=1)))
    return out


def assert_construction_fails(exc: type, pattern: str, **kwargs) -> None:
    """hvdsync's DistributedOptimizer(SGD(MLP), **kwargs) must raise ``exc`` matching
    ``pattern`` at construction (single rank, in this process)."""
    import hvdsync.torch as hvd
    hvd.init()
    m = MLP()
    with pytest.raises(exc, match=pattern):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                 named_parameters=m.named_parameters(), **kwargs)


#: where a technique's logic matrix runs: real Horovod ranks (2: the integration check, on
#: Horovod's by-name path) and simulated ranks (3, threads of this process: the same
#: assertions where a ring sum is not a sum of two, in a fraction of the time; 3-rank real jobs
#: stay in the flush, parity and reliability tests). 2 simulated ranks would repeat the real
#: job's assertions: the simulation's equality with real ranks at 2 is the flush matrix's and
#: tests/test_simulated.py's to check. docs/testing.md
#: the real rank counts of parity and integration jobs (2, and 3 where a ring sum is not a
#: sum of two), for module-scoped fixtures: ``params=REAL_NP, ids=REAL_NP_IDS``
REAL_NP = [2, 3]
REAL_NP_IDS = [f"np{n}" for n in REAL_NP]

LOGIC_JOBS = [(2, "horovodrun"), (3, "simulated")]
LOGIC_IDS = [f"np{n}-{launcher}" for n, launcher in LOGIC_JOBS]


def float64_mlp(hidden: int, **techniques: Any) -> tuple[nn.Module, Any]:
    """On a rank: a float64 :class:`MLP` (seed 0) and hvdsync's optimizer around SGD with
    momentum for it, with ``techniques`` (``lowrank=...``): the model the traced-form tests
    step twice, eagerly and traced."""
    import hvdsync.torch as hvd
    torch.manual_seed(0)
    model = MLP(hidden=hidden).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), **techniques)
    return model, opt


def eager_or_traced_steps(model: nn.Module, opt: Any, rank: int, steps: int, nan_rank: int,
                          nan_step: int,
                          traced: Callable[[list], None] | None = None) -> torch.Tensor:
    """A float64 ``model`` stepped through the teacher batches (NaN inputs on ``nan_rank`` at
    ``nan_step``): eagerly (``backward``, ``opt.step()``), or by ``traced(grads)`` -- what a
    tracing adapter runs instead, given the step's gradients from ``autograd.grad`` (the hooks
    that start the eager step do not fire). The parameters after every step, stacked."""
    params, weights = list(model.parameters()), []
    for step, (x, y) in enumerate(teacher_batches(rank, steps), start=1):
        x = x.double() * (float("nan") if rank == nan_rank and step == nan_step else 1.0)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if traced is None:
            loss.backward()
            opt.step()
        else:
            traced(list(torch.autograd.grad(loss, params)))
        weights.append(torch.cat([p.detach().flatten() for p in params]))
    return torch.stack(weights)


class DeviceMemory(dict):
    """A traced step's memory as a dict (what Keras keeps in variables,
    hvdsync.keras.memory): ``read`` gives a key's value, or ``empty(key)`` while absent;
    ``present``, ``write``, ``put`` as a tracing adapter offers them, on torch tensors."""

    def __init__(self, empty: Callable[[str], Any]):
        super().__init__()
        self.empty = empty

    def read(self, key: str) -> Any:
        return self[key] if key in self else self.empty(key)

    def present(self, key: str) -> torch.Tensor:
        return torch.tensor(key in self)

    def write(self, key: str, value: Any, when: torch.Tensor) -> None:
        if bool(when):
            self[key] = value

    def put(self, key: str, value: Any, present: torch.Tensor) -> None:
        if bool(present):
            self[key] = value
        else:
            self.pop(key, None)


def apply_each(body: Callable[..., Any], cases: list[tuple]) -> list:
    """On a rank: ``body(*case)`` for every case."""
    return [body(*case) for case in cases]


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """On a rank: ``fn(*args)`` -- :func:`run_cases`' body where cases differ in body."""
    return fn(*args)


def timed_call(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """On a rank: ``(fn(*args), the seconds it took)``."""
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def one_torch_thread() -> None:
    """On a rank: one intra-op thread (ranks share the cores)."""
    torch.set_num_threads(1)


def job_group(group: str, body: Callable[..., Any], cases: dict[str, tuple]
              ) -> dict[str, tuple]:
    """``cases`` (name -> arguments of ``body``) as cases of a shared rank job
    (tests/conftest.py): ``group/name`` -> ``(body, *arguments)``."""
    return {f"{group}/{name}": (body, *args) for name, args in cases.items()}


#: the shared rank job of each launcher's real ranks: its fixture (tests/conftest.py)
SHARED_JOBS = {"horovodrun": "torch_job", "torchrun": "torchrun_job"}


def shared_runs(request: Any, np: int, launcher: str, group: Optional[str] = None
                ) -> dict[str, list]:
    """``request.module``'s cases (of ``group``) in the shared job of ``launcher`` on ``np``
    ranks."""
    return request.getfixturevalue(SHARED_JOBS[launcher])(request.module, np, group)


def logic_runs(request: Any, body: Callable[..., Any], cases: dict[str, tuple],
               timeout: float = 300, group: str = "logic") -> dict[str, list]:
    """A module fixture's runs over :data:`LOGIC_JOBS` (``request.param``): the real ranks'
    from the shared torch job (the file's ``torch_job_cases`` puts ``cases`` in it as
    ``group``), the simulated ones in this process."""
    np_, launcher = request.param
    if launcher == "simulated":
        return run_cases(body, np_, cases, timeout=timeout, launcher=launcher)
    return shared_runs(request, np_, launcher, group)


def run_job(fn: Callable[..., Any], np: int, args: tuple = (), timeout: float = 300,
            env: dict[str, str] | None = None, launcher: str = "horovodrun",
            restarts: int = 0) -> list:
    """``fn(*args)`` on ``np`` ranks: real ones started by ``launcher`` (``horovodrun`` or
    ``torchrun``), or ``"simulated"`` ones (threads of this process,
    :func:`hvdsync.testing.run_threads`, which share its environment: no ``env``)."""
    if launcher == "simulated":
        assert not env, "simulated ranks share this process's environment"
        return run_threads(fn, np, args=args)
    return run_ranks(fn, np=np, args=args, timeout=timeout, env=env, launcher=launcher,
                     restarts=restarts)


def run_cases(body: Callable[..., Any], np: int, cases: dict[str, tuple],
              timeout: float, env: dict[str, str] | None = None,
              launcher: str = "horovodrun") -> dict[str, list]:
    """Run ``body(*case)`` for every case in **one** ``np``-rank job (a launch costs seconds)
    started by ``launcher`` (the backend: ``horovodrun`` or ``torchrun``; ``"simulated"``:
    threads of this process, :func:`hvdsync.testing.run_threads`, for the core's logic); per
    case name, every rank's result."""
    per_rank = run_job(apply_each, np, (body, list(cases.values())), timeout, env, launcher)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(cases)}


def check_pushes(pushed: list[list[str]], names: list[str], k: int, bound) -> None:
    """``select=``'s pushes, step by step: step 1 pushes every layer; afterwards exactly
    ``max(k, forced)`` layers, where the forced ones -- those that would otherwise wait more
    than ``bound`` steps -- are all among them; no layer waits more than ``bound`` steps."""
    assert sorted(pushed[0]) == sorted(names), pushed[0]
    waited = {n: 0 for n in names}
    for t, sent in enumerate(pushed[1:], start=2):
        forced = {n for n in names if bound is not None and waited[n] + 1 > bound}
        assert forced <= set(sent), (t, forced, sent)
        assert len(sent) == max(k, len(forced)), (t, k, forced, sent)
        waited = {n: 0 if n in sent else w + 1 for n, w in waited.items()}
        assert bound is None or max(waited.values()) <= bound, (t, waited)
