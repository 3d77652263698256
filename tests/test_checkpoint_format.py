"""One checkpoint format for hvdsync's technique state, in both adapters (docs/checkpoints.md):
the same structure from torch's ``state_dict()`` and Keras' ``technique_state()``, clear
errors on a mismatch, and (torch, 2 and 3 ranks) a run restored mid-training -- into a fresh
optimizer, or into the same one -- continues exactly as the uninterrupted run."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tests.models import LOGIC_IDS, LOGIC_JOBS, job_group, logic_runs

OPTIONS = {
    "clip": dict(clip=dict(ema=(0.9, 2.0), warmup=1)),
    "threshold": dict(threshold=dict(threshold=1e9, max_skip=5)),
    "select": dict(select=dict(k=1, max_wait=3)),
    "lowrank": dict(lowrank=dict(rank=2, warmup_steps=1, min_compression=0)),
    "delay": dict(delay=dict(staleness=1, average_every=4)),
}


def _shape(x):
    """A state's structure: dict keys (recursively, with numeric memory keys collapsed),
    lists as their length class, leaves as a type name."""
    if isinstance(x, dict):
        if set(x) == {"value", "state"}:  # a sync point: the optimizer's state as the
            return "sync point"           # framework keeps it (torch: a dict; Keras: slots)
        keys = sorted(x)
        if keys and all(k.isdigit() for k in keys):  # per-parameter memory
            return {"<param>": _shape(x[keys[0]])}
        return {k: _shape(x[k]) for k in keys}
    if isinstance(x, (list, tuple)):
        return "list"
    return "value"


def torch_state(options: dict) -> dict:
    import torch

    import hvdsync.torch as hvd
    from tests.models import MLP, teacher_batches
    hvd.init()
    m = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=m.named_parameters(), **options)
    for x, y in teacher_batches(0, 3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return opt.state_dict()["hvdsync"]


def keras_state(options: dict) -> dict:
    import keras

    import hvdsync.keras as hvd
    from tests.keras_models import mlp, teacher_data
    hvd.init()
    m = mlp()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), **options)
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = teacher_data(0, 48)
    m.fit(x, y, batch_size=16, verbose=0)
    return opt.technique_state()


@pytest.mark.parametrize("technique", list(OPTIONS))
def test_same_structure_in_torch_and_keras(technique):
    t, k = torch_state(OPTIONS[technique]), keras_state(OPTIONS[technique])
    assert t["format"] == k["format"] == 1
    assert list(t["techniques"]) == list(k["techniques"]) == [technique]
    assert _shape(t["techniques"]) == _shape(k["techniques"])
    # the same model: 3 layers of (12x16 + 16), (16x16 + 16), (16x4 + 4) float32 parameters
    assert len(t["params"]) == len(k["params"]) == 6
    assert [s.split()[0] for s in t["params"]] == [
        "(16,", "(16,)", "(16,", "(16,)", "(4,", "(4,)"]  # torch weights are (out, in)
    if technique == "threshold":  # skipping: memory saved per parameter, per rank
        assert set(t["techniques"]["threshold"]["acc"]) == {str(i) for i in range(6)}
        assert set(k["techniques"]["threshold"]["acc"]) == {str(i) for i in range(6)}
        assert t["techniques"]["threshold"]["policy"] == k["techniques"]["threshold"]["policy"]
    if technique == "lowrank":  # every weight matrix (positions 0, 2, 4), not the biases
        for state in (t, k):
            assert set(state["techniques"]["lowrank"]["q"]) == {"0", "2", "4"}
            assert set(state["techniques"]["lowrank"]["err"]) == {"0", "2", "4"}
            assert state["techniques"]["lowrank"]["step"] == 3


def test_mismatches_fail_clearly():
    import torch

    import hvdsync.torch as hvd
    from tests.models import MLP
    hvd.init()
    state = torch_state(OPTIONS["threshold"])

    def fresh(model, **options):
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), **options)
    m = MLP()
    plain = torch.optim.SGD(m.parameters(), lr=0.1).state_dict()
    with pytest.raises(ValueError, match="not built with threshold="):
        fresh(m).load_state_dict({**plain, "hvdsync": state})
    other = MLP(hidden=8)
    with pytest.raises(ValueError, match="saved for 6 parameters.*first difference at "
                                         "parameter #0"):
        fresh(other, threshold=1.0).load_state_dict(
            {**torch.optim.SGD(other.parameters(), lr=0.1).state_dict(), "hvdsync": state})
    with pytest.raises(ValueError, match="format"):
        fresh(m, threshold=1.0).load_state_dict({**plain, "hvdsync": {**state, "format": 0}})


# -- resume on real ranks -------------------------------------------------------------------
def resume_body(options: dict, opt_name: str, same_process: bool) -> dict:
    """Train 8 steps, checkpoint, train 8 more; then restore the checkpoint (into a fresh
    model and optimizer, or into the same ones) and train the same 8 steps again."""
    import torch

    import hvdsync.torch as hvd
    from tests.models import MLP, teacher_batches
    hvd.init()
    torch.set_num_threads(1)
    batches = teacher_batches(hvd.rank(), 16)

    def make():
        torch.manual_seed(0)
        model = MLP()
        base = (torch.optim.Adam(model.parameters(), lr=0.01) if opt_name == "adam"
                else torch.optim.SGD(model.parameters(), lr=0.05,
                                     momentum=0.9 if opt_name == "momentum" else 0.0))
        return model, hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                               **options)

    def train(model, opt, part):
        for x, y in part:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    model, opt = make()
    train(model, opt, batches[:8])
    opt.flush()  # delay=: identical replicas before saving (a no-op otherwise)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    train(model, opt, batches[8:])
    final = [p.detach().clone() for p in model.parameters()]
    if same_process:
        model2, opt2 = model, opt
    else:
        model2, opt2 = make()
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    train(model2, opt2, batches[8:])
    diff = max(float((a - b).abs().max()) for a, b in zip(final, model2.parameters()))
    return dict(diff=diff, stats=opt2.stats.as_dict()["total"],
                final=[p.detach().numpy().copy() for p in model2.parameters()])


RESUME = {
    "threshold_momentum": (dict(threshold=dict(threshold=0.6, max_skip=4)), "momentum", False),
    "threshold_momentum_same_process": (dict(threshold=dict(threshold=0.6, max_skip=4)),
                                        "momentum", True),
    "threshold_adam": (dict(threshold=dict(threshold=0.6, max_skip=4)), "adam", False),
    "select_adam": (dict(select=dict(k=1, max_wait=3)), "adam", False),
    "clip_ema": (dict(clip=dict(ema=(0.9, 1.0), warmup=2)), "momentum", False),
}


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared torch job (tests/conftest.py)."""
    return job_group("logic", resume_body, RESUME) if np_ == 2 else {}


@pytest.fixture(scope="module", params=LOGIC_JOBS, ids=LOGIC_IDS)
def resumed(request):
    # Bit for bit needs the same summation order in both runs: with 3+ ranks Horovod's ring
    # sums an element in an order set by its place in the fusion buffer, which depends on
    # which tensors are ready together (timing); the shared job runs without fusion.
    return logic_runs(request, resume_body, RESUME)


def test_restored_run_continues_exactly(resumed):
    results = resumed
    for case, ranks in results.items():
        for rank, r in enumerate(ranks):
            assert r["diff"] == 0.0, f"{case} rank {rank}: differs by {r['diff']}"
        if case.startswith(("threshold", "select")):
            assert ranks[0]["stats"]["layers_skipped"] > 0, case  # memory was in play
        if case.startswith("select"):  # select's updates are global: identical replicas
            for other in ranks[1:]:
                for a, b in zip(ranks[0]["final"], other["final"]):
                    np.testing.assert_array_equal(a, b)
