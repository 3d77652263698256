"""``delay=``'s outer synchronization (torch, 2 and 3 real ranks, different data per rank):
DiLoCo's outer optimizer on the pseudo-gradient, streamed in fragments that overlap the next
inner steps, compressed (hvdsync/techniques/outer/, docs/delay.md).

Each claim is checked against something written independently of hvdsync's pipeline: plain
parameter averaging (post-local SGD), Horovod's own DistributedOptimizer, and Streaming
DiLoCo written out with blocking collectives and torch's own Nesterov SGD as the outer
optimizer (as torchft does)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from hvdsync import DelayConfig
from hvdsync.core.wire import CODECS
from hvdsync.techniques.outer.technique import fragment_layers, start_offsets
from hvdsync.testing import run_ranks
from tests.models import (LOGIC_IDS, LOGIC_JOBS, MLP, REAL_NP, REAL_NP_IDS, DeviceMemory,
                          assert_construction_fails, eager_or_traced_steps, job_group,
                          logic_runs, run_cases, teacher_batches)

STEPS = 13


class Reference:
    """Streaming DiLoCo written out plainly on one rank: blocking allreduces of float32...64
    pseudo-gradients at the start step, the outer step with ``torch.optim.SGD`` on a copy of
    the anchors, the merge ``tau`` steps later. ``lr = 1, mu = 0, mix = 0``: plain parameter
    averaging (post-local SGD's ``PeriodicModelAverager``)."""

    def __init__(self, layers: list[list[torch.Tensor]], cfg: DelayConfig,
                 fragments: list[list[int]]):
        import hvdsync.torch as hvd  # Horovod's blocking allreduce, on the job's backend
        self.hvd, self.cfg = hvd, cfg
        self.frags = [[p for li in f for p in layers[li]] for f in fragments]
        self.anchor = [[p.detach().clone().requires_grad_() for p in f] for f in self.frags]
        self.outer = [torch.optim.SGD(a, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                                      nesterov=cfg.nesterov and cfg.outer_momentum > 0)
                      for a in self.anchor]
        self.offsets = start_offsets(cfg.average_every, cfg.fragments)
        self.due: dict[int, tuple[int, list[torch.Tensor]]] = {}

    @property
    def plain(self) -> bool:
        c = self.cfg
        return c.outer_lr == 1 and c.outer_momentum == 0 and c.mix == 0 and c.overlap == 0

    def after_step(self, step: int) -> None:
        for f in sorted(self.due):
            if self.due[f][0] <= step:
                self._merge(f, self.due.pop(f)[1])
        for f, o in enumerate(self.offsets):
            if step % self.cfg.average_every != o:
                continue
            if self.plain:
                for i, p in enumerate(self.frags[f]):
                    p.data.copy_(self.hvd.allreduce(p.detach(), name=f"ref.avg.{f}.{i}"))
                continue
            avg = [self.hvd.allreduce((a - p).detach(), name=f"ref.{f}.{i}")
                   for i, (a, p) in enumerate(zip(self.anchor[f], self.frags[f]))]
            self.due[f] = (step + self.cfg.overlap, avg)
            if self.cfg.overlap == 0:
                self._merge(f, self.due.pop(f)[1])

    def _merge(self, f: int, avg: list[torch.Tensor]) -> None:
        for a, d in zip(self.anchor[f], avg):
            a.grad = d
        self.outer[f].step()
        with torch.no_grad():
            for a, p in zip(self.anchor[f], self.frags[f]):
                p.copy_(a + self.cfg.mix * (p - a))


def reference_body(cfg: dict, inner: str, steps: int) -> dict:
    """hvdsync's delay=cfg and the reference, side by side on the same rank from the same
    weights and batches (float64); per step the largest difference of the parameters."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    config = DelayConfig.coerce(cfg)
    ours, theirs = MLP().double(), MLP().double()
    torch.manual_seed(0)
    ours = MLP().double()
    theirs.load_state_dict(ours.state_dict())

    def make(m):
        return (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) if inner == "momentum"
                else torch.optim.Adam(m.parameters(), lr=0.01))
    opt = hvd.DistributedOptimizer(make(ours), named_parameters=ours.named_parameters(),
                                   delay=config)
    base = make(theirs)
    layers = [[m.weight, m.bias] for m in (theirs.fc1, theirs.fc2, theirs.out)]
    ref = Reference(layers, config, fragment_layers([sum(p.numel() for p in ps) for ps in layers],
                                                    config.fragments))
    diffs, merged = [], []
    for step, (x, y) in enumerate(teacher_batches(hvd.rank(), steps), start=1):
        for model, o in ((ours, opt), (theirs, base)):
            o.zero_grad()
            nn.functional.cross_entropy(model(x.double()), y).backward()
            o.step()
        ref.after_step(step)
        merged.append(opt.delay_status["outer"]["last_merged"])
        diffs.append(max((a - b).abs().max().item()
                         for a, b in zip(ours.parameters(), theirs.parameters())))
    return dict(diffs=diffs, merged=merged, stats=opt.stats.as_dict()["total"],
                fragments=opt.delay_status["outer"]["fragments"])


REFERENCE_CASES = {
    # post-local SGD's averaging (outer lr 1, no momentum) every 4 steps
    "averaging": (dict(exchange_gradients=False, average_every=4), "momentum", STEPS),
    # DiLoCo: Nesterov outer SGD, one fragment, the step waits for its exchange
    "diloco": (dict(exchange_gradients=False, average_every=4, outer_lr=0.7,
                    outer_momentum=0.9), "adam", STEPS),
    "diloco_k3": (dict(exchange_gradients=False, average_every=3, outer_lr=0.7,
                       outer_momentum=0.9), "adam", STEPS),
    # Streaming DiLoCo: 2 fragments staggered, merged one step late, half local
    "streaming": (dict(exchange_gradients=False, average_every=4, fragments=2, overlap=1,
                       mix=0.5, outer_lr=0.7, outer_momentum=0.9), "momentum", STEPS),
    # 3 fragments, two steps late, heavy-ball outer momentum, a quarter local
    "streaming_heavy_ball": (dict(exchange_gradients=False, average_every=6, fragments=3,
                                  overlap=2, mix=0.25, outer_lr=0.5, outer_momentum=0.8,
                                  nesterov=False), "adam", STEPS),
}


@pytest.fixture(scope="module", params=LOGIC_JOBS, ids=LOGIC_IDS)
def reference_runs(request):
    return logic_runs(request, reference_body, REFERENCE_CASES, group="reference")


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_equals_the_reference_step_for_step(reference_runs, case):
    for rank, r in enumerate(reference_runs[case]):
        assert max(r["diffs"]) <= 1e-10, (case, rank, r["diffs"])


def test_streaming_merges_each_fragment_on_its_own_schedule(reference_runs):
    """K=4, 2 fragments ([fc1, fc2], [out] by bytes), tau 1: fragment 0 starts after steps
    2, 6, 10 and merges after 3, 7, 11; fragment 1 starts after 4, 8, 12, merges after 5, 9,
    13; each exchange carries its own fragment's float64 bytes only."""
    for r in reference_runs["streaming"]:
        assert r["fragments"] == [[0, 1], [2]]
        merged = {t: m for t, m in enumerate(r["merged"], start=1) if m}
        assert merged == {3: [0], 5: [1], 7: [0], 9: [1], 11: [0], 13: [1]}, merged
        sizes = [(12 * 16 + 16 + 16 * 16 + 16) * 8, (16 * 4 + 4) * 8]
        assert r["stats"]["outer_bytes"] == 3 * sizes[0] + 3 * sizes[1]
        # merges happen after the update, once the step's stats are closed: the sixth (after
        # step 13) counts with step 14
        assert r["stats"]["outer_started"] == 6 and r["stats"]["outer_merged"] == 5


# -- K = 1 is Horovod -----------------------------------------------------------------------
def horovod_body(cfg: dict, momentum: float, steps: int, passes: int = 1) -> float:
    """hvdsync's delay=cfg and horovod.torch.DistributedOptimizer on the same rank, the same
    weights and batches (float64), ``passes`` backward passes per step: the largest parameter
    difference at the end."""
    import horovod.torch as horovod

    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    ours = MLP().double()
    theirs = MLP().double()
    theirs.load_state_dict(ours.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1, momentum=momentum),
                                   named_parameters=ours.named_parameters(), delay=cfg,
                                   backward_passes_per_step=passes)
    ref = horovod.DistributedOptimizer(torch.optim.SGD(theirs.parameters(), lr=0.1,
                                                       momentum=momentum),
                                       named_parameters=theirs.named_parameters(),
                                       backward_passes_per_step=passes)
    batches = teacher_batches(hvd.rank(), steps * passes)
    for step in range(steps):
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            for x, y in batches[step * passes:(step + 1) * passes]:
                nn.functional.cross_entropy(model(x.double()), y).backward()
            o.step()
    return max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))


K1 = dict(exchange_gradients=False, average_every=1)
HOROVOD_CASES = {"sgd": (K1, 0.0, 10, 1), "momentum": (K1, 0.9, 10, 1),
                 "momentum_2_passes": (K1, 0.9, 10, 2)}


@pytest.fixture(scope="module", params=REAL_NP, ids=REAL_NP_IDS)
def horovod_runs(request, torch_job):
    return torch_job(request.module, request.param, "horovod")


@pytest.mark.parametrize("case", list(HOROVOD_CASES))
def test_k1_outer_lr_1_equals_horovod(horovod_runs, case):
    """K=1, outer lr 1, no outer momentum, local steps only: the parameter change of one SGD
    step averaged is the averaged gradient's step (momentum too: it is linear); with gradient
    accumulation the local step takes the summed passes, as Horovod's allreduce does."""
    for diff in horovod_runs[case]:
        assert diff <= 1e-10, diff


# -- compression, non-finite, flush ---------------------------------------------------------
def compressed_body(cfg: dict, steps: int, nan_rank: int = -1, nan_step: int = -1) -> dict:
    """Train float32 with delay=cfg; ``nan_rank`` feeds NaN inputs at ``nan_step``. Loss at
    the start and end, every rank's parameters after flush()."""
    import hvdsync.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), delay=cfg)
    # Horovod's habit; its state-initializing step skips synchronize() and must not start an
    # outer exchange (a fragment whose offset is 0 did, at "step 0", before any anchor)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    losses = []
    for step, (x, y) in enumerate(teacher_batches(hvd.rank(), steps), start=1):
        if hvd.rank() == nan_rank and step == nan_step:
            x = x * float("nan")
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    total = opt.stats.as_dict()["total"]
    residuals = len(opt._pipeline.by_name["outer"].residual)
    in_flight = opt.delay_status["outer"]["in_flight"]
    dropped = opt.flush()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = hvd.allgather(params.unsqueeze(0), name="outer.params")
    return dict(losses=losses, total=total, residuals=residuals, in_flight=in_flight,
                dropped=dropped, spread=(gathered - gathered[0]).abs().max().item(),
                finite=bool(torch.isfinite(params).all()))


N_PARAMS = [12 * 16 + 16 + 16 * 16 + 16, 16 * 4 + 4]  # the two fragments' values
COMPRESSED = {
    "int8": (dict(exchange_gradients=False, average_every=4, fragments=2, overlap=1, mix=0.5,
                  compress="int8", outer_lr=0.7, outer_momentum=0.9), 60),
    "bf16": (dict(exchange_gradients=False, average_every=4, fragments=2, overlap=2,
                  compress="bf16", outer_lr=0.7, outer_momentum=0.9), 60),
    "fp16": (dict(exchange_gradients=False, average_every=4, fragments=2, compress="fp16"), 60),
    "int8_no_feedback": (dict(exchange_gradients=False, average_every=4, fragments=2,
                              overlap=1, mix=0.5, compress="int8", outer_lr=0.7,
                              outer_momentum=0.9, error_feedback=False), 60),
    "nan": (dict(exchange_gradients=False, average_every=4, fragments=2, overlap=1, mix=0.5,
                 compress="int8", outer_lr=0.7, outer_momentum=0.9), 20, 1, 6),
    # the seed's stale global gradient every step, plus the outer step every K
    "stale_and_outer": (dict(staleness=1, average_every=4, outer_lr=0.7, outer_momentum=0.9),
                        20),
}


@pytest.fixture(scope="module", params=LOGIC_JOBS, ids=LOGIC_IDS)
def compressed_runs(request):
    return logic_runs(request, compressed_body, COMPRESSED, group="compressed")


def torch_job_cases(np_: int, directory: str) -> dict[str, tuple]:
    """This file's cases in the session's shared torch job (tests/conftest.py)."""
    cases = job_group("horovod", horovod_body, HOROVOD_CASES)
    if np_ == 2:
        cases.update(job_group("reference", reference_body, REFERENCE_CASES))
        cases.update(job_group("compressed", compressed_body, COMPRESSED))
    return cases


@pytest.mark.parametrize("case", list(COMPRESSED))
def test_flush_leaves_identical_finite_replicas(compressed_runs, case):
    for r in compressed_runs[case]:
        assert r["spread"] == 0.0 and r["finite"], (case, r["spread"])


@pytest.mark.parametrize("case,per_value,scales", [("int8", 1, True), ("bf16", 2, False),
                                                   ("fp16", 2, False)])
def test_compressed_exchange_bytes_and_error_feedback(compressed_runs, case, per_value, scales):
    """60 steps, K=4: each fragment exchanged 15 times (fragment 1's last one starts after
    step 60's update, so it counts with step 61); int8 carries one byte per value and a
    float32 scale per 1024 values, bf16/fp16 two bytes; what compression lost is kept."""
    for r in compressed_runs[case]:
        size = [n * per_value + (4 * math.ceil(n / CODECS["int8"].chunk) if scales else 0)
                for n in N_PARAMS]
        assert r["total"]["outer_bytes"] == 15 * size[0] + 14 * size[1], r["total"]
        assert r["total"]["bytes_sent"] == r["total"]["outer_bytes"]  # nothing else is sent
        assert r["residuals"] == 6  # every parameter has its error-feedback residual


@pytest.mark.parametrize("case", ["int8", "bf16", "fp16"])
def test_compressed_training_converges(compressed_runs, case):
    for r in compressed_runs[case]:
        first, last = np.mean(r["losses"][:5]), np.mean(r["losses"][-5:])
        assert last < 0.6 * first, (case, first, last)


def test_without_error_feedback_nothing_is_kept(compressed_runs):
    """``error_feedback=False``: the same int8 bytes, no residual kept, replicas identical
    after flush (above), and it still learns."""
    for r, with_feedback in zip(compressed_runs["int8_no_feedback"], compressed_runs["int8"]):
        assert r["residuals"] == 0
        assert r["total"]["outer_bytes"] == with_feedback["total"]["outer_bytes"]
        assert np.mean(r["losses"][-5:]) < 0.6 * np.mean(r["losses"][:5])


def test_nan_on_one_rank_is_not_spread(compressed_runs):
    """Rank 1's gradients are NaN at step 6: it steps on zeros (counted once: local steps
    check the step's gradients together), its pseudo-gradient
    stays finite, and every rank ends finite and identical after flush()."""
    for rank, r in enumerate(compressed_runs["nan"]):
        assert r["finite"] and r["spread"] == 0.0
        assert r["total"].get("nonfinite", 0) == (1 if rank == 1 else 0), r["total"]
        assert r["total"].get("outer_nonfinite", 0) == 0


# -- the local step's traced moments (what Keras' compiled function runs), here in torch ------
def traced_moments_body(cfg: dict, steps: int, nan_rank: int, nan_step: int) -> dict:
    """The same float64 model and batches twice: the eager step (``backward``, ``step()``),
    then the moments a tracing adapter runs instead (StepPipeline.local_step: the transport's
    ``trace_local`` on every layer -- its memory in dicts, its host flags as tensors, blocking
    collectives --, ``before_local_update`` before the update where the pipeline's ``host_before_update``
    asks, else after it, the traced form's ``end_local_step``, the step's statistics closed,
    ``after_local_update``). The parameters after every step, the counters."""
    import hvdsync.torch as hvd
    from hvdsync.torch.optimizer import _DistributedOptimizer
    hvd.init()
    torch.set_num_threads(1)
    out = {}
    for mode in ("eager", "traced"):
        torch.manual_seed(0)
        model = MLP().double()
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), delay=cfg)
        params, pipeline, before_asked = list(model.parameters()), opt._pipeline, []
        grads_of, t = pipeline.grads, pipeline.local_step
        layer_params = [[p for _, p in ps] for ps in grads_of.layer_params]
        memory = t.memory_to_trace({key: p.detach() for li, ps in enumerate(layer_params)
                                    for key, p in zip(grads_of.param_keys(li), ps)})
        if memory and mode == "traced":  # (what tells the technique its steps are traced)
            t.use_memory({name: DeviceMemory(lambda key, v=values: torch.from_numpy(v[key]))
                          for name, values in memory.items()})

        def reduce(li: int, name: str, xs: list) -> list:  # (torch's reduces in place)
            return pipeline.comm.allreduce(name, [x.clone() for x in xs]).wait()

        def traced(step_grads: list) -> None:
            by_param = {id(p): g for p, g in zip(params, step_grads)}
            layers = [(li, list(range(len(ps))), [by_param[id(p)] for p in ps])
                      for li, ps in enumerate(layer_params)]
            flags = {k: torch.tensor(v) for k, v in t.host_flags().items()}
            out, bad = t.traced.trace_local(layers, reduce, flags)
            for ps, gs in zip(layer_params, out):
                for p, g in zip(ps, gs):
                    p.grad = g
            before = pipeline.host_before_update()
            before_asked.append(before)
            if before:
                pipeline.before_local_update()
            super(_DistributedOptimizer, opt).step()  # the wrapped optimizer's own
            if not before:
                pipeline.before_local_update()
            t.traced.end_local_step(int(bad))
            opt.stats.end_step()
            pipeline.after_local_update()
        weights = eager_or_traced_steps(model, opt, hvd.rank(), steps, nan_rank, nan_step,
                                        traced if mode == "traced" else None)
        total = opt.stats.as_dict()["total"]
        opt.flush()  # (nothing left in flight before the next mode's exchanges)
        out[mode] = dict(weights=weights.numpy(), total=total, before_asked=before_asked)
    return out


TRACED = {
    "diloco_nan": (dict(exchange_gradients=False, average_every=4, outer_lr=0.7,
                        outer_momentum=0.9), 12, 1, 3),
    "streaming_int8": (dict(exchange_gradients=False, average_every=4, fragments=2, overlap=1,
                            mix=0.5, compress="int8", outer_lr=0.7, outer_momentum=0.9),
                       12, -1, -1),
    # exchanging every step's gradient, folded when due: g(t-1) exchanged in step t, the
    # corrections held until their turn, drains and averaging every K steps
    "stale2_due_nan": (dict(staleness=2, average_every=5, fold="due"), 12, 1, 3),
}


@pytest.mark.parametrize("case", list(TRACED))
def test_the_traced_local_step_moments_equal_the_eager_step(case):
    """In process (2 simulated ranks): the moments Keras' compiled local step runs give the
    eager step's parameters bit for bit and its counters; the host call before the update
    is asked for on the first step only (the anchors)."""
    runs = run_cases(traced_moments_body, 2, {case: TRACED[case]}, timeout=120,
                     launcher="simulated")[case]
    exchanging = TRACED[case][0].get("exchange_gradients", True)
    for rank, r in enumerate(runs):
        # exchanging: the same sums in another order (a correction G - g formed first)
        np.testing.assert_allclose(r["traced"]["weights"], r["eager"]["weights"], rtol=0,
                                   atol=1e-12 if exchanging else 0)
        # (bytes_dense, and an exchanging step's bytes_sent: the adapter's count of what
        # Horovod sends, not a moment's)
        for counter in ("step", "outer_started", "outer_merged", "outer_bytes", "nonfinite",
                        "averaged", "staleness_2") + (() if exchanging else ("bytes_sent",)):
            assert r["traced"]["total"].get(counter) == r["eager"]["total"].get(counter), \
                (rank, counter)
        if exchanging:
            assert r["traced"]["before_asked"] == [False] * 12
            assert r["eager"]["total"]["staleness_2"] > 0 and r["eager"]["total"]["averaged"] == 2
        else:
            assert r["traced"]["before_asked"] == [True] + [False] * 11
            assert r["eager"]["total"]["outer_merged"] > 0
    if case.endswith("_nan"):  # rank 1 stepped on zeros once (exchanging: per layer)
        assert [r["traced"]["total"].get("nonfinite", 0) > 0 for r in runs] == [False, True]
    if case == "diloco_nan":
        assert runs[1]["traced"]["total"]["nonfinite"] == 1


def test_flush_merges_what_is_in_flight(compressed_runs):
    """bf16, tau 2: fragment 1's exchange started after step 60 (offsets: 2 and 0) is still in
    flight at the end; flush() merges it (returns 1) before averaging."""
    for r in compressed_runs["bf16"]:
        assert r["in_flight"] == [1] and r["dropped"] == 1


# -- the schedule and the configuration ------------------------------------------------------
def test_fragments_balance_bytes_in_layer_order():
    assert fragment_layers([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert fragment_layers([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]
    assert fragment_layers([1, 1, 1, 100], 2) == [[0, 1, 2], [3]]
    assert fragment_layers([5], 1) == [[0]]
    with pytest.raises(ValueError, match="fragments=3 needs 1..2"):
        fragment_layers([1, 1], 3)
    assert start_offsets(16, 4) == [4, 8, 12, 0] and start_offsets(8, 1) == [0]


def test_more_fragments_than_layers_means_one_per_layer():
    import hvdsync.torch as hvd
    hvd.init()
    m = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(), delay="streaming")
    assert opt.delay_status["outer"]["fragments"] == [[0], [1], [2]]


def test_presets():
    d = DelayConfig.coerce("diloco")
    assert (d.exchange_gradients, d.outer_lr, d.outer_momentum, d.nesterov, d.outer) == (
        False, 0.7, 0.9, True, True)
    s = DelayConfig.coerce("streaming")
    assert s.fragments > 1 and s.overlap >= 1 and s.compress == "int8"
    assert DelayConfig.diloco(average_every=64).average_every == 64
    assert not DelayConfig().outer  # the seed's scheme with plain averaging, as before


def ends_with_an_exchange_in_flight(steps: int) -> int:
    """Train without flush(); the last step starts an exchange. Rank 0 ends at once, the
    last rank takes its last step 2 s later."""
    import time

    import hvdsync.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    m = MLP()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(),
                                   delay=dict(exchange_gradients=False, average_every=2,
                                              overlap=1, compress="int8"))
    for i, (x, y) in enumerate(teacher_batches(hvd.rank(), steps)):
        if i == steps - 1 and hvd.rank() == hvd.size() - 1:
            time.sleep(2)
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return len(opt.delay_status["outer"]["in_flight"])


def test_a_script_may_end_with_an_exchange_in_flight():
    """At exit each rank finishes its in-flight exchanges before Horovod shuts down: without
    that, rank 0's exit shut Horovod down under the last rank, whose exchange then failed
    ("Horovod has been shut down") and the job with it."""
    assert run_ranks(ends_with_an_exchange_in_flight, np=2, args=(6,), timeout=120) == [1, 1]


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(delay="local"), ValueError, "delay preset must be one of"),
    (dict(delay=dict(outer_lr=0)), ValueError, "outer_lr must be in"),
    (dict(delay=dict(outer_momentum=1.0)), ValueError, "outer_momentum must be in"),
    (dict(delay=dict(mix=1.5)), ValueError, "mix must be in"),
    (dict(delay=dict(compress="int4")), ValueError, "compress must be one of"),
    (dict(delay=dict(fragments=0)), ValueError, "fragments must be an int >= 1"),
    (dict(delay=dict(fragments=4, average_every=2)), ValueError, "needs average_every >= fr"),
    (dict(delay=dict(overlap=8, average_every=8)), ValueError, "overlap=8 must be < average"),
    (dict(delay=dict(exchange_gradients=0)), TypeError, "exchange_gradients must be True or"),
    (dict(delay=dict(outer_lr=0.7, optimizer_state="average")), ValueError,
     "optimizer_state='average' is for plain"),
    (dict(delay="diloco", lowrank=2), ValueError, "which local steps turn off"),
])
def test_bad_config_fails_at_construction(kwargs, exc, pattern):
    assert_construction_fails(exc, pattern, **kwargs)
