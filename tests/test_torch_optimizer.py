"""hvdsync.torch.DistributedOptimizer: construction-time validation, the drop-in API, stats,
sparse gradients, and single-rank behaviour."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import hvdsync.torch as hvd
from tests.models import MLP, REAL_NP, REAL_NP_IDS, assert_construction_fails, teacher_batches


@pytest.fixture(scope="module", autouse=True)
def horovod_single_rank():
    hvd.init()  # a standalone process is a world of one rank
    yield


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# -- bad input fails at construction, naming the argument -----------------------------------
def test_unknown_keyword_names_it_and_suggests():
    m = MLP()
    with pytest.raises(TypeError, match=r"'backward_passes_per_stp' \(did you mean "
                                        r"'backward_passes_per_step'\?\)"):
        hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters(),
                                 backward_passes_per_stp=2)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(backward_passes_per_step=0), ValueError, "backward_passes_per_step must be >= 1"),
    (dict(backward_passes_per_step=1.5), TypeError, "backward_passes_per_step must be an int"),
    (dict(op="mean"), ValueError, "op must be one of"),
    (dict(op=hvd.Adasum), ValueError, "Adasum is not supported"),
    (dict(op=hvd.Sum, gradient_predivide_factor=2.0), ValueError, "only supported with op=Average"),
    (dict(gradient_predivide_factor=0.0), ValueError, "gradient_predivide_factor must be"),
    (dict(gradient_predivide_factor=float("nan")), ValueError, "gradient_predivide_factor must be"),
    (dict(sparse_as_dense="yes"), TypeError, "sparse_as_dense must be True or False"),
    (dict(compression="fp16"), TypeError, "compression must provide compress"),
    (dict(process_set=0), TypeError, "process_set must be a ProcessSet of the backend"),
    (dict(groups=-1), ValueError, "groups must be a positive number"),
    (dict(groups="all"), ValueError, "groups should be a positive int"),
    (dict(groups=2, layers=lambda n: n), ValueError, "either groups .* or layers"),
])
def test_bad_arguments(kwargs, exc, pattern):
    assert_construction_fails(exc, pattern, **kwargs)


def test_bad_optimizer_type():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        hvd.DistributedOptimizer(object())


def test_named_parameters_must_be_name_tensor_pairs():
    m = MLP()
    with pytest.raises(ValueError, match="named_parameters should be a sequence"):
        hvd.DistributedOptimizer(sgd(m), named_parameters=list(m.parameters()))


def test_parameters_without_names():
    m = MLP()
    partial = [(n, p) for n, p in m.named_parameters() if not n.startswith("out")]
    with pytest.raises(ValueError, match=r"were not named: param_groups position 4 \(shape \(4, 16\)\)"):
        hvd.DistributedOptimizer(sgd(m), named_parameters=partial)


def test_duplicate_names():
    m = MLP()
    dup = [("w", p) for _, p in m.named_parameters()]
    with pytest.raises(ValueError, match="Found duplicates: w"):
        hvd.DistributedOptimizer(sgd(m), named_parameters=dup)


def test_double_wrap_refused():
    m = MLP()
    opt = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters())
    with pytest.raises(ValueError, match="already wrapped"):
        hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters())


def test_a_second_wrap_of_the_same_parameters_takes_them_over():
    """Rebuilding the optimizer (to load a checkpoint, say) hands the parameters to the new
    wrapper: the earlier one's hooks are removed -- both would fire on one backward, and the
    earlier one would then say to raise backward_passes_per_step, which is wrong -- and it
    refuses to step, naming why, rather than update with this rank's gradients alone."""
    m = MLP()
    first = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters())
    second = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters())
    before = copy.deepcopy(m.state_dict())
    for _ in range(2):  # the first wrapper's hooks would count the second backward
        second.zero_grad()
        m(torch.randn(8, 12)).square().mean().backward()
        second.step()
    assert any(not torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert first._hook_handles == [] and second.stats.total.step == 2
    with pytest.raises(RuntimeError, match="no longer synchronizes: a newer DistributedOptimizer"):
        first.step()
    second.close()
    with pytest.raises(RuntimeError, match="no longer synchronizes: it was closed"):
        second.step()


# -- drop-in behaviour -----------------------------------------------------------------------
def test_reexports_horovod_torch_api():
    """Horovod's names: its constants and classes as they are; the calls routed to the active
    backend (Horovod here) with Horovod's results; the rest of its API re-exported."""
    import horovod.torch as horovod_hvd
    hvd.init()
    for name in ("Compression", "Average", "Sum", "Adasum", "ProcessSet"):
        assert getattr(hvd, name) is getattr(horovod_hvd, name), name
    # every call is routed to the active engine (alltoall too); SyncBatchNorm is hvdsync's
    # own on either engine (it also takes CPU tensors: tests/test_torch_api.py)
    assert hvd.alltoall is not horovod_hvd.alltoall
    assert torch.equal(hvd.alltoall(torch.arange(4.0)), horovod_hvd.alltoall(torch.arange(4.0)))
    assert issubclass(hvd.SyncBatchNorm, torch.nn.modules.batchnorm._BatchNorm)
    assert hvd.SyncBatchNorm is not horovod_hvd.SyncBatchNorm
    # Elastic: Horovod's classes; run() resets hvdsync's optimizers too (hvdsync.torch.elastic)
    assert hvd.elastic.TorchState is horovod_hvd.elastic.TorchState
    assert hvd.elastic.ElasticSampler is horovod_hvd.elastic.ElasticSampler
    assert hvd.elastic.run is not horovod_hvd.elastic.run
    assert hvd.backend_name() == "horovod"
    for name in ("size", "rank", "local_rank", "local_size", "is_initialized"):
        assert getattr(hvd, name)() == getattr(horovod_hvd, name)(), name
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(hvd.allreduce(t, name="re"), horovod_hvd.allreduce(t, name="re2"))
    assert hvd.broadcast_object({"a": 1}, 0) == {"a": 1}
    assert hvd.global_process_set is horovod_hvd.global_process_set
    assert hvd.DistributedOptimizer is not horovod_hvd.DistributedOptimizer


def test_broadcast_optimizer_state_initialises_locally():
    m = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01),
                                   named_parameters=m.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state) == 6 and opt.stats.total.step == 0  # no hvdsync step was taken


def test_wrapper_is_the_wrapped_class_and_shares_state():
    m = MLP()
    base = sgd(m)
    opt = hvd.DistributedOptimizer(base, named_parameters=m.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    assert opt.param_groups is base.param_groups and opt.state is base.state
    assert [layer.name for layer in opt.layers] == ["fc1", "fc2", "out"]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = teacher_batches(0, 1)[0]
    torch.nn.functional.cross_entropy(m(x), y).backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_single_rank_equals_plain_optimizer_and_sends_nothing():
    torch.manual_seed(0)
    ref = MLP()
    ours = copy.deepcopy(ref)
    plain = torch.optim.Adam(ref.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(ours.parameters(), lr=0.01),
                                   named_parameters=ours.named_parameters())
    for x, y in teacher_batches(0, 5):
        for model, o in ((ref, plain), (ours, opt)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            o.step()
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a, b)
    assert opt.stats.total.step == 5 and opt.stats.total.bytes_sent == 0
    assert opt.stats.total.layers_sent == 5 * 3


def test_zero_grad_between_backward_and_step_is_refused_like_horovod():
    m = MLP()
    opt = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters())
    x, y = teacher_batches(0, 1)[0]
    torch.nn.functional.cross_entropy(m(x), y).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


def test_too_many_backward_passes_is_refused_like_horovod():
    m = MLP()
    opt = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters(),
                                   backward_passes_per_step=2)
    assert opt.backward_passes_per_step == 2  # (the hooks are the optimizer's: keep it alive)
    x, y = teacher_batches(0, 1)[0]
    for _ in range(2):
        torch.nn.functional.cross_entropy(m(x), y).backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        torch.nn.functional.cross_entropy(m(x), y).backward()


# -- multi-rank: stats and sparse gradients --------------------------------------------------
def stats_body(steps: int) -> dict:
    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    m = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    for x, y in teacher_batches(hvd.rank(), steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return dict(stats=opt.stats.as_dict(), summary=opt.stats.summary(),
                param_bytes=sum(p.numel() * p.element_size() for p in m.parameters()))


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's multi-rank cases, in the session's shared torch job (tests/conftest.py)."""
    return {"stats": (stats_body, 4), "sparse": (sparse_parity_body, False),
            "sparse_as_dense": (sparse_parity_body, True)} if np_ in REAL_NP else {}


@pytest.fixture(scope="module", params=REAL_NP, ids=REAL_NP_IDS)
def multi_rank_runs(request, torch_job):
    return torch_job(request.module, request.param)


def test_stats_count_bytes_collectives_and_layers(multi_rank_runs):
    steps = 4
    for res in multi_rank_runs["stats"]:
        s = res["stats"]
        assert s["total"]["step"] == steps
        assert s["last"]["bytes_sent"] == res["param_bytes"] == s["last"]["bytes_dense"]
        assert s["total"]["bytes_sent"] == steps * res["param_bytes"]
        assert s["last"]["collectives"] == 3  # one grouped allreduce per layer
        assert {k: v["sent"] for k, v in s["layers"].items()} == {"fc1": steps, "fc2": steps,
                                                                  "out": steps}
        summary = res["summary"]  # what ran, the steps, each layer's line
        assert re.match(r"hvdsync on horovod, [23] ranks; techniques: nothing", summary), summary
        assert re.search(r"^  steps +4$", summary, re.M) and re.search(r"^  fc2 +4 +0 ", summary,
                                                                     re.M), summary


class EmbedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, sparse=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(dim=1))


def sparse_parity_body(sparse_as_dense: bool) -> float:
    import horovod.torch as horovod_hvd

    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    ref = EmbedModel()
    ours = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(hvd.rank())
    opts = [(model, wrap(torch.optim.SGD(model.parameters(), lr=0.5),
                         named_parameters=model.named_parameters(),
                         sparse_as_dense=sparse_as_dense))
            for model, wrap in ((ref, horovod_hvd.DistributedOptimizer),
                                (ours, hvd.DistributedOptimizer))]
    batches = [(torch.randint(0, 50, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(10)]
    for model, opt in opts:
        for ids, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(ids), y).backward()
            opt.step()
    return max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters()))


@pytest.mark.parametrize("case", ["sparse", "sparse_as_dense"])
def test_sparse_gradients_match_horovod(multi_rank_runs, case):
    for diff in multi_rank_runs[case]:
        assert diff <= 1e-6
