"""A decider's traced form (hvdsync.core.kept_layers: what Keras' compiled train function builds
for threshold= and select=, with lowrank= beside or not), driven by hand on torch tensors in
process, against the eager step: the same plans, parameters and memory, bit for bit. The real-rank, both-adapter check
of the same form is tests/test_keras_compiled.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models import DeviceMemory, eager_or_traced_steps, float64_mlp, run_cases

HIDDEN = 32


def traced_decider_body(kind: str, cfg: dict, steps: int, nan_rank: int,
                        nan_step: int, lowrank: dict | None = None) -> dict:
    """The same float64 model and batches twice: the eager step, then
    :class:`hvdsync.core.kept_layers.KeptLayers` with blocking collectives (its memory in
    :class:`tests.models.DeviceMemory`). Parameters after every step, the plan each step ran
    with, the decider's status and memory. With ``lowrank``: that transport beside the
    decider, each sent layer's rounds built in the send branch (``trace_exchange``), its
    memory carried out of the branch (``staged``, ``restage``) and committed after the step,
    as Keras' compiled step does; its status and error feedback too."""
    import hvdsync.torch as hvd
    from hvdsync.core.kept_layers import KeptLayers
    from hvdsync.torch.optimizer import _DistributedOptimizer
    hvd.init()
    torch.set_num_threads(1)
    out = {}
    for mode in ("eager", "traced"):
        model, opt = float64_mlp(HIDDEN, **{kind: cfg},
                                 **({"lowrank": lowrank} if lowrank else {}))
        t, params, plans = opt.techniques[kind], list(model.parameters()), []
        g, comm, ops, n = t.grads, t.comm, t.ops, t.num_layers
        kept = (KeptLayers(t, g, ops, DeviceMemory(lambda key: torch.zeros_like(g._param[key])),
                           DeviceMemory(g.snapshot)) if mode == "traced" else None)
        lr = opt.techniques.get("lowrank")
        if lr is not None and mode == "traced":
            keyed = {key: g.param(li, k) for li in range(n)
                     for k, key in enumerate(g.param_keys(li))}
            lr.use_memory({name: DeviceMemory(lambda key, e=empty: torch.from_numpy(e[key]))
                           for name, empty in lr.memory_to_trace(keyed).items()})

        def send(li: int, ks: list[int], xs: list, flags: dict) -> tuple[list, list]:
            if lr is None:
                return comm.allreduce(f"hvdsync.traced.{li}", xs).wait(), []
            for k, x in enumerate(xs):  # what the layer held joined its gradient
                g.set(li, k, x)
            out = lr.trace_exchange(
                [(li, ks)], lambda name, ts: comm.allreduce(name, ts).wait(),
                lambda li, ts: comm.allreduce(f"hvdsync.{t.layer_names[li]}", ts).wait(),
                flags)[li]
            return out, lr.staged([(li, ks)], built=True)

        def traced(step_grads: list) -> None:
            for p, grad in zip(params, step_grads):
                p.grad = grad
            plan = torch.tensor(t.host_flags()["plan"])
            flags = ({k: torch.tensor(v) for k, v in lr.host_flags().items()}
                     if lr is not None else {})
            kept.begin([(li, list(range(g.size(li)))) for li in range(n)])
            layers, held_norms, bads, applied = [], [], [], []
            for li in range(n):
                ks = list(range(g.size(li)))
                local = [g.get(li, k) for k in ks]
                reduced, held, bad, staged = kept.exchange(
                    li, ks, local, plan[li],
                    lambda xs, li=li, ks=ks: send(li, ks, xs, flags),
                    lambda li=li, ks=ks: lr.staged([(li, ks)], built=False) if lr else [])
                if lr is not None:
                    lr.restage([(li, ks)], staged, plan[li])
                layers.append((li, ks, local))
                held_norms.append(held)
                bads.append(bad)
                applied += reduced
                for k, r in zip(ks, reduced):
                    g.set(li, k, r)
            shared, local_values, ok = kept.control(
                layers, held_norms, bads, applied,
                lambda name, v: torch.tensor(comm.control(v.tolist(), name),
                                             dtype=torch.float64))
            if lr is not None:
                lr.trace_commit(ok)
            put_back = kept.commit(layers, plan, ok)
            if bool(ok):
                super(_DistributedOptimizer, opt).step()  # the wrapped optimizer's own
            put_back()
            kept.settle(bool(ok), shared.tolist(), local_values.tolist())
            if lr is not None:
                lr.end_traced_step(bool(ok))

        def step(step_grads: list) -> None:
            plans.append(list(t.host_flags()["plan"]))
            traced(step_grads)

        weights = eager_or_traced_steps(model, opt, hvd.rank(), steps, nan_rank, nan_step,
                                        step if mode == "traced" else None)
        if mode == "eager":  # the plans it ran with: replayed from the traced run's start
            plans = None
        memory = t.acc if kind == "threshold" else t.residual
        out[mode] = dict(weights=weights.numpy(), status=t.status(), plans=plans,
                         memory={k: v.numpy() for k, v in memory.items()},
                         anchors=sorted(t.anchor) if kind == "threshold" else None,
                         lowrank=None if lr is None else (
                             lr.status(), {k: v.numpy() for k, v in lr.err.items()}))
    return out


CASES = {
    # local steps from sync points; relative: the sync-point norms travel in the control
    "threshold_relative": ("threshold", dict(threshold=0.4, relative=True, max_skip=3), 12,
                           1, 6),
    # withheld layers; the hypernet's dots and their squares travel in the control
    "select_hypernet": ("select", dict(k=1, max_wait=2), 12, 0, 5),
    # lowrank= beside (Keras compiles the pair): warm-up ends at step 3, the NaN at step 7
    "threshold_lowrank": ("threshold", dict(threshold=0.6, max_skip=3), 12, 1, 7,
                          dict(rank=2, warmup_steps=3, min_compression=0)),
    "select_lowrank": ("select", dict(k=1, max_wait=2), 12, 0, 5,
                       dict(rank=1, warmup_steps=2, min_compression=0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_traced_decider_equals_the_eager_step(case):
    """In process (2 simulated ranks): the traced form gives the eager step's parameters bit
    for bit at every step, its memory (accumulations or residuals, sync points) and status;
    the layers were both sent and kept back, and the NaN step on one rank was skipped on
    both (committed nowhere); with lowrank= beside, its status and error feedback too."""
    runs = run_cases(traced_decider_body, 2, {case: CASES[case]}, timeout=120,
                     launcher="simulated")[case]
    for r in runs:
        eager, traced = r["eager"], r["traced"]
        np.testing.assert_array_equal(traced["weights"], eager["weights"])
        assert traced["status"] == eager["status"]
        assert traced["anchors"] == eager["anchors"]
        assert traced["memory"].keys() == eager["memory"].keys()
        for k, v in eager["memory"].items():
            np.testing.assert_array_equal(traced["memory"][k], v)
        plans = np.array(traced["plans"])
        assert plans.any() and not plans.all(), plans  # sent and kept back, both
        nan_step = CASES[case][4]  # skipped: the parameters stand still
        np.testing.assert_array_equal(traced["weights"][nan_step - 1],
                                      traced["weights"][nan_step - 2])
        if eager["lowrank"] is not None:  # compressing after warm-up, the NaN step uncounted
            (status, err), (traced_status, traced_err) = eager["lowrank"], traced["lowrank"]
            assert traced_status == status and status["step"] == CASES[case][2] - 1, status
            assert status["residual_norm"] > 0 and traced_err.keys() == err.keys()
            for k, e in err.items():
                np.testing.assert_array_equal(traced_err[k], e)
