"""All of Horovod's torch API on the torch engine (torchrun, hvdsync.torch.c10d), held to Horovod's
own answers: each body (tests/torch_api_cases.py) runs on ``horovodrun`` (Horovod) and on
``torchrun`` in the session's shared jobs, and the tests compare the two."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hvdsync.testing import HIDE_ENV, run_ranks
from tests.torch_api_cases import (DTYPES, REDUCE_OPS, WIDE, async_forms,
                                   async_without_waiting, autograd_walk, join_uneven,
                                   join_with_own_call_in_flight,
                                   checks_in_training, dtype_matrix, mistakes, rank_leaves,
                                   reducescatter_wire, refusals,
                                   run_script, step_while_a_rank_joined, sync_batch_norm,
                                   join_with_optimizer, JOIN_TECHNIQUES)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NP = pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """Cases in the shared horovodrun job: Horovod's answers (the dtype matrix runs in a job of
    its own there, with Horovod's default fusion buffer)."""
    if np_ not in (2, 3):
        return {}
    return {"autograd": (autograd_walk,), "sync_batch_norm": (sync_batch_norm,),
            "async_forms": (async_forms,), "refusals": (refusals,),
            "async_without_waiting": (async_without_waiting,), "join": (join_uneven,),
            "join_in_flight": (join_with_own_call_in_flight,),
            "join_optimizer": (join_with_optimizer,)}


def torchrun_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """The same cases in the shared torchrun job, and the mistakes (torch engine only)."""
    if np_ not in (2, 3):
        return {}
    return {**torch_job_cases(np_, directory), "matrix": (dtype_matrix,),
            "reducescatter_wire": (reducescatter_wire,),
            "mistakes": (mistakes,), "checks_in_training": (checks_in_training,)}


def _expected(horovod: dict, key: str) -> object:
    """What the torch engine must answer for ``key``: Horovod's answer; where Horovod's Gloo
    build refuses the dtype, Horovod's answer for the widened dtype cast back (bool reduces
    with Min and Max only, as docs/backends.md says)."""
    if horovod[key] != "raises":
        return horovod[key]
    collective, dn, *op = key.split("/")
    if dn not in WIDE or (dn == "bool" and op and op[0] not in ("Min", "Max")):
        return "raises"
    wide = horovod["/".join([collective, f"{dn}~{WIDE[dn]}", *op])]
    assert wide != "raises", key
    import torch

    def narrow(answer: list) -> list:
        _, shape, values = answer
        cast = torch.tensor(values, dtype=torch.float64).to(getattr(torch, WIDE[dn]))
        return [f"torch.{dn}", shape, cast.to(getattr(torch, dn)).double().tolist()]
    if collective == "alltoall_splits":  # the received splits stay int32
        return [narrow(wide[0]), wide[1]]
    if isinstance(wide[0], list):  # grouped
        return [narrow(w) for w in wide]
    return narrow(wide)


def _same(ours: object, theirs: object, key: str) -> bool:
    if isinstance(theirs, str) or isinstance(ours, str):
        return ours == theirs
    if isinstance(theirs[0], list):
        return len(ours) == len(theirs) and all(_same(o, t, key) for o, t in zip(ours, theirs))
    if ours[:2] != theirs[:2]:
        return False
    rtol = {"torch.bfloat16": 1 / 128, "torch.float16": 1e-3}.get(theirs[0], 1e-6)
    return np.allclose(ours[2], theirs[2], rtol=rtol, atol=0)


@NP
def test_every_dtype_and_collective_answers_as_horovod(request, torchrun_job, np_):
    # a job of its own on Horovod: the shared one turns off Horovod's fusion buffer, without
    # which Horovod refuses a scaled reducescatter
    horovod = run_ranks(dtype_matrix, np=np_, timeout=180)
    ours = torchrun_job(request.module, np_)["matrix"]
    keys = [k for k in horovod[0] if "~" not in k.split("/")[1]]
    assert len(keys) == len(DTYPES) * (2 * len(REDUCE_OPS) + 4 * 2 + 6)
    for r in range(np_):
        wrong = {k: (ours[r][k], _expected(horovod[r], k)) for k in keys
                 if not _same(ours[r][k], _expected(horovod[r], k), k)}
        assert not wrong, f"rank {r}: {len(wrong)} differ, e.g. {list(wrong.items())[:3]}"
    # every dtype moves through every collective on the torch engine; only bool's sums refuse
    refused = {k for k in keys if ours[0][k] == "raises"}
    assert all(k.split("/")[1] == "bool" and k.split("/")[2] in ("Sum", "Average", "Product")
               for k in refused), refused


@NP
@pytest.mark.parametrize("case", ["autograd", "async_forms"])
def test_gradients_and_async_forms_as_horovod(request, torch_job, torchrun_job, np_, case):
    """``autograd``: the gradient through every differentiable collective; ``async_forms``:
    several asynchronous calls in flight at once, the in-place forms, the job's facts and
    horovodrun's environment variables."""
    horovod = torch_job(request.module, np_)[case]
    ours = torchrun_job(request.module, np_)[case]
    for r in range(np_):
        assert ours[r].keys() == horovod[r].keys()
        for k, v in horovod[r].items():
            same = (ours[r][k] == v if k in ("initialized", "cross", "environment")
                    else _same(ours[r][k], v, k))
            assert v != "raises" and same, (r, k, ours[r][k], v)
        if case == "async_forms":  # horovodrun's variables, set by hvd.init() on torchrun
            env = ours[r]["environment"]
            assert (env["HOROVOD_RANK"], env["HOROVOD_SIZE"]) == (str(r), str(np_)), env


@NP
def test_sync_batch_norm_is_batch_norm_of_the_global_batch(request, torch_job, torchrun_job,
                                                           np_):
    for engine_job in (torch_job, torchrun_job):  # ours on both engines, CPU tensors included
        for res in engine_job(request.module, np_)["sync_batch_norm"]:
            assert res["batches"] == 1
            for what in ("output", "input_grad", "param_grads", "running", "eval_output"):
                assert res[what] < 1e-10, (what, res)


@NP
def test_mistakes_raise_the_same_clear_error_on_every_rank(request, torchrun_job, np_):
    res = torchrun_job(request.module, np_)["mistakes"]
    said = {"shape": "shapes differ", "dtype": "dtypes differ", "name": "name differ",
            "root": "root_rank differ", "op": "op differ",
            "one_rank_only": "collective differ"}
    for r, out in enumerate(res):
        for label, phrase in said.items():
            assert out[label] is not None, (r, label)
            text, seconds = out[label]
            assert phrase in text and seconds < 30, (r, label, text)
            assert text == res[0][label][0], (r, label)  # the same error on every rank
        assert out["reused_after_synchronize"] is None
        assert out["job_goes_on"] == out["expected_sum"]
    assert "rank 0: [3]; rank 1: [4]" in res[0]["shape"][0]
    assert "rank 0: 'Max'" not in res[0]["op"][0] and "rank 0: Max" in res[0]["op"][0]


@NP
def test_refusals_raise_horovods_exception_classes(request, torch_job, torchrun_job, np_):
    """Each call Horovod refuses raises, on the torch engine, an instance of every class
    Horovod's exception is (a subclass keeps hvdsync's message); a name still in flight is
    refused at once on the rank that repeats it, while its peers are elsewhere."""
    horovod = torch_job(request.module, np_)["refusals"]
    ours = torchrun_job(request.module, np_)["refusals"]
    for r in range(np_):
        labels = [k for k in horovod[r] if not k.endswith(".seconds") and k != "job_goes_on"]
        assert len(labels) == (23 if r == 0 else 19), labels
        assert sum(horovod[r][k] is not None for k in labels) == len(labels) - 1
        wrong = {k: (ours[r][k], horovod[r][k]) for k in labels
                 if (ours[r][k] is None) != (horovod[r][k] is None)
                 or not set(horovod[r][k] or ()) <= set(ours[r][k] or ())}
        assert not wrong, f"rank {r}: ours, Horovod's: {wrong}"
        assert ours[r]["job_goes_on"] == horovod[r]["job_goes_on"] == sum(range(np_))
    for kind in ("allreduce", "allgather", "broadcast", "reducescatter"):
        assert ours[0][f"duplicate/{kind}.seconds"] < 0.5, ours[0]  # peers asleep for 1 s
        assert ours[0][f"duplicate/{kind}"] == ["ValueError"], ours[0]


@NP
def test_async_calls_return_without_waiting_for_their_peers(request, torch_job, torchrun_job,
                                                            np_):
    """An ``*_async`` call returns at once while the peers are elsewhere (their check and
    sizes travel on the rank's lane), with Horovod's results after ``synchronize``. Calls
    started in another order on some ranks: Horovod pairs them by name; the torch engine
    (c10d pairs by order) raises the same error on every rank, naming the names, and the job
    goes on (docs/backends.md)."""
    horovod = torch_job(request.module, np_)["async_without_waiting"]
    ours = torchrun_job(request.module, np_)["async_without_waiting"]
    total = float(sum(range(np_)))
    for r in range(np_):
        assert ours[r]["results"] == horovod[r]["results"], r
        assert "raises" not in str(ours[r]["results"])
        assert horovod[r]["o.x"] == horovod[r]["o.y"] == [total, total]
        assert ours[r]["job_goes_on"] == horovod[r]["job_goes_on"] == total
        # the same errors on every rank (each rank's first call paired with the others' first)
        assert {ours[r]["o.x"], ours[r]["o.y"]} == {ours[0]["o.x"], ours[0]["o.y"]}, r
        for name in ("o.x", "o.y"):
            assert "name differ" in ours[r][name] and "same order" in ours[r][name], ours[r]
    assert horovod[0]["start_seconds"] < 0.5, horovod[0]  # the peers sleep 1.5 s
    assert ours[0]["start_seconds"] < 0.5, ours[0]


@NP
def test_reducescatter_moves_a_reduce_scatters_bytes(request, torchrun_job, np_):
    """One c10d reduce-scatter per dtype, its input the tensors' bytes (padded to equal parts
    where the rows do not divide), no allreduce; each rank gets Horovod's rows."""
    n = np_
    for r, res in enumerate(torchrun_job(request.module, np_)["reducescatter_wire"]):
        f32, f64 = 4, 8
        assert res["seen"] == [["reduce_scatter_single", 4 * n * 3 * f32],
                               ["reduce_scatter_single", (2 * n * 5 + n * 2) * f32],
                               ["reduce_scatter_single", n * 2 * f64],
                               ["reduce_scatter_single", n * 3 * 3 * f32]], res["seen"]
        assert res["rows"] == [[4, 3], [[2, 5], [1, 2], [1, 2]],
                               [3 if r == 0 else 2, 3] if n == 2 else [3 if r < 1 else 2, 3]]


@NP
def test_hvdsync_training_pays_no_check_a_script_call_one(request, torchrun_job, np_):
    for res in torchrun_job(request.module, np_)["checks_in_training"]:
        assert res["training"] == 0 and res["script"] == 1, res
        assert res["setup"] >= 1, res  # broadcast_parameters: a script's call, checked


def test_a_rank_that_leaves_ends_the_others_wait_with_an_error():
    res = run_ranks(rank_leaves, np=3, timeout=120, launcher="torchrun")
    assert res[1:] == ["left", "left"]
    text, seconds = res[0]
    assert "a collective failed" in text and seconds < 30, res[0]


@NP
def test_join_answers_the_others_allreduces_as_horovods(request, torch_job, torchrun_job, np_):
    """Uneven batches: a joined rank's zeros give Horovod's averages and sums on the ranks
    that go on; join returns the rank that joined last; an allgather or a broadcast while a
    rank has joined raises a RuntimeError (Horovod's class) on the calling ranks, and the job
    goes on."""
    horovod = torch_job(request.module, np_)["join"]
    ours = torchrun_job(request.module, np_)["join"]
    for r in range(np_):
        for key in ("sum", "last", "job_goes_on"):
            assert ours[r][key] == horovod[r][key], (r, key, ours[r][key], horovod[r][key])
        assert np.allclose(ours[r]["average"], horovod[r]["average"], rtol=1e-6, atol=0), r
        if r > 0:
            assert ours[r]["allgather"] is horovod[r]["allgather"] is True
            assert ours[r]["broadcast"] is horovod[r]["broadcast"] is True
    assert horovod[0]["last"] == np_ - 1  # rank r had r + 1 batches
    if np_ == 2:  # (with more ranks joining in one round, Horovod names any of them)
        assert ours[0]["last_again"] == horovod[0]["last_again"] == 1


@NP
def test_a_rank_that_joins_with_its_own_call_in_flight_gets_every_ranks_sum(
        request, torch_job, torchrun_job, np_):
    """A rank's ``allreduce_async`` still in flight when it calls ``hvd.join()`` (its peers
    start theirs later) completes with every rank's values on both engines; join waits for
    it (on Horovod alone the peers crash)."""
    for engine_job in (torch_job, torchrun_job):
        ranks = engine_job(request.module, np_)["join_in_flight"]
        assert [r["sum"] for r in ranks] == [np_ * (np_ + 1) / 2] * np_, ranks
        assert len({r["last"] for r in ranks}) == 1, ranks  # (who joins last is a race here)


@NP
def test_join_beside_hvdsyncs_optimizer_gives_horovods_parameters(request, torch_job,
                                                                  torchrun_job, np_):
    """Uneven batches, every technique that can go on beside a joined rank: when ``join``
    returns, every replica is the same (the torch engine's joined rank took each step with
    zero gradients, Horovod's answered with zeros; then every rank took the last-joined
    rank's parameters and state), and after ``flush()`` too. Nothing on: the parameters are those of Horovod's own
    optimizer on the rank that joined last (1e-6), on both engines."""
    for job in (torch_job, torchrun_job):
        runs = job(request.module, np_)["join_optimizer"]
        names = [*JOIN_TECHNIQUES] + (["sparse"] if job is torchrun_job else [])
        for name in names:
            for r in range(np_):
                assert runs[r][name]["last"] == np_ - 1, (name, r)
                for key in ("joined", "flushed"):
                    for a, b in zip(runs[r][name][key], runs[0][name][key]):
                        assert np.array_equal(a, b), (job, name, key, r)
        reference = torch_job(request.module, np_)["join_optimizer"][np_ - 1]["horovod"]
        for a, b in zip(runs[0]["plain"]["flushed"], reference["joined"]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # (the test can fail: Horovod's joined rank stays where it joined)
    early = torch_job(request.module, np_)["join_optimizer"][0]["horovod"]["joined"]
    assert not all(np.array_equal(a, b) for a, b in zip(early, reference["joined"]))


@pytest.mark.parametrize("launcher", ["horovodrun", "torchrun"])
def test_a_step_that_cannot_go_on_beside_a_joined_rank_is_refused_with_the_reason(launcher):
    """``delay=`` averages parameters, which a joined rank has not trained. Horovod: a joined
    rank sends zeros, which the step's entry tag reads as "in hvd.join()"; rank 0 raises naming
    it and why, and joins. torch.distributed: the tag pairs with the joined rank's check, so
    the joined rank raises too, naming the step, and neither waits forever."""
    ranks = run_ranks(step_while_a_rank_joined, np=2, timeout=120, launcher=launcher)
    said, _ = ranks[0]
    assert "rank 1: hvd.join()" in said and "delay= averages" in said, said
    assert ranks[1][0] is None
    if launcher == "horovodrun":
        assert ranks[0][1] is None and ranks[1][1] is None
    else:
        assert "rank 0: a training step (step 2)" in ranks[1][1], ranks[1]


HOROVOD_SCRIPT = '''
import os
import torch
import torch.nn.functional as F
import horovod.torch as hvd

pair = hvd.ProcessSet([0, 1])
hvd.init(process_sets=[pair])
device = "cuda" if hvd.nccl_built() and torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), hvd.SyncBatchNorm(16), torch.nn.ReLU(),
                            torch.nn.Linear(16, 4)).to(device)
for p in model[0].parameters():  # a frozen layer: no gradient, no optimizer state
    p.requires_grad_(False)
optimizer = torch.optim.Adam([{"params": model[1].parameters(), "lr": 0.01},
                              {"params": model[3].parameters()}], lr=0.02 * hvd.size())
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
head = torch.nn.Linear(4, 2).to(device)  # trained by the pair of ranks only
if pair.included():
    head_opt = hvd.DistributedOptimizer(torch.optim.SGD(head.parameters(), lr=0.1),
                                        named_parameters=head.named_parameters(),
                                        process_set=pair)
gen = torch.Generator().manual_seed(hvd.rank())
for step in range(4):
    x = torch.randn(6, 8, generator=gen).to(device)
    y = torch.randint(0, 4, (6,), generator=gen).to(device)
    # every rank hands each a share of its batch (named: with process sets, Horovod's
    # automatic names count per process and would differ between the ranks)
    x, y = hvd.alltoall(x, name="batch.x"), hvd.alltoall(y, name="batch.y")
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    if pair.included():
        head_opt.zero_grad()
        head(x[:, :4]).pow(2).mean().backward()
        head_opt.step()
mean_loss = hvd.allreduce(loss.detach(), name="loss")
saved = {"mean_loss": mean_loss, "adam_steps": torch.tensor(
    [float(s["step"]) for s in optimizer.state.values()])}
saved.update({f"model.{k}": v for k, v in model.state_dict().items()})
saved.update({f"head.{k}": v for k, v in head.state_dict().items()})
torch.save(saved, os.path.join(os.environ["SCRIPT_OUTPUTS"], f"rank{hvd.rank()}.pt"))
'''


def test_a_horovod_script_runs_on_torchrun_with_only_the_import_changed(tmp_path):
    ours = tmp_path / "train_hvdsync.py"
    ours.write_text(HOROVOD_SCRIPT.replace("import horovod.torch as hvd",
                                           "import hvdsync.torch as hvd"))
    assert ours.read_text().count("\n") == HOROVOD_SCRIPT.count("\n")
    (tmp_path / "torchrun").mkdir()
    (tmp_path / "horovodrun").mkdir()
    on_torch = run_ranks(run_script, np=3, args=(str(ours), str(tmp_path / "torchrun")),
                         timeout=180, launcher="torchrun", env={HIDE_ENV: "horovod"})
    # Horovod's own SyncBatchNorm takes CUDA tensors only: on this CPU machine the reference
    # is the same script on Horovod's engine (hvdsync.torch there: Horovod's collectives)
    on_horovod = run_ranks(run_script, np=3, args=(str(ours), str(tmp_path / "horovodrun")),
                           timeout=180, launcher="horovodrun")
    for r in range(3):
        assert on_torch[r].keys() == on_horovod[r].keys()
        for k, v in on_horovod[r].items():
            assert np.allclose(on_torch[r][k], v, rtol=1e-5, atol=1e-6), (r, k)
        assert on_torch[r]["adam_steps"] == [5.0] * 4  # Horovod's first step, then 4
    assert on_torch[0]["model.1.weight"] == on_torch[2]["model.1.weight"]  # replicas agree
    assert on_torch[0]["head.weight"] == on_torch[1]["head.weight"]  # the pair trained it
    assert on_torch[2]["head.weight"] != on_torch[0]["head.weight"]  # rank 2 did not


def _horovod_names() -> list[str]:
    import horovod.torch as horovod
    return sorted(k for k in vars(horovod) if not k.startswith("_"))


def test_every_horovod_name_is_there_exercised_or_refused_in_the_docs():
    names = _horovod_names()
    assert len(names) >= 70
    table = open(os.path.join(ROOT, "docs", "backends.md")).read()
    undocumented = [n for n in names if f"`{n}`" not in table]
    assert not undocumented, f"docs/backends.md does not list {undocumented}"
    # exercised on torchrun ranks by this file's cases, or tests/test_torch_backend.py's
    sources = "".join(open(os.path.join(ROOT, "tests", f)).read()
                      for f in ("torch_api_cases.py", "test_torch_backend.py"))
    sources += HOROVOD_SCRIPT + _WITHOUT_HOROVOD
    called = set(re.findall(r"hvd\.(\w+)", sources)) | set(REDUCE_OPS)  # getattr(hvd, op)
    modules = {"compression", "elastic", "functions", "optimizer", "sync_batch_norm"}
    refused = {"mpi_ops", "mpi_lib_v2"}
    unexercised = [n for n in names if n not in called | modules | refused]
    assert not unexercised, f"no torchrun test calls {unexercised}"
    for n in refused:
        assert re.search(rf"`{n}`[^\n]*refused", table), n
    out = subprocess.run([sys.executable, "-c", _WITHOUT_HOROVOD], text=True,
                         capture_output=True, timeout=120,
                         env={**{k: v for k, v in os.environ.items()
                                 if k not in ("RANK", "WORLD_SIZE", "HOROVOD_RANK")},
                              "NAMES": ",".join(names)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok"], out.stdout


_WITHOUT_HOROVOD = textwrap.dedent('''
    import os, sys, warnings
    sys.modules["horovod"] = None  # as if Horovod were not installed
    import torch
    import hvdsync.torch as hvd
    hvd.init()
    for name in os.environ["NAMES"].split(","):
        if name in ("mpi_ops", "mpi_lib_v2"):
            try:
                getattr(hvd, name)
                raise SystemExit(f"{name} should be refused")
            except AttributeError as e:
                assert "compiled extension" in str(e), e
        else:
            assert hasattr(hvd, name), name
    assert hvd.mpi_built() is False and hvd.mpi_enabled() is False
    assert hvd.gloo_built() and hvd.gloo_enabled()
    assert hvd.nccl_built() == torch.distributed.is_nccl_available()
    assert hvd.cuda_built() == torch.backends.cuda.is_built() and not hvd.ddl_built()
    assert not hvd.ccl_built() and not hvd.rocm_built() and not hvd.mpi_threads_supported()
    hvd.check_extension()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.start_timeline("/tmp/timeline.json")
        hvd.stop_timeline()
        hvd.start_timeline("/tmp/timeline.json")
    assert len(caught) == 1 and "records nothing" in str(caught[0].message)
    assert hvd.join() == 0  # alone: this rank joined last
    try:
        hvd.add_process_set([0])
        raise SystemExit("a set of every rank duplicates the global one")
    except ValueError as e:
        assert "duplicate" in str(e), e
    assert not hvd.remove_process_set(hvd.global_process_set)
    try:
        hvd.allreduce(torch.ones(1), op=hvd.Adasum)
        raise SystemExit("Adasum should be refused")
    except ValueError as e:
        assert "Adasum is Horovod's own" in str(e), e
    assert isinstance(hvd.HorovodInternalError("x"), RuntimeError)
    hvd.barrier()
    hvd.shutdown()
    print("ok")
''')
