"""The two adapters run one lifecycle: the same float64 model, data and options trained through
Keras' ``model.fit`` (real ranks) and through the torch wrapper (simulated ranks running the
torch adapter's own code, docs/testing.md) give the same parameters after every step (1e-9),
the same layers sent and kept each step, and the same counters -- for every technique and
allowed pair, and with a NaN on one rank.

The torch model stores its kernels as Keras does (``x @ kernel + bias``, kernel
``(in, out)``), so a technique that views a kernel as a matrix (``lowrank=``) or flattens it
(``delay=``'s int8 outer exchange) sees the same numbers in both."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from tests.models import run_cases

STEPS, BATCH = 10, 16
OUTER = dict(exchange_gradients=False, average_every=4, fragments=2, overlap=2, mix=0.5,
             compress="int8", outer_lr=0.7, outer_momentum=0.9)
LOWRANK = dict(rank=2, warmup_steps=2, min_compression=0)

#: name -> (options, optimizer, learning rate, rank whose second batch holds a NaN[, model:
#: "mlp" (default) or "emb_mlp", an embedding with row-sparse gradients]); learning
#: rates and momentum exact in float32 (Keras keeps a learning rate in a float32 variable and
#: casts the momentum through float32)
CASES = {
    "plain": ({}, "momentum_exact", 0.0625, None),
    "clip_local": (dict(clip=dict(max_norm=0.3)), "momentum_exact", 0.0625, None),
    "clip_global_ema": (dict(clip=dict(ema=(0.9, 1.0), warmup=2, mode="global")), "sgd", 0.125,
                        None),
    "threshold": (dict(threshold=dict(threshold=0.6, max_skip=3)), "momentum_exact", 0.0625, None),
    "threshold_relative": (dict(threshold=dict(threshold=0.0625, relative=True, max_skip=4)),
                           "sgd", 0.125, None),
    "threshold_global_clip": (dict(threshold=dict(threshold=0.5, scope="global", max_skip=2),
                                   clip=dict(max_norm=0.3)), "sgd", 0.125, None),
    "select_hypernet": (dict(select=dict(k=1, max_wait=2)), "momentum_exact", 0.0625, None),
    "select_budget_clip_global": (dict(select=dict(budget=0.4, selector="norm"),
                                       clip=dict(max_norm=0.2, mode="global")), "sgd", 0.125,
                                  None),
    "lowrank": (dict(lowrank=LOWRANK), "momentum_exact", 0.0625, None),
    "lowrank_clip": (dict(lowrank=LOWRANK, clip=dict(max_norm=0.3)), "sgd", 0.125, None),
    "lowrank_threshold": (dict(lowrank=LOWRANK, threshold=dict(threshold=0.6, max_skip=3)),
                          "sgd", 0.125, None),
    "lowrank_select": (dict(lowrank=LOWRANK, select=dict(k=2, selector="round_robin")),
                       "momentum_exact", 0.0625, None),
    # staleness 0: what arrives when cannot change the result
    "delay": (dict(delay=dict(staleness=0)), "sgd", 0.125, None),
    "delay_lowrank": (dict(delay=dict(staleness=0), lowrank=LOWRANK), "sgd", 0.125, None),
    # folded when due (Keras' default, compiled): the same steps fold the same global
    # gradients in both, whatever arrives when
    "delay_due": (dict(delay=dict(staleness=2, average_every=4, fold="due")), "momentum_exact",
                  0.0625, None),
    "delay_due_clip_nan": (dict(delay=dict(staleness=1, average_every=3, fold="due"),
                                clip=dict(max_norm=0.3)), "sgd", 0.125, 1),
    # lowrank= inside: compressed exchanges in flight across steps (Keras: compiled)
    "delay_due_lowrank": (dict(delay=dict(staleness=2, average_every=4, fold="due"),
                               lowrank=LOWRANK), "momentum_exact", 0.0625, None),
    "outer": (dict(delay=OUTER), "sgd", 0.125, None),
    "outer_fp32_overlap1": (dict(delay=dict(OUTER, compress="none", overlap=1)), "sgd", 0.125,
                            None),
    "outer_nan": (dict(delay=OUTER), "sgd", 0.125, 1),
    "plain_nan": ({}, "momentum_exact", 0.0625, 1),
    "clip_nan": (dict(clip=dict(max_norm=0.3)), "sgd", 0.125, 1),
    "threshold_nan": (dict(threshold=dict(threshold=0.6, max_skip=3)), "momentum_exact", 0.0625, 1),
    "select_nan": (dict(select=dict(k=1, max_wait=2)), "momentum_exact", 0.0625, 1),
    "sparse": (dict(sparse=True), "sgd", 0.125, None, "emb_mlp"),
    "sparse_dense_route": (dict(sparse=dict(dense_ratio=0)), "sgd", 0.125, None, "emb_mlp"),
    "sparse_threshold": (dict(sparse=True, threshold=dict(threshold=0.3, max_skip=3)),
                         "momentum_exact", 0.0625, None, "emb_mlp"),
    "sparse_select_clip": (dict(sparse=True, select=dict(k=1, max_wait=2),
                                clip=dict(max_norm=0.2)), "sgd", 0.125, None, "emb_mlp"),
    "sparse_lowrank": (dict(sparse=True, lowrank=LOWRANK), "sgd", 0.125, None, "emb_mlp"),
}
COUNTERS = ("layers_sent", "layers_skipped", "bytes_dense", "nonfinite_steps", "nonfinite")


def keras_case(options: dict, opt_name: str, lr: float, nan_rank, model: str = "mlp") -> dict:
    from tests.keras_models import fit_body
    r = fit_body(options, opt_name, lr, STEPS, BATCH, dtype="float64", nan_rank=nan_rank,
                 model=model)
    return dict(start=r["start"], weights=r["weights"], sent=r["sent"],
                stats=r["stats"]["total"], layers=r["layers"], delay=r["delay"],
                iterations=r["iterations"])


def torch_case(start: dict, options: dict, opt_name: str, lr: float, nan_rank,
               model_name: str = "mlp") -> dict:
    """The Keras case's model in torch (kernels as Keras stores them; an embedding with
    sparse gradients), trained on the same batches from the same start."""
    import torch
    from torch import nn

    import hvdsync.torch as hvd
    from tests.keras_models import teacher_data, token_data

    class Dense(nn.Module):
        def __init__(self, name: str, activation: bool):
            super().__init__()
            self.kernel = nn.Parameter(torch.tensor(start[f"{name}/kernel"]))
            self.bias = nn.Parameter(torch.tensor(start[f"{name}/bias"]))
            self.activation = activation

        def forward(self, x):
            y = x @ self.kernel + self.bias
            return torch.tanh(y) if self.activation else y

    class Embedding(nn.Module):  # then the mean over the bag (GlobalAveragePooling1D)
        def __init__(self):
            super().__init__()
            self.embeddings = nn.Parameter(torch.tensor(start["emb/embeddings"]))

        def forward(self, ids):
            return nn.functional.embedding(ids, self.embeddings, sparse=True).mean(dim=1)

    hvd.init()
    layers = ([("fc1", Dense("fc1", True)), ("fc2", Dense("fc2", True)),
               ("out", Dense("out", False))] if model_name == "mlp" else
              [("emb", Embedding()), ("fc", Dense("fc", True)), ("head", Dense("head", False))])
    model = nn.Sequential(OrderedDict(layers))
    base = {"sgd": lambda: torch.optim.SGD(model.parameters(), lr=lr),
            "momentum_exact": lambda: torch.optim.SGD(model.parameters(), lr=lr,
                                                      momentum=0.875)}
    opt = hvd.DistributedOptimizer(base[opt_name](), named_parameters=model.named_parameters(),
                                   **options)
    x, y = (teacher_data(hvd.rank(), STEPS * BATCH) if model_name == "mlp"
            else token_data(hvd.rank(), STEPS * BATCH))
    if nan_rank is not None and hvd.rank() == nan_rank:
        x = x.copy()
        x[BATCH + 1, 0] = np.nan  # as the Keras body does: the second batch's gradient
    x = torch.tensor(x, dtype=torch.float64 if model_name == "mlp" else torch.long)
    y = torch.tensor(y, dtype=torch.long)
    weights, sent, before = [], [], {}
    for s in range(STEPS):
        lo = s * BATCH
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[lo:lo + BATCH]), y[lo:lo + BATCH]).backward()
        opt.step()
        weights.append({name.replace(".", "/"): p.detach().numpy().copy()
                        for name, p in model.named_parameters()})
        now = {n: c.sent for n, c in opt.stats.layers.items()}
        sent.append([n for n in now if now[n] > before.get(n, 0)])
        before = now
    return dict(weights=weights, sent=sent, stats=opt.stats.as_dict()["total"],
                layers=list(opt.stats.layers))


def shared_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """The Keras side, in the session's shared rank job (tests/conftest.py)."""
    return {name: (keras_case, *args) for name, args in CASES.items()} if np_ == 2 else {}


@pytest.fixture(scope="module")
def runs(request, shared_job):
    keras = shared_job(request.module, 2)
    torch_cases = {name: (keras[name][0]["start"], *args) for name, args in CASES.items()}
    return keras, run_cases(torch_case, 2, torch_cases, timeout=600, launcher="simulated")


@pytest.mark.parametrize("case", list(CASES))
def test_torch_and_keras_agree_step_for_step(runs, case):
    keras, torch = runs
    for rank, (k, t) in enumerate(zip(keras[case], torch[case])):
        assert k["layers"] == t["layers"]
        assert t["sent"] == k["sent"], f"rank {rank}: layers sent per step differ"
        for step, (a, b) in enumerate(zip(t["weights"], k["weights"])):
            for name in b:
                np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-9,
                                           err_msg=f"{case} rank {rank} step {step} {name}")
        for counter in COUNTERS:
            if counter == "bytes_dense" and "sparse" in CASES[case][0]:
                continue  # Horovod's sparse path sends int64 indices in torch, int32 in Keras
            assert t["stats"].get(counter, 0) == k["stats"].get(counter, 0), (rank, counter)
    if CASES[case][0]:  # the technique did something: not every layer sent every step
        sent = [n for step in keras[case][0]["sent"] for n in step]
        kept = CASES[case][0].keys() & {"threshold", "select"}
        assert not kept or len(sent) < 3 * STEPS, "expected layers kept back"
    nan_rank = CASES[case][3]
    if nan_rank is not None:
        _check_nan_on_one_rank(case, keras[case], nan_rank)
    if case.startswith("outer"):  # fc1 and fc2 in one fragment, out in the other
        assert keras[case][0]["delay"]["outer"]["fragments"] == [[0, 1], [2]]
        assert keras[case][0]["stats"]["outer_bytes"] > 0


def _check_nan_on_one_rank(case: str, ranks: list, nan_rank: int) -> None:
    """What the torch comparison alone would not catch (NaN equals NaN there): every weight
    finite; a synchronous step non-finite on one rank skipped on every rank, uncounted by
    Keras' ``iterations`` (its LossScaleOptimizer's convention) and counted once; global
    updates leave the ranks equal; ``clip=`` counts the bad rank's non-finite layers there
    only (as torch does, on the skipped step too); ``delay=`` puts zeros in place of the NaN
    on that rank and counts them there only (once with local steps; exchanging, per layer)."""
    options = CASES[case][0]
    for r in ranks:
        assert all(np.isfinite(w).all() for step in r["weights"] for w in step.values())
        if "delay" not in options:
            assert r["iterations"] == STEPS - 1 and r["stats"]["nonfinite_steps"] == 1, case
    if not options.keys() & {"delay", "threshold"}:  # every step's update is global
        for other in ranks[1:]:
            for name, w in ranks[0]["weights"][-1].items():
                np.testing.assert_array_equal(other["weights"][-1][name], w)
    if "clip" in options and "delay" not in options:
        assert [r["stats"].get("nonfinite", 0) > 0 for r in ranks] == \
            [rank == nan_rank for rank in range(len(ranks))]
    if "delay" in options:
        local_steps = not options["delay"].get("exchange_gradients", True)
        bad = ranks[nan_rank]["stats"].get("nonfinite", 0)
        assert bad == 1 if local_steps else bad > 0
        assert ranks[1 - nan_rank]["stats"].get("nonfinite", 0) == 0
