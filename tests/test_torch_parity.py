"""With no technique enabled, hvdsync.torch.DistributedOptimizer must give the same
parameters as horovod.torch.DistributedOptimizer (real ranks, different data per rank) -- on
Horovod, and on torch.distributed (torchrun), where it must also equal DDP's."""

from __future__ import annotations

import numpy as np
import pytest

from tests.models import shared_runs

STEPS = 20
# fp16 sums are not associative: with 3+ ranks the ring's summation order for an element
# depends on where it sits in Horovod's fusion buffer, so any two groupings (Horovod's own
# at two fusion thresholds included) differ by fp16 rounding, which Adam then amplifies.
FP16_TOL = 5e-4

CASES = {
    "sgd_momentum": dict(opt="sgd"),
    "adam": dict(opt="adam"),
    "sgd_momentum_bpps2": dict(opt="sgd", backward_passes_per_step=2),
    "adam_bpps2": dict(opt="adam", backward_passes_per_step=2),
    "sgd_sum": dict(opt="sgd", op="Sum"),
    "sgd_predivide": dict(opt="sgd", gradient_predivide_factor=2.0),
    "adam_fp16": dict(opt="adam", compression="fp16"),
    "sgd_groups2": dict(opt="sgd", groups=2),
    "adam_unused_params": dict(opt="adam", unused=True),
}


def _make_kwargs(cfg: dict, hvd) -> dict:
    kwargs = dict(backward_passes_per_step=cfg.get("backward_passes_per_step", 1))
    if "op" in cfg:
        kwargs["op"] = getattr(hvd, cfg["op"])
    if "gradient_predivide_factor" in cfg:
        kwargs["gradient_predivide_factor"] = cfg["gradient_predivide_factor"]
    if "compression" in cfg:
        kwargs["compression"] = getattr(hvd.Compression, cfg["compression"])
    if "groups" in cfg:
        kwargs["groups"] = cfg["groups"]
    return kwargs


def _base_optimizer(model, cfg: dict):
    import torch
    if cfg["opt"] == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model, opt, cfg: dict, rank: int, no_sync=None) -> None:
    """STEPS steps of ``cfg``'s training on this rank's batches (``no_sync``: DDP's context
    for the passes that only accumulate)."""
    import contextlib

    import torch

    from tests.models import teacher_batches
    bpps = cfg.get("backward_passes_per_step", 1)
    batches = teacher_batches(rank, STEPS * bpps)
    for step in range(STEPS):
        for k in range(bpps):
            x, y = batches[step * bpps + k]
            # Unused-parameter case: `extra` is used on rank 0 only, `never` nowhere.
            use_extra = cfg.get("unused", False) and rank == 0
            quiet = no_sync() if no_sync is not None and k < bpps - 1 else \
                contextlib.nullcontext()
            with quiet:
                loss = torch.nn.functional.cross_entropy(model(x, use_extra), y)
                loss.backward()
        opt.step()
        opt.zero_grad()


# DDP averages gradients like Horovod's default (Average, no compression, no grouping)
DDP_CASES = ("sgd_momentum", "adam", "sgd_momentum_bpps2", "adam_bpps2")


def train_on_torch_backend(cases: dict) -> dict:
    """On each rank of a torchrun job: hvdsync (the torch backend) and, where it applies, DDP
    from the same start; both final parameters."""
    import copy

    import torch
    from torch import nn

    import hvdsync.torch as hvd
    from tests.models import MLP
    hvd.init()
    assert hvd.backend_name() == "torch"
    torch.set_num_threads(1)
    out = {}
    for case, cfg in cases.items():
        torch.manual_seed(0)
        ours = MLP(with_unused=cfg.get("unused", False))
        ref = copy.deepcopy(ours)
        opt = hvd.DistributedOptimizer(_base_optimizer(ours, cfg),
                                       named_parameters=ours.named_parameters(),
                                       **_make_kwargs(cfg, hvd))
        _train(ours, opt, cfg, hvd.rank())
        out[case] = dict(params=[p.detach().numpy().copy() for p in ours.parameters()],
                         backend=opt.stats.as_dict()["backend"])
        if case in DDP_CASES:
            ddp = nn.parallel.DistributedDataParallel(ref)
            _train(ddp, _base_optimizer(ref, cfg), cfg, hvd.rank(), no_sync=ddp.no_sync)
            out[case]["ddp"] = [p.detach().numpy().copy() for p in ref.parameters()]
    return out


def train_both(cases: dict) -> dict:
    """On each rank: train the same model with Horovod's and hvdsync's optimizer; return the
    max parameter difference per case and hvdsync's final parameters (to compare ranks)."""
    import copy

    import horovod.torch as horovod_hvd
    import torch

    import hvdsync.torch as hvd
    from tests.models import MLP

    hvd.init()
    torch.set_num_threads(1)
    out = {}
    for case, cfg in cases.items():
        torch.manual_seed(0)
        ref = MLP(with_unused=cfg.get("unused", False))
        ours = copy.deepcopy(ref)

        def make_opt(model, wrapper):  # Horovod's constants equal hvdsync's
            return wrapper(_base_optimizer(model, cfg), named_parameters=model.named_parameters(),
                           **_make_kwargs(cfg, hvd))

        opts = [(ref, make_opt(ref, horovod_hvd.DistributedOptimizer)),
                (ours, make_opt(ours, hvd.DistributedOptimizer))]
        for model, opt in opts:
            _train(model, opt, cfg, hvd.rank())
        diff = max((a - b).abs().max().item()
                   for a, b in zip(ref.parameters(), ours.parameters()))
        out[case] = dict(diff=diff, horovod=[p.detach().numpy().copy() for p in ref.parameters()],
                         params=[p.detach().numpy().copy() for p in ours.parameters()],
                         bytes_sent=opts[1][1].stats.total.bytes_sent,
                         steps=opts[1][1].stats.total.step)
    return out


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """The Horovod side, in the session's shared torch job (tests/conftest.py)."""
    return {"both": (train_both, CASES)}


def torchrun_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """The torch.distributed side, in the session's shared torchrun job."""
    return {"torch": (train_on_torch_backend, CASES)}


def _runs(request, np_: int, launcher: str) -> list:
    return shared_runs(request, np_, launcher)["both" if launcher == "horovodrun" else "torch"]


@pytest.mark.parametrize("np_", [2, 3])
def test_parity_on_torchrun_with_horovod_and_ddp(request, np_):
    """hvdsync on torch.distributed (nothing enabled) == Horovod's optimizer on Horovod, and
    == DDP in the same torchrun job."""
    on_horovod, on_torch = _runs(request, np_, "horovodrun"), _runs(request, np_, "torchrun")
    for case in CASES:
        tol = FP16_TOL if "fp16" in case and np_ > 2 else 1e-6
        for rank in range(np_):
            mine = on_torch[rank][case]
            assert mine["backend"] == "torch"
            for a, b in zip(mine["params"], on_horovod[rank][case]["horovod"]):
                np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=f"{case} rank {rank}")
            for a, b in zip(mine["params"], mine.get("ddp", mine["params"])):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6,
                                           err_msg=f"{case} vs DDP, rank {rank}")
        assert all(case in DDP_CASES or "ddp" not in on_torch[0][case] for case in CASES)
    assert all("ddp" in on_torch[0][case] for case in DDP_CASES)


@pytest.mark.parametrize("np_", [2, 3])
def test_parity_with_horovod(request, np_):
    results = _runs(request, np_, "horovodrun")
    for case in CASES:
        for rank, res in enumerate(results):
            r = res[case]
            tol = FP16_TOL if "fp16" in case and np_ > 2 else 1e-6
            assert r["diff"] <= tol, f"{case}: rank {rank} differs from Horovod by {r['diff']}"
            assert r["steps"] == STEPS, case
            assert r["bytes_sent"] > 0, case
        # Replicas stay identical across ranks (they saw different data).
        for rank in range(1, np_):
            for a, b in zip(results[0][case]["params"], results[rank][case]["params"]):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=f"{case} rank {rank}")
