"""``sparse=`` (torch): sparse grouped allgather, on 2 and 3 real ranks with different ids.

Every exchange is checked against the dense-computed reduction (each rank's gradient made
dense and allreduced by Horovod), and the route taken (gather with equal or unequal counts,
dense switch, nothing to send) is read from the optimizer's stats.
"""

from __future__ import annotations

import math

import pytest
import torch

from hvdsync import SparseConfig
from hvdsync.techniques.sparse.protocol import choose_route, gradient_layouts
from hvdsync.testing import run_ranks
from tests.models import LOGIC_IDS, LOGIC_JOBS, assert_construction_fails, job_group, logic_runs

# (rows, dim, kind) per table; kind "emb" is nn.Embedding, "bag" nn.EmbeddingBag(mode="sum").
ONE_TABLE = [(64, 4, "emb")]


def scenario_ids(scenario: str, rank: int, size: int) -> list:
    """Ids looked up per table on ``rank`` (``None``: the table is not used on this rank)."""
    if scenario == "equal":  # 6 distinct rows everywhere (overlapping), duplicates in the batch
        return [torch.tensor([3 * rank + i for i in (0, 1, 2, 3, 4, 5, 5, 0)])]
    if scenario == "unequal":  # 3, 5, 7 distinct rows
        return [torch.tensor([2 * rank + i for i in range(3 + 2 * rank)] + [2 * rank])]
    if scenario == "zero_rows":  # rank 0 looks nothing up: a gradient with no rows
        return [torch.tensor([], dtype=torch.long) if rank == 0 else torch.tensor([rank, 9, 9])]
    if scenario == "unused":  # rank 0 never touches the table: no gradient at all
        return [None if rank == 0 else torch.tensor([rank, 9, 9])]
    if scenario == "overlap":  # identical rows everywhere
        return [torch.tensor([1, 2, 3, 3, 5])]
    if scenario == "disjoint":
        return [torch.tensor([20 * rank + i for i in range(4)])]
    if scenario == "few":  # one row per rank
        return [torch.tensor([rank, rank])]
    if scenario == "nothing":  # no rank has a row
        return [torch.tensor([], dtype=torch.long)]
    if scenario == "dense":  # 15 of 20 rows per rank: gathering would exceed the dense size
        return [torch.tensor([(rank + i) % 20 for i in range(15)])]
    if scenario == "several":  # three tables: unequal, equal (bag), one unused on rank 1
        return [torch.tensor([rank, rank + 1, 7] * (rank + 1)),
                torch.tensor([2 * rank, 2 * rank + 1, 2 * rank + 1, 40]),
                None if rank == 1 else torch.tensor([0, 11, 12, 11])]
    raise KeyError(scenario)


def exchange_cases(cases: dict) -> dict:
    """On each rank, per case: two steps with hvdsync's sparse exchange (the second takes the
    one-round path, routed by the first step's counts), each compared with the dense-computed
    reduction. Returns per step the max differences, coalescedness and the step's stats."""
    import torch
    from torch import nn

    import hvdsync.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for case, cfg in cases.items():
        torch.manual_seed(0)
        specs = cfg.get("tables", ONE_TABLE)
        tables = nn.ModuleList(nn.Embedding(n, d, sparse=True) if kind == "emb"
                               else nn.EmbeddingBag(n, d, mode="sum", sparse=True)
                               for n, d, kind in specs)
        model = nn.ModuleDict({"tables": tables, "head": nn.Linear(4, 1)})
        named = dict(model.named_parameters())
        # This rank's own gradients, seen by hooks registered before the wrapper's (whose
        # allreduces start in backward and write in place).
        local: dict = {}
        for n, p in named.items():
            p.register_post_accumulate_grad_hook(
                lambda p, n=n: local.__setitem__(n, p.grad.to_dense().clone()))
        op = getattr(hvd, cfg.get("op", "Average"))
        sparse = cfg.get("sparse", True)
        if "one_round" in cfg:
            sparse = dict(dense_ratio=1.0 if sparse is True else sparse,
                          one_round=cfg["one_round"])
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            sparse=sparse, op=op, clip=cfg.get("clip"),
            compression=getattr(hvd.Compression, cfg.get("compression", "none")))
        g = torch.Generator().manual_seed(100 + rank)
        steps = []
        for scenario in (cfg["scenario"], cfg.get("then", cfg["scenario"])):
            opt.zero_grad()
            local.clear()
            loss = model["head"](torch.ones(1, 4)).sum()
            for table, ids in zip(tables, scenario_ids(scenario, rank, size)):
                if ids is None:
                    continue
                emb = (table(ids) if isinstance(table, nn.Embedding)
                       else table(ids, torch.tensor([0])))
                loss = loss + (emb * torch.randn(emb.shape, generator=g)).sum()
            loss.backward()
            for n, p in named.items():
                local.setdefault(n, torch.zeros_like(p))  # unused here
            opt.synchronize()
            diffs, coalesced = {}, {}
            for n, p in named.items():
                ref = hvd.allreduce(local[n], name=f"ref.{case}.{len(steps)}.{n}", op=op)
                diffs[n] = float((p.grad.to_dense() - ref).abs().max())
                if n.startswith("tables"):
                    coalesced[n] = bool(p.grad.is_sparse and p.grad.is_coalesced())
            with opt.skip_synchronize():
                opt.step()
            steps.append(dict(diffs=diffs, coalesced=coalesced, stats=opt.stats.last.as_dict()))
        out[case] = steps
    return out


def sparse_dim2_cases() -> dict:
    """Gradients with two sparse dimensions (set by hand), through both routes."""
    import torch

    import hvdsync.torch as hvd

    hvd.init()
    rank = hvd.rank()
    out = {}
    for ratio in (math.inf, 0.0):
        p = torch.nn.Parameter(torch.zeros(6, 5, 3))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1),
                                       named_parameters=[("w", p)], sparse=ratio)
        idx = torch.tensor([[0, rank, 5, 0], [1, 2, 4, 1]])
        vals = torch.arange(12.0).reshape(4, 3) + rank
        p.grad = torch.sparse_coo_tensor(idx, vals, p.shape)
        local = p.grad.to_dense().clone()
        opt.synchronize()
        ref = hvd.allreduce(local, name=f"ref2.{ratio}")
        out[str(ratio)] = dict(diff=float((p.grad.to_dense() - ref).abs().max()),
                               counters=opt.stats.last.counters)
    return out


def mismatched_layout() -> str:
    """A parameter with a sparse gradient on rank 0 and a dense one elsewhere: every rank must
    raise the same error (not hang)."""
    import torch

    import hvdsync.torch as hvd

    hvd.init()
    p = torch.nn.Parameter(torch.zeros(8, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("w", p)],
                                   sparse=True)
    p.grad = (torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), p.shape)
              if hvd.rank() == 0 else torch.ones(8, 2))
    try:
        opt.synchronize()
    except RuntimeError as e:
        return str(e)
    return "no error"


CASES = {
    "equal": dict(scenario="equal"),
    "equal_clipped": dict(scenario="equal", clip=1e9),  # through the clipper, nothing clipped
    "unequal": dict(scenario="unequal"),
    "zero_rows": dict(scenario="zero_rows"),
    "unused": dict(scenario="unused"),
    "overlap": dict(scenario="overlap"),
    "disjoint": dict(scenario="disjoint"),
    "nothing": dict(scenario="nothing"),
    "dense_switch": dict(scenario="dense", tables=[(20, 4, "emb")]),
    "dense_ratio_inf": dict(scenario="dense", tables=[(20, 4, "emb")], sparse=math.inf),
    "always_dense": dict(scenario="unequal", sparse=0),
    "unused_dense": dict(scenario="unused", sparse=0),
    "sum": dict(scenario="unequal", op="Sum"),
    "sum_dense": dict(scenario="dense", tables=[(20, 4, "emb")], op="Sum"),
    "fp16": dict(scenario="unequal", compression="fp16"),
    "several": dict(scenario="several", tables=[(64, 4, "emb"), (48, 3, "bag"), (16, 2, "emb")]),
    # The second step's route is predicted from the first's counts, here wrongly: still exact.
    "sparse_then_dense": dict(scenario="few", then="dense", tables=[(20, 4, "emb")]),
    "dense_then_sparse": dict(scenario="dense", then="few", tables=[(20, 4, "emb")]),
    "nothing_then_rows": dict(scenario="nothing", then="unequal"),
    # Counts first, in a collective of their own, every step.
    "counts_first": dict(scenario="unequal", one_round=False),
    "counts_first_dense": dict(scenario="dense", tables=[(20, 4, "emb")], one_round=False),
    "counts_first_unused": dict(scenario="unused", one_round=False),
}
# (case -> expected route counter); the step's counters name the route each table took.
ROUTES = {"equal": "sparse_gather", "equal_clipped": "sparse_gather",
          "unequal": "sparse_gather", "zero_rows": "sparse_gather",
          "unused": "sparse_gather", "overlap": "sparse_gather", "disjoint": "sparse_gather",
          "nothing": "sparse_none", "dense_switch": "sparse_dense",
          "dense_ratio_inf": "sparse_gather", "always_dense": "sparse_dense",
          "unused_dense": "sparse_dense", "sum": "sparse_gather", "sum_dense": "sparse_dense",
          "fp16": "sparse_gather", "counts_first": "sparse_gather",
          "counts_first_dense": "sparse_dense", "counts_first_unused": "sparse_gather"}
ROUTE_COUNTERS = ("sparse_gather", "sparse_dense", "sparse_none")


@pytest.fixture(scope="module", params=LOGIC_JOBS, ids=LOGIC_IDS)
def exchanges(request):
    return request.param[0], logic_runs(request, exchange_cases, {"all": (CASES,)},
                                        timeout=240)["all"]


@pytest.mark.parametrize("case", list(CASES))
def test_equals_dense_computed_reduction(exchanges, case):
    _, results = exchanges
    tol = 1e-3 if CASES[case].get("compression") == "fp16" else 1e-6
    for rank, res in enumerate(results):
        for step, r in enumerate(res[case]):
            assert max(r["diffs"].values()) <= tol, (rank, step, r["diffs"])
            assert all(r["coalesced"].values()), (rank, step, r["coalesced"])


@pytest.mark.parametrize("case", list(ROUTES))
def test_route_taken(exchanges, case):
    """Step 1 routes by its own counts; step 2 (same ids) by step 1's, so alike (a route
    "none" is predicted as a gather of zero rows)."""
    _, results = exchanges
    for res in results:
        for step in res[case]:
            counters = step["stats"]
            expected = ROUTES[case]
            if step is res[case][1] and expected == "sparse_none":
                expected = "sparse_gather"
            assert counters.get(expected) == 1, counters
            assert sum(v for k, v in counters.items() if k in ROUTE_COUNTERS) == 1


def test_mispredicted_routes_use_the_previous_steps_counts(exchanges):
    _, results = exchanges
    for res in results:
        assert res["sparse_then_dense"][1]["stats"].get("sparse_gather") == 1
        assert res["dense_then_sparse"][1]["stats"].get("sparse_dense") == 1
        assert res["nothing_then_rows"][1]["stats"].get("sparse_gather") == 1


def test_one_round_per_step(exchanges):
    """From step 2 the counts ride in the gather: one grouped allgather + the head layer.
    Counts first costs a collective more every step."""
    np_, results = exchanges
    for res in results:
        assert [s["stats"]["collectives"] for s in res["unequal"]] == [3, 2]
        assert [s["stats"]["collectives"] for s in res["counts_first"]] == [3, 3]
        assert [s["stats"]["collectives"] for s in res["several"]] == [3, 2]


def test_equal_counts_take_the_fixed_shape_gather(exchanges):
    _, results = exchanges
    for res in results:
        for step in (0, 1):  # counts first (step 1), counts riding in the gather (step 2)
            assert res["equal"][step]["stats"].get("sparse_gather_equal") == 1
            assert res["overlap"][step]["stats"].get("sparse_gather_equal") == 1
            assert "sparse_gather_equal" not in res["unequal"][step]["stats"]


def test_several_tables_share_one_counts_and_one_gather_collective(exchanges):
    np_, results = exchanges
    for rank, res in enumerate(results):
        s = res["several"][0]["stats"]
        assert s["sparse_gather"] == 3
        # counts collective + one grouped allgather for the 3 tables + the dense head layer
        assert s["collectives"] == 3, s


def test_duplicate_rows_summed_before_sending(exchanges):
    """Rows a rank looks up repeatedly travel once: fewer bytes than Horovod would send."""
    np_, results = exchanges
    head_bytes = (4 + 1) * 4
    for s in (res[case][1]["stats"] for res in results for case in ("equal", "equal_clipped")):
        assert s["sparse_duplicate_rows"] == 2  # 8 lookups of 6 distinct rows
        # 6 rows of (4 values + 2 int64 index columns as float32) + head vs Horovod's
        # 8 rows of 4 values and 8 int64 indices + head.
        assert s["bytes_sent"] - 8 * 2 * 3 == 6 * (4 + 2) * 4 + head_bytes  # minus the codes
        assert s["bytes_dense"] == 8 * 4 * 4 + 8 * 8 + head_bytes


def test_nothing_to_send_sends_no_rows(exchanges):
    np_, results = exchanges
    for res in results:
        s = res["nothing"][0]["stats"]
        assert s["collectives"] == 2  # counts + head; no gather


def test_two_sparse_dimensions_both_routes(request, torch_job):
    for res in torch_job(request.module, 3)["dim2"]:
        assert res["inf"]["diff"] <= 1e-6 and res["inf"]["counters"].get("sparse_gather") == 1
        assert res["0.0"]["diff"] <= 1e-6 and res["0.0"]["counters"].get("sparse_dense") == 1


def test_mismatched_layouts_fail_on_every_rank_without_hanging():
    for msg in run_ranks(mismatched_layout, np=2, timeout=120):
        assert "sparse on rank(s) [0] but dense on others" in msg


# -- the decision rules, without ranks ------------------------------------------------------
def test_choose_route_crossover():
    # 4 ranks, 1000 rows x 64 float32: dense 256000 B; a gathered row costs (64 + 2) * 4 B.
    dense, row = 1000 * 64 * 4, (64 + 2) * 4
    assert choose_route([0, 0, 0, 0], row, dense, 1.0).route == "none"
    assert choose_route([240] * 4, row, dense, 1.0).route == "gather"  # 24 % each: < 1/N
    assert choose_route([250] * 4, row, dense, 1.0).route == "dense"  # 25 % each: > dense
    assert choose_route([250] * 4, row, dense, math.inf).route == "gather"
    assert choose_route([1, 0, 0, 0], row, dense, 0.0).route == "dense"
    r = choose_route([3, 0, 5], row, dense, 1.0)
    assert (r.route, r.counts, r.equal_counts, r.gathered_bytes) == ("gather", (3, 0, 5), False,
                                                                     8 * row)


def test_gradient_layouts():
    assert gradient_layouts([[3, -1, -2], [0, -1, -2]], ["a", "b", "c"]) == \
        ["sparse", "dense", "absent"]
    assert gradient_layouts([[-2], [4]], ["a"]) == ["sparse"]
    with pytest.raises(RuntimeError, match="sparse on rank"):
        gradient_layouts([[2], [-1]], ["a"])


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(sparse=True, sparse_as_dense=True), ValueError, "pass one of them"),
    (dict(sparse=True, op="Min"), ValueError, "op=Average or op=Sum"),
    (dict(sparse=-1), ValueError, "dense_ratio must be >= 0"),
    (dict(sparse=float("nan")), ValueError, "dense_ratio must be >= 0"),
    (dict(sparse="dense"), TypeError, "sparse must be a SparseConfig"),
    (dict(sparse=dict(ratio=2)), TypeError,
     r"unknown key\(s\) 'ratio' \(did you mean 'dense_ratio'\?\)"),
    (dict(sparse=dict(dense_ratio="1")), TypeError, "dense_ratio must be a number"),
    (dict(sprase=True), TypeError, "did you mean 'sparse'"),
])
def test_bad_config_fails_at_construction(kwargs, exc, pattern):
    if kwargs.get("op") == "Min":
        import hvdsync.torch as hvd
        kwargs = dict(kwargs, op=hvd.Min)
    assert_construction_fails(exc, pattern, **kwargs)


def test_config_coercion():
    assert SparseConfig.coerce(False) is None and SparseConfig.coerce(None) is None
    assert SparseConfig.coerce(True) == SparseConfig()
    assert SparseConfig.coerce(2) == SparseConfig(dense_ratio=2.0)
    assert SparseConfig.coerce({"dense_ratio": math.inf}).dense_ratio == math.inf


# -- training: same parameters as Horovod's sparse path, and it learns ------------------------
def train_against_horovod(steps: int) -> dict:
    """Train the Zipf-embedding example with Horovod's sparse path and hvdsync's two routes
    (each forced: which one is cheaper is tested above).
    In float64: float32 summation-order differences (Horovod sums duplicate rows in another
    order) are amplified by momentum SGD to ~1e-1 over 150 steps, hiding real bugs."""
    from examples.torch.train_zipf_embeddings import train
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        runs = {"horovod": train(steps, horovod=True, verbose=False),
                "gather": train(steps, sparse=math.inf, verbose=False),
                "dense": train(steps, sparse=0, verbose=False)}
    finally:  # the shared job's next cases run in this process
        torch.set_default_dtype(before)
    ref = runs["horovod"]["params"]
    return {name: dict(accuracy=r["accuracy"], stats=r["stats"],
                       diff=max(float((p - ref[n]).abs().max()) for n, p in r["params"].items()))
            for name, r in runs.items()}


# 3 ranks: the parity is the point (a 3-rank step costs 2x a 2-rank one on 2 cores); it learns
# at 40 steps too, less far
TRAIN = {2: (150, 0.4), 3: (40, 0.33)}  # rank count: steps, accuracy


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared torch job (tests/conftest.py)."""
    cases = {"train": (train_against_horovod, TRAIN[np_][0])} if np_ in TRAIN else {}
    if np_ == 2:
        cases.update(job_group("logic", exchange_cases, {"all": (CASES,)}))
    if np_ == 3:
        cases["dim2"] = (sparse_dim2_cases,)
    return cases


@pytest.mark.parametrize("np_", list(TRAIN))
def test_training_matches_horovod_and_learns(request, torch_job, np_):
    steps, accuracy = TRAIN[np_]
    for rank, res in enumerate(torch_job(request.module, np_)["train"]):
        # Same updates as Horovod's sparse path, up to float64 summation order.
        assert res["gather"]["diff"] <= 1e-9, (rank, res["gather"]["diff"])
        assert res["dense"]["diff"] <= 1e-9, (rank, res["dense"]["diff"])
        # Learnable: 4 balanced classes, so chance is 25 %.
        assert res["gather"]["accuracy"] >= accuracy, res["gather"]["accuracy"]
        total = res["gather"]["stats"]["total"]
        assert total["sparse_gather"] == steps and total["sparse_duplicate_rows"] > 0
        # Each rank touches ~30 % of the table with many repeats: far fewer bytes than
        # Horovod's path, which sends every lookup.
        assert total["bytes_sent"] < 0.45 * total["bytes_dense"], total
        assert res["dense"]["stats"]["total"]["sparse_dense"] == steps


def test_sparse_with_no_row_sparse_gradient_warns_once_at_the_first_step():
    """The wrapper never sees the model, so the first full step is where it can tell that
    ``sparse=`` changes nothing (no embedding with ``sparse=True``); a model with one is
    not warned about."""
    import warnings

    import hvdsync.torch as hvd
    hvd.init()
    said = {}
    for case in ("dense", "embedding"):
        torch.manual_seed(0)
        if case == "dense":
            model, x = torch.nn.Linear(4, 2), torch.ones(3, 4)
        else:
            model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True),
                                        torch.nn.Flatten(), torch.nn.Linear(8, 2))
            x = torch.tensor([[1, 2], [3, 4], [1, 5]])
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), sparse=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
        said[case] = [str(w.message) for w in caught if "sparse= is on" in str(w.message)]
    assert len(said["dense"]) == 1 and "nn.Embedding" in said["dense"][0], said
    assert said["embedding"] == [], said
