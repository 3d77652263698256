"""Checkpoint and resume in fresh processes (torch), every technique, 2 and 3 ranks: a run
saved mid-training and restored into new processes continues exactly as the uninterrupted
run; per-rank memory travels per rank; a checkpoint of one rank, or of another world size,
is restored without reusing another rank's memory (docs/checkpoints.md)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from torch import nn

from tests.models import MLP, run_job, teacher_batches

STEPS = 8  # before and after the checkpoint

CASES = {
    "plain": {},
    "clip": dict(clip=dict(ema=(0.9, 1.0), warmup=2)),
    "threshold": dict(threshold=dict(threshold=0.6, max_skip=4)),
    "select": dict(select=dict(k=1, max_wait=3)),
    "lowrank": dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0)),
    "delay": dict(delay=dict(staleness=1, average_every=4)),
    # folded when due, with momentum: each rank's own momentum travels per rank
    "delay_due": dict(delay=dict(staleness=1, average_every=4, fold="due")),
}
#: streaming outer synchronization, saved at step 8 with fragment 1's int8 exchange (started
#: after step 8, merged after step 10) in flight, and no flush(); each job ends with an
#: exchange in flight too (finished at exit: hvdsync.techniques.outer.technique's exit hook)
OUTER = {"outer": dict(delay=dict(exchange_gradients=False, average_every=4, fragments=2,
                                  overlap=2, mix=0.5, compress="int8", outer_lr=0.7,
                                  outer_momentum=0.9))}
CASES.update(OUTER)
IN_FLIGHT = set(OUTER)  # saved without flush()
#: deterministic: a resumed run equals the uninterrupted one bit for bit. delay= folds in what
#: has *arrived*, which depends on timing, so its runs differ between any two executions;
#: what a restore must keep for it is the schedule (tested below). Local steps with the outer
#: synchronization do not fold by arrival: exact.
EXACT = ["plain", "clip", "threshold", "select", "lowrank", "delay_due", "outer"]


def _make(options: dict):
    import hvdsync.torch as hvd
    torch.manual_seed(0)
    model = MLP()
    base = (torch.optim.SGD(model.parameters(), lr=0.05)
            if "delay" in options and options["delay"].get("fold") != "due" else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return model, hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           **options)


def _train(model, opt, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _start():
    """One rank's start: Horovod up, one thread, its 2 * STEPS batches."""
    import hvdsync.torch as hvd
    hvd.init(process_sets=hvd.node_process_sets())  # (none but on nodes of several ranks)
    torch.set_num_threads(1)
    return hvd, teacher_batches(hvd.rank(), 2 * STEPS)


def first_job(directory: str, cases: dict = CASES) -> dict:
    """Train 8 steps, checkpoint every case (one file per case, written by rank 0 with every
    rank's memory), train 8 more: the uninterrupted result."""
    hvd, batches = _start()
    out = {}
    for case, options in cases.items():
        model, opt = _make(options)
        _train(model, opt, batches[:STEPS])
        if case not in IN_FLIGHT:
            opt.flush()  # delay=: identical replicas before saving (no-op otherwise)
        hvd.save_checkpoint(os.path.join(directory, f"{case}.pt"), model, opt,
                            extra={"step": STEPS})
        torch.save(opt.state_dict(), os.path.join(directory, f"{case}.rank{hvd.rank()}.pt"))
        _train(model, opt, batches[STEPS:])
        out[case] = [p.detach().numpy().copy() for p in model.parameters()]
    return out


def second_job(directory: str, how: str, cases: dict = CASES) -> dict:
    """Fresh processes: restore each case and train the same 8 steps. ``how``: "helper"
    (hvd.load_checkpoint), "own" (each rank its own state_dict file), "rank0" (rank 0's
    state_dict on every rank: Horovod's habit)."""
    hvd, batches = _start()
    out = {}
    for case, options in cases.items():
        model, opt = _make(options)
        if how == "helper":
            extra = hvd.load_checkpoint(os.path.join(directory, f"{case}.pt"), model, opt)
            assert extra == {"step": STEPS}, extra
        else:
            ckpt = hvd.load_checkpoint(os.path.join(directory, f"{case}.pt"), model, None)
            rank = hvd.rank() if how == "own" else 0
            # torch's default, weights_only=True: the state holds tensors and plain data
            opt.load_state_dict(torch.load(os.path.join(directory, f"{case}.rank{rank}.pt")))
            assert ckpt == {"step": STEPS}
        _train(model, opt, batches[STEPS:])
        out[case] = dict(params=[p.detach().numpy().copy() for p in model.parameters()],
                         stats=opt.stats.as_dict()["total"])
    return out


def second_jobs(directory: str, hows: tuple[str, ...]) -> dict:
    """:func:`second_job` for each of ``hows`` in one job: fresh processes (not the ones that
    saved), each way with models and optimizers of its own."""
    return {how: second_job(directory, how) for how in hows}


# Horovod on 2 and 3 ranks, torch.distributed (torchrun) on 2
# real ranks: 2 on each backend (fresh processes, the file format); 3 ranks' per-rank memory
# mapping on simulated ranks (fresh objects in the test process)
JOBS = [(2, "horovodrun"), (2, "torchrun"), (2, "simulated"), (3, "simulated")]


@pytest.fixture(scope="module", params=JOBS, ids=[f"np{n}-{lau}" for n, lau in JOBS])
def jobs(request, tmp_path_factory):
    np_, launcher = request.param
    directory = str(tmp_path_factory.mktemp(f"ckpt{np_}"))
    # real: the same summation order in both jobs; simulated: fresh objects in this process,
    # not fresh processes (sums in rank order)
    env = {"HOROVOD_FUSION_THRESHOLD": "0"} if launcher != "simulated" else None

    def run(fn, *args):
        return run_job(fn, np_, args, timeout=300, env=env, launcher=launcher)
    uninterrupted = run(first_job, directory)
    per_rank = run(second_jobs, directory, ("helper", "own", "rank0"))
    resumed = {how: [r[how] for r in per_rank] for how in per_rank[0]}
    return np_, uninterrupted, resumed


@pytest.mark.parametrize("how", ["helper", "own"])
@pytest.mark.parametrize("case", EXACT)
def test_fresh_processes_continue_exactly(jobs, case, how):
    _, uninterrupted, resumed = jobs
    for rank, (a, b) in enumerate(zip(uninterrupted, resumed[how])):
        for x, y in zip(a[case], b[case]["params"]):
            np.testing.assert_array_equal(y, x, err_msg=f"{case} rank {rank}")


@pytest.mark.parametrize("how", ["helper", "own", "rank0"])
def test_delay_keeps_its_schedule(jobs, how):
    """Restored at step 8 with K=4: steps 12 and 16 average (2 averagings in the 8 resumed
    steps, none missed or added), so the replicas are identical at the end."""
    _, _, resumed = jobs
    ranks = [r["delay"] for r in resumed[how]]
    assert all(r["stats"]["averaged"] == 2 for r in ranks), [r["stats"] for r in ranks]
    for other in ranks[1:]:
        for a, b in zip(ranks[0]["params"], other["params"]):
            np.testing.assert_array_equal(a, b)


def test_one_ranks_state_on_every_rank_reuses_no_memory(jobs):
    """Rank 0's state_dict loaded everywhere: per-rank memory (threshold's accumulations and
    sync points, select's residuals, lowrank's error feedback) is dropped on every rank alike -- so replicas stay
    consistent -- while the shared state (counters, hypernet) is restored."""
    _, uninterrupted, resumed = jobs
    for case in ("threshold", "select", "lowrank"):
        ranks = [r[case] for r in resumed["rank0"]]
        if case != "threshold":  # global updates: identical replicas
            for other in ranks[1:]:
                for a, b in zip(ranks[0]["params"], other["params"]):
                    np.testing.assert_array_equal(a, b)
        assert all(r["stats"]["step"] == STEPS for r in ranks)
    # where nothing per rank is kept, rank 0's state is as good as the rank's own
    for a, b in zip(uninterrupted, resumed["rank0"]):
        for x, y in zip(a["plain"], b["plain"]["params"]):
            np.testing.assert_array_equal(x, y)


# -- torchrun --max-restarts: a rank dies, every worker restarts and resumes --------------------
def restarted_job(directory: str, cases: dict = CASES, lost: tuple[int, ...] = (1,)) -> dict:
    """Under ``torchrun --max-restarts 1``. The first attempt trains every case STEPS steps,
    checkpoints it and trains on; in the last case the ranks ``lost`` die (SIGKILL) before a
    step's backward while the others are in that step. torchrun starts every worker again,
    and the second attempt is :func:`resumed_job`."""
    hvd, batches = _start()
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return resumed_job(directory, cases)
    for case, options in cases.items():
        model, opt = _make(options)
        _train(model, opt, batches[:STEPS])
        if case not in IN_FLIGHT:
            opt.flush()
        hvd.save_checkpoint(os.path.join(directory, f"{case}.pt"), model, opt)
        _train(model, opt, batches[STEPS:STEPS + 2])  # lost with the failure
    if hvd.rank() in lost:
        os.kill(os.getpid(), signal.SIGKILL)
    _train(model, opt, batches[STEPS + 2:])  # the others: their collectives fail with the peer
    raise AssertionError("a step with a dead peer returned")


def resumed_job(directory: str, cases: dict = CASES) -> dict:
    """Every case restored from its checkpoint (per-rank memory included), STEPS more steps,
    ``flush()``: each case's parameters, and the warnings that per-rank memory was lost."""
    import warnings
    hvd, batches = _start()
    out = {}
    for case, options in cases.items():
        model, opt = _make(options)
        with warnings.catch_warnings(record=True) as caught:  # (the first step checks too)
            warnings.simplefilter("always")
            hvd.load_checkpoint(os.path.join(directory, f"{case}.pt"), model, opt)
            _train(model, opt, batches[STEPS:])
        opt.flush()
        out[case] = dict(params=[p.detach().numpy().copy() for p in model.parameters()],
                         dropped=[str(w.message) for w in caught if "memory" in str(w.message)])
    return dict(restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), cases=out)


def test_torchrun_restarts_resume_every_technique_with_nothing_lost(tmp_path):
    """The native way to survive a failure on torch.distributed: ``torchrun --max-restarts``
    plus a resume from the last ``save_checkpoint`` (docs/elastic.md). The restarted job
    ends with identical replicas after ``flush()``, and with the parameters of an
    uninterrupted job resumed from the same checkpoints, bit for bit where a run is
    deterministic (``delay=`` folds by arrival: identical replicas)."""
    directory = str(tmp_path)
    restarted = run_job(restarted_job, 2, (directory,), timeout=300, launcher="torchrun",
                        restarts=1, env={"HOROVOD_FUSION_THRESHOLD": "0"})
    assert [r["restarts"] for r in restarted] == [1, 1], "no restart happened"
    uninterrupted = run_job(resumed_job, 2, (directory,), timeout=300, launcher="torchrun")
    for case in CASES:
        ranks = [r["cases"][case] for r in restarted]
        assert all(r["dropped"] == [] for r in ranks), (case, ranks[0]["dropped"])
        for other in ranks[1:]:  # identical replicas after flush()
            for a, b in zip(ranks[0]["params"], other["params"]):
                np.testing.assert_array_equal(a, b, err_msg=case)
        if case in EXACT:
            for a, b in zip(uninterrupted[0]["cases"][case]["params"], ranks[0]["params"]):
                np.testing.assert_array_equal(a, b, err_msg=case)
