"""Reliability of hvdsync.torch in the setups people run (issue: mixed precision, checkpoints,
bad values, disagreeing ranks, dead ranks), on real ranks with different data per rank."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

from hvdsync.testing import RanksFailed, processes_of, run_ranks
from tests.models import (SHARED_JOBS, MLP, job_group, run_cases, run_job, shared_runs,
                          teacher_batches)


# -- ranks that disagree fail loudly, on every rank -------------------------------------------
def disagreeing_body(kind: str) -> str:
    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    r = hvd.rank()
    model = MLP(hidden=16 if kind != "shapes" or r == 0 else 8)
    options = {"select_k": dict(select=dict(k=1 + r)),
               "threshold": dict(threshold=0.5 + r),
               "staleness": dict(delay=dict(staleness=1 + r)),
               "outer": dict(delay="streaming" if r == 0 else "diloco"),
               "technique": dict(clip=1.0) if r == 0 else {},
               "shapes": {},
               "op": dict(op=hvd.Sum if r == 0 else hvd.Average)}[kind]
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), **options)
    except hvd.RanksDisagree as e:
        return str(e)
    return "no error"


DISAGREEMENTS = {"select_k": "select=", "threshold": "threshold=", "staleness": "delay=",
                 "outer": "delay=", "technique": "clip=", "shapes": "layers",
                 "op": "horovod options"}


# real ranks on both backends (2), and the same logic on simulated ranks (threads of this
# process, 2 and 3); 3 real ranks on Horovod stay in the flush and parity tests
JOBS = [(2, "horovodrun"), (2, "torchrun"), (2, "simulated"), (3, "simulated")]
JOB_IDS = [f"np{n}-{launcher}" for n, launcher in JOBS]


@pytest.mark.parametrize("np_,launcher", JOBS, ids=JOB_IDS)
def test_ranks_that_disagree_all_raise_the_same_error(np_, launcher):
    results = run_cases(disagreeing_body, np_, {k: (k,) for k in DISAGREEMENTS}, timeout=240,
                        launcher=launcher)
    for kind, field in DISAGREEMENTS.items():
        messages = results[kind]
        assert all(m == messages[0] for m in messages), messages  # the same, everywhere
        assert f"-- {field}:" in messages[0] and "rank 1:" in messages[0], messages[0]


def restore_different_points_body() -> str:
    """Two points of one run kept (``clip=`` global with adaptive limits: its policy is
    shared), rank 0 restoring the first and the others the second: the first step after the
    restore raises the same error on every rank, naming which ranks agree."""
    import copy

    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   clip=dict(ema=(0.9, 1.0), warmup=1, mode="global"))
    points = []
    batches = teacher_batches(hvd.rank(), 5)
    for i, (x, y) in enumerate(batches[:4]):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i % 2 == 1:
            points.append(copy.deepcopy((model.state_dict(), opt.state_dict())))
    state = points[min(hvd.rank(), 1)]
    model.load_state_dict(state[0])
    opt.load_state_dict(state[1])
    x, y = batches[4]
    opt.zero_grad()
    try:  # raised in backward: the check runs before the step's first layer uses the state
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        return "no error"
    except hvd.RanksDisagree as e:
        return str(e)


@pytest.mark.parametrize("np_,launcher", JOBS, ids=JOB_IDS)
def test_ranks_restoring_different_points_all_raise(np_, launcher):
    messages = run_job(restore_different_points_body, np_, timeout=240, launcher=launcher)
    assert all(m == messages[0] for m in messages), messages
    others = list(range(1, np_))
    assert "restored different technique state" in messages[0], messages[0]
    assert f"ranks [0] / {others} agree among themselves" in messages[0], messages[0]


# -- a call made on one rank only: bounded, with a message ------------------------------------
def flush_on_one_rank() -> None:
    import hvdsync.torch as hvd
    hvd.init()
    model = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   delay=dict(staleness=2, average_every=8))
    for x, y in teacher_batches(hvd.rank(), 3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    print(f"rank {hvd.rank()} trained", flush=True)
    if hvd.rank() == 0:
        opt.flush()  # a collective, on rank 0 only: nobody joins
    time.sleep(120)  # rank 1 stays alive: only hvdsync's bound can end this


def outer_exchange_on_one_rank() -> None:
    """Local steps, K=4, tau 1: rank 1 stops after 3 steps, rank 0 starts the outer exchange
    after step 4 and waits for it at step 5's merge -- nobody joins."""
    import hvdsync.torch as hvd
    hvd.init()
    model = MLP()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        delay=dict(exchange_gradients=False, average_every=4, overlap=1, compress="int8"))
    for x, y in teacher_batches(hvd.rank(), 6 if hvd.rank() == 0 else 3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    time.sleep(120)  # rank 1 stays alive: only hvdsync's bound can end this


@pytest.mark.parametrize("body,what", [(flush_on_one_rank, "entry tags (before flush()"),
                                       (outer_exchange_on_one_rank, "hvdsync.outer.f0")],
                         ids=["flush", "outer_exchange"])
@pytest.mark.parametrize("launcher", ["horovodrun", "torchrun"])
def test_a_collective_on_one_rank_ends_the_job_with_a_message(body, what, launcher):
    start = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        run_ranks(body, np=2, timeout=100, env={"HVDSYNC_TIMEOUT_SECONDS": "4"},
                  launcher=launcher)
    assert time.monotonic() - start < 60
    msg = str(err.value)
    assert "exited with code" in msg and "timed out" not in msg
    assert "rank 0 waited" in msg and what in msg and "gives up" in msg
    assert processes_of(err.value.workdir) == []


# -- drop-in: a script written for horovod.torch's optimizer -----------------------------------
def horovod_script(which: str) -> dict:
    """The patterns of Horovod's docs and examples: broadcasts, elastic TorchState
    save/restore/sync, synchronize -> clip_grad_norm_ -> skip_synchronize step,
    set_backward_passes_per_step, and the attributes scripts read."""
    import horovod.torch as horovod_torch

    import hvdsync.torch as hvdsync_torch
    hvd = horovod_torch if which == "horovod" else hvdsync_torch
    hvd.init()
    torch.manual_seed(0)
    model = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)
    batches = teacher_batches(hvd.rank(), 12)

    def step(x, y, clip=False):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if clip:
            opt.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()

    for x, y in batches[:3]:
        step(x, y, clip=True)
    state.save()
    saved = [p.detach().clone() for p in model.parameters()]
    for x, y in batches[3:5]:
        step(x, y)
    state.restore()
    restored = all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    state.sync()
    opt.set_backward_passes_per_step(2)
    for i in range(5, 11, 2):
        opt.zero_grad()
        for x, y in batches[i:i + 2]:
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    names = sorted(opt._parameter_names.values())
    return dict(params=[p.detach().numpy().copy() for p in model.parameters()],
                restored=restored, names=names, requires=len(opt._requires_update),
                attrs=(opt.backward_passes_per_step, opt.op, opt.gradient_predivide_factor,
                       opt.sparse_as_dense))


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared torch job (tests/conftest.py)."""
    cases = job_group("script", horovod_script, {"horovod": ("horovod",),
                                                 "hvdsync": ("hvdsync",)})
    if np_ == 2:
        cases.update(job_group("amp", amp_body, AMP_CASES))
    return cases


def torchrun_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared torchrun job (tests/conftest.py)."""
    return job_group("amp", amp_body, AMP_CASES) if np_ == 2 else {}


@pytest.mark.parametrize("np_", [2, 3])
def test_a_horovod_script_runs_unchanged_and_gives_horovods_parameters(request, torch_job, np_):
    results = torch_job(request.module, np_, "script")
    for ref, ours in zip(results["horovod"], results["hvdsync"]):
        assert ours["restored"] and ref["restored"]
        assert ours["names"] == ref["names"] and ours["requires"] == ref["requires"] == 6
        assert ours["attrs"] == ref["attrs"]
        for a, b in zip(ref["params"], ours["params"]):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


# -- mixed precision and non-finite gradients ---------------------------------------------------
TECHNIQUES = {
    "plain": {},
    "clip": dict(clip=dict(max_norm=0.5)),
    "clip_adaptive": dict(clip=dict(ema=(0.9, 1.5), warmup=2)),
    "threshold": dict(threshold=dict(threshold=0.6, max_skip=3)),
    "select": dict(select=dict(k=1, max_wait=2)),
    "sparse_threshold": dict(sparse=True, threshold=dict(threshold=0.8, max_skip=3)),
    "lowrank": dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0)),
    # staleness 0: what arrives when cannot change the result, so runs compare bit for bit
    "delay": dict(delay=dict(staleness=0)),
    # local steps and the streaming outer synchronization (K 8 in fragments, int8)
    "outer": dict(delay="streaming"),
}
LOCAL = ("delay", "outer")  # techniques whose steps are not exchanged synchronously
BAD_STEP, BAD_RANK, STEPS = 3, 1, 10


def amp_body(case: str, scale: float | None, bad: str | None) -> dict:
    """Train ``case`` with a GradScaler at ``scale`` (None: no scaler, fp32) in Horovod's AMP
    pattern. ``bad``: "inf"/"nan" multiplies rank 1's loss at step 3 by that; "drop" leaves
    step 3 out on every rank (what skipping it everywhere must equal)."""
    import hvdsync.torch as hvd
    from tests.test_torch_compositions import BagModel, bag_batches
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    bag = case.startswith("sparse")
    model = BagModel() if bag else MLP()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if bag else 0.9)
    scaler = (torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=10 ** 6)
              if scale is not None else None)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   scaler=scaler, **TECHNIQUES[case])
    batches = (bag_batches(hvd.rank(), STEPS) if bag
               else [(x, None, y) for x, y in teacher_batches(hvd.rank(), STEPS)])
    for t, (x, offsets, y) in enumerate(batches):
        if bad == "drop" and t == BAD_STEP:
            continue
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x, offsets) if bag else model(x), y)
        if bad in ("inf", "nan") and t == BAD_STEP and hvd.rank() == BAD_RANK:
            loss = loss * float(bad)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
    opt.flush()
    memory = opt.state_dict().get("hvdsync", {}).get("techniques", {})
    tensors = [t for t in _tensors(memory)]
    return dict(params=[p.detach().numpy().copy() for p in model.parameters()],
                scale=scaler.get_scale() if scaler is not None else None,
                stats=opt.stats.as_dict()["total"],
                memory_finite=all(bool(torch.isfinite(t).all()) for t in tensors))


def _tensors(x):
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


AMP_CASES = {f"{case}/{variant}": (case, scale, bad) for case in TECHNIQUES
             for variant, scale, bad in (("scale1", 1.0, None), ("scale2^16", 2.0 ** 16, None),
                                         ("overflow", 2.0 ** 16, "inf"),
                                         ("dropped", 2.0 ** 16, "drop"),
                                         ("nan", None, "nan"), ("nan_dropped", None, "drop"))}


@pytest.fixture(scope="module", params=JOBS, ids=JOB_IDS)
def amp_runs(request):
    np_, launcher = request.param
    if launcher in SHARED_JOBS:  # (Horovod's runs without tensor fusion there: bit for bit
        # across runs needs its summation order fixed -- 3+ ranks: fusion timing)
        return np_, shared_runs(request, np_, launcher, "amp")
    return np_, run_cases(amp_body, np_, AMP_CASES, timeout=600, launcher=launcher)


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a["params"], b["params"]))


@pytest.mark.parametrize("case", list(TECHNIQUES))
def test_loss_scale_does_not_change_the_result(amp_runs, case):
    """Clip limits, threshold norms, select scores and every memory see unscaled gradients:
    training at loss scale 2^16 gives the parameters of loss scale 1, bit for bit."""
    _, runs = amp_runs
    for one, big in zip(runs[f"{case}/scale1"], runs[f"{case}/scale2^16"]):
        assert _same(one, big), case


@pytest.mark.parametrize("case", [c for c in TECHNIQUES if c not in LOCAL])
@pytest.mark.parametrize("kind", ["overflow", "nan"])
def test_a_bad_step_on_one_rank_is_skipped_on_every_rank(amp_runs, case, kind):
    """An overflow (scaler) or a NaN (fp32) in rank 1's gradient at one step: every rank
    skips that step -- the result is the run without that step, bit for bit -- and no memory
    keeps an Inf/NaN; a scaler backs off identically on every rank."""
    _, runs = amp_runs
    reference = "dropped" if kind == "overflow" else "nan_dropped"
    for rank, (hit, ref) in enumerate(zip(runs[f"{case}/{kind}"], runs[f"{case}/{reference}"])):
        assert _same(hit, ref), (case, kind, rank)
        assert hit["memory_finite"] and all(np.isfinite(p).all() for p in hit["params"])
        assert hit["stats"]["nonfinite_steps"] == 1
        if kind == "overflow":
            assert hit["scale"] == 2.0 ** 15 and ref["scale"] == 2.0 ** 16


@pytest.mark.parametrize("case", LOCAL)
def test_delay_keeps_a_bad_gradient_to_its_rank(amp_runs, case):
    """delay= does not exchange a step synchronously, so the bad rank contributes (and
    applies) zeros for it: nothing non-finite anywhere, the replicas identical after each
    averaging (flush() at the end), that rank counts it and backs its own scaler off; with
    local steps the outer schedule stays aligned (a scaler's skip is still a step)."""
    np_, runs = amp_runs
    for kind in ("overflow", "nan"):
        ranks = runs[f"{case}/{kind}"]
        for rank, r in enumerate(ranks):
            assert r["memory_finite"] and all(np.isfinite(p).all() for p in r["params"])
            assert (r["stats"].get("nonfinite", 0) > 0) == (rank == BAD_RANK), (kind, rank)
            if case == "outer":  # the bad step is still a step of the outer schedule
                clean = runs[f"{case}/scale1"][rank]["stats"]
                assert r["stats"]["outer_started"] == clean["outer_started"] > 0
            if kind == "overflow":
                assert r["scale"] == (2.0 ** 15 if rank == BAD_RANK else 2.0 ** 16)
        for other in ranks[1:]:  # flush() at the end averaged the replicas
            assert _same(ranks[0], other)


# -- Horovod's AMP recipe without scaler= -------------------------------------------------------
def unscaled_body(case: str, recipe: str) -> dict:
    """Horovod's recipe (``synchronize; unscale_; skip_synchronize: step``) or the short one
    (``scaler.step(opt)``) with a GradScaler at 2^16 that the wrapper was not given. A
    scale-sensitive technique must refuse at the first step, before any update; the plain
    exchange must give what Horovod's own optimizer gives."""
    import horovod.torch as horovod

    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    ours, theirs = MLP(), MLP()
    theirs.load_state_dict(ours.state_dict())
    options = {"plain": {}, "outer": dict(delay="streaming")}.get(case, TECHNIQUES.get(case))
    opts = [(ours, hvd.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1),
                                            named_parameters=ours.named_parameters(),
                                            **options))]
    if case == "plain":
        opts.append((theirs, horovod.DistributedOptimizer(
            torch.optim.SGD(theirs.parameters(), lr=0.1),
            named_parameters=theirs.named_parameters())))
    start = [p.detach().clone() for p in ours.parameters()]
    error = None
    for model, opt in opts:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        try:
            for x, y in teacher_batches(hvd.rank(), 3):
                opt.zero_grad()
                scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
                if recipe == "horovod":
                    opt.synchronize()
                    scaler.unscale_(opt)
                    with opt.skip_synchronize():
                        scaler.step(opt)
                else:
                    scaler.step(opt)
                scaler.update()
        except RuntimeError as e:
            error = str(e)
    moved = max((a - b).abs().max().item() for a, b in zip(start, ours.parameters()))
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(),
                                                          theirs.parameters()))
    return dict(error=error, moved=moved, diff=diff)


SENSITIVE = ["clip", "threshold", "select", "lowrank", "delay", "outer"]


@pytest.mark.parametrize("np_", [2])
def test_amp_recipe_without_scaler_refuses_or_matches_horovod(np_):
    # (the short recipe unscales while a plain exchange is in flight: Horovod's docs ask for
    # synchronize() first, so plain is compared with Horovod on its own recipe only)
    cases = {f"{case}/{recipe}": (case, recipe) for case in ["plain"] + SENSITIVE
             for recipe in ("horovod", "short") if case != "plain" or recipe == "horovod"}
    runs = run_cases(unscaled_body, np_, cases, timeout=300)
    for name, ranks in runs.items():
        case = name.split("/")[0]
        for r in ranks:
            if case == "plain":  # the sum is linear: unscaled afterwards, as with Horovod
                assert r["error"] is None and r["diff"] <= 1e-6, (name, r)
            else:  # refused at the first step, on every rank, before the update
                assert r["error"] is not None and "scaler=scaler" in r["error"], (name, r)
                assert f"{case if case != 'outer' else 'delay'}=" in r["error"], (name, r)
                assert r["moved"] == 0.0, (name, r)


# -- a restore after the world changed (Horovod Elastic) ---------------------------------------
def test_restoring_drops_a_step_whose_collectives_failed():
    """Horovod Elastic restores the last commit (``load_state_dict``) after a rank died, while
    the interrupted step's collectives can only raise: the step is dropped with a warning,
    the state loads and training goes on (one process; the killed-rank job: issue 31)."""
    import hvdsync.torch as hvd
    from hvdsync.core.wire import Pending
    hvd.init()
    torch.manual_seed(0)
    m = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(), threshold=0.5)
    (x, y), = teacher_batches(0, 1)
    opt.zero_grad()
    nn.functional.cross_entropy(m(x), y).backward()
    opt.step()
    saved = opt.state_dict()

    def gone():
        raise RuntimeError("Horovod has been shut down")
    opt._pipeline.state.pending[0] = [(Pending(gone, what="an allreduce of a lost world"), [])]
    with pytest.warns(RuntimeWarning, match="1 collective.* of the abandoned step failed .*shut down"):
        opt.load_state_dict(saved)
    assert not opt._pipeline.busy
    opt.zero_grad()
    nn.functional.cross_entropy(m(x), y).backward()
    opt.step()
    assert opt.stats.total.step == 2
