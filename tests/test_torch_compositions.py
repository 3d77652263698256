"""Techniques composed through the one lifecycle (torch), on 2 and 3 real ranks with different
data per rank: ``sparse=`` with a decider (row-sparse layers take the sparse exchange every
step, dense layers the decider), and ``delay=`` with ``clip=`` and fp16; plus the checkpoint
format every technique shares."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.models import LOGIC_IDS, LOGIC_JOBS, job_group, logic_runs

STEPS = 12


class BagModel(nn.Module):
    """A sparse EmbeddingBag and two dense layers: layers ``emb``, ``fc``, ``head``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(60, 6, mode="sum", sparse=True)
        self.fc = nn.Linear(6, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.emb(ids, offsets))))


def bag_batches(rank: int, steps: int, bags: int = 8, length: int = 5) -> list:
    """Zipf-ish ids per rank, labelled by whether a planted id set appears (learnable)."""
    g = torch.Generator().manual_seed(500 + rank)
    p = 1.0 / torch.arange(1, 61, dtype=torch.float64)
    out = []
    for _ in range(steps):
        ids = torch.multinomial(p / p.sum(), bags * length, replacement=True, generator=g)
        y = torch.isin(ids.view(bags, length), torch.tensor([2, 5, 9])).any(1).long()
        out.append((ids, torch.arange(0, bags * length, length), y))
    return out


def bag_body(options: dict, steps: int) -> dict:
    """Train the bag model with ``options``; per step the layers that were sent (a layer is
    sent when its stats count grew) and the parameters after the step."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    model = BagModel()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                                   named_parameters=model.named_parameters(), **options)
    names = [layer.name for layer in opt.layers]
    before = {n: 0 for n in names}
    sent, params = [], []
    for ids, offsets, y in bag_batches(hvd.rank(), steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids, offsets), y).backward()
        opt.step()
        now = {n: opt.stats.layers[n].sent for n in names}
        sent.append([n for n in names if now[n] > before[n]])
        before = now
        params.append({n: p.detach().numpy().copy() for n, p in model.named_parameters()})
    return dict(sent=sent, params=params, stats=opt.stats.as_dict(),
                routes=opt.sparse_routes, selection=opt.selection)


def delay_clip_body(options: dict, steps: int) -> dict:
    """An MLP with delay + clip (+ fp16): per step the ids folded in and the parameters."""
    import hvdsync.torch as hvd
    from tests.models import MLP, teacher_batches
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP()
    opts = dict(options)
    if opts.pop("fp16", False):
        opts["compression"] = hvd.Compression.fp16
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), **opts)
    folded, params = [], []
    for x, y in teacher_batches(hvd.rank(), steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        folded.append(opt.delay_status.get("last_folded"))
        params.append({n: p.detach().numpy().copy() for n, p in model.named_parameters()})
    return dict(folded=folded, params=params, stats=opt.stats.as_dict())


def cases_body(kind: str, options: dict, steps: int) -> dict:
    return (bag_body if kind == "bag" else delay_clip_body)(options, steps)


CASES = {
    "sparse": ("bag", dict(sparse=True), STEPS),
    "sparse_threshold": ("bag", dict(sparse=True, threshold=dict(threshold=0.8, max_skip=3)),
                         STEPS),
    "sparse_threshold_zero": ("bag", dict(sparse=True, threshold=0.0), STEPS),
    "sparse_select": ("bag", dict(sparse=True, select=dict(k=1, selector="norm", max_wait=2)),
                      STEPS),
    "sparse_select_all": ("bag", dict(sparse=True, select=dict(k=1.0)), STEPS),
    "sparse_counts_first_threshold": ("bag", dict(sparse=dict(one_round=False),
                                                  threshold=dict(threshold=0.8, max_skip=3)),
                                      STEPS),
    "clip_fp16": ("mlp", dict(clip=dict(max_norm=0.1), fp16=True), STEPS),
    "delay_clip_fp16": ("mlp", dict(delay=dict(staleness=2, average_every=4),
                                    clip=dict(max_norm=0.1), fp16=True), STEPS),
    "delay_sync_clip_fp16": ("mlp", dict(delay=dict(staleness=0), clip=dict(max_norm=0.1),
                                         fp16=True), STEPS),
}


@pytest.fixture(scope="module", params=LOGIC_JOBS, ids=LOGIC_IDS)
def runs(request):
    return request.param[0], logic_runs(request, cases_body, CASES)


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared torch job (tests/conftest.py)."""
    return job_group("logic", cases_body, CASES) if np_ == 2 else {}


def _equal_across_ranks(ranks: list, step: int, prefix: str = "") -> bool:
    first = ranks[0]["params"][step]
    return all(np.array_equal(r["params"][step][n], v) for r in ranks[1:]
               for n, v in first.items() if n.startswith(prefix))


@pytest.mark.parametrize("case", ["sparse_threshold", "sparse_counts_first_threshold"])
def test_sparse_with_threshold(runs, case):
    _, r = runs
    ranks = r[case]
    for other in ranks[1:]:
        assert other["sent"] == ranks[0]["sent"], "ranks decided differently"
    sent = ranks[0]["sent"]
    assert all("emb" in s for s in sent), "the sparse layer must go every step"
    dense_sends = [n for s in sent for n in s if n != "emb"]
    assert 0 < len(dense_sends) < 2 * STEPS, "expected dense layers both sent and skipped"
    for t, s in enumerate(sent):
        for name in s:  # a layer that synced is identical on every rank
            assert _equal_across_ranks(ranks, t, name + "."), (case, t, name)
    total = ranks[0]["stats"]["total"]
    assert total.get("sparse_gather", 0) + total.get("sparse_dense", 0) == STEPS
    assert total["layers_skipped"] > 0


def test_sparse_with_threshold_zero_equals_sparse_alone(runs):
    _, r = runs
    for a, b in zip(r["sparse"], r["sparse_threshold_zero"]):
        for n, v in a["params"][-1].items():
            np.testing.assert_allclose(b["params"][-1][n], v, rtol=0, atol=1e-6, err_msg=n)
        assert b["stats"]["total"]["layers_skipped"] == 0


def test_sparse_with_select(runs):
    _, r = runs
    ranks = r["sparse_select"]
    for other in ranks[1:]:
        assert other["sent"] == ranks[0]["sent"]
    sent = ranks[0]["sent"]
    assert all("emb" in s for s in sent)
    assert sorted(sent[0]) == ["emb", "fc", "head"]  # step 1 pushes everything
    for s in sent[1:]:  # k=1 of the two dense layers; a layer waits at most 2 steps
        assert 1 <= len([n for n in s if n != "emb"]) <= 2
    for name in ("fc", "head"):
        waited = 0
        for s in sent:
            waited = 0 if name in s else waited + 1
            assert waited <= 2, name
    assert ranks[0]["selection"]["next"]
    for t in range(STEPS):  # every update is global: replicas identical at every step
        assert _equal_across_ranks(ranks, t), t
    for a, b in zip(r["sparse"], r["sparse_select_all"]):  # k = every layer: sparse alone
        for n, v in a["params"][-1].items():
            np.testing.assert_allclose(b["params"][-1][n], v, rtol=0, atol=1e-6, err_msg=n)


def test_sparse_routes_reported(runs):
    np_, r = runs
    for rank in r["sparse"]:
        (route, counts, rows), = rank["routes"].values()
        assert route in ("gather", "dense") and len(counts) == np_
        assert max(counts) <= rows <= sum(counts)


def test_delay_with_clip_and_fp16(runs):
    np_, r = runs
    ranks = r["delay_clip_fp16"]
    for rank in ranks:
        used = [j for ids in rank["folded"] for j in ids]
        assert sorted(used) == list(range(1, STEPS + 1))
        for t, ids in enumerate(rank["folded"], start=1):
            assert all(0 <= t - j <= 2 for j in ids)
        total = rank["stats"]["total"]
        assert total["clipped"] > 0
        # gradients travel in fp16; the parameter averaging (3 times) in full precision
        per_step = total["bytes_dense"] // STEPS
        assert total["averaged"] == 3
        assert total["bytes_sent"] == total["bytes_dense"] // 2 + 3 * per_step
    for t in (4, 8, 12):  # averaging steps: identical replicas
        assert _equal_across_ranks(ranks, t - 1), t
    # staleness 0 is synchronous: clip + fp16 without delay, up to fp16 summation order
    tol = 1e-6 if np_ == 2 else 5e-4
    for a, b in zip(r["clip_fp16"], r["delay_sync_clip_fp16"]):
        for n, v in a["params"][-1].items():
            np.testing.assert_allclose(b["params"][-1][n], v, rtol=0, atol=tol, err_msg=n)
