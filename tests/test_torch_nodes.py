"""Nodes, not GPUs (``between="nodes"``, docs/nodes.md): the layout from the launcher, and on
real ranks -- 4 processes as 2 nodes x 2 (``HVDSYNC_RANKS_PER_NODE=2``), on horovodrun and
torchrun -- every technique run between the nodes on each node's gradient: identical replicas
after ``flush()``, nothing on equal to Horovod's average, the node's reduction in full
precision and the inter-node bytes one rank's; one rank per node is the flat exchange bit for
bit, one node Horovod's synchronous one."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from hvdsync.core.topology import OVERRIDE, Topology, from_environment
from tests.models import MLP, assert_construction_fails, run_job, teacher_batches

# -- the layout ---------------------------------------------------------------------------------


def test_the_layout_from_each_launcher_and_the_override():
    horovodrun = {"HOROVOD_LOCAL_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_CROSS_RANK": "1"}
    torchrun = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "GROUP_RANK": "2"}
    assert from_environment(8, 5, horovodrun) == Topology(8, 4)
    assert from_environment(6, 5, torchrun) == Topology(6, 2)
    assert from_environment(6, 5, {**torchrun, OVERRIDE: "3"}) == Topology(6, 3)
    assert from_environment(4, 3, {}) == Topology(4, 4)  # a lone host: one node
    t = Topology(6, 2)
    assert (t.nodes, t.two_level, t.node_of(3), t.local_rank_of(3)) == (3, True, 1, 1)
    assert t.node_ranks(1) == [2, 3] and t.cross_ranks(1) == [1, 3, 5]
    assert not Topology(4, 1).two_level and not Topology(4, 4).two_level


def test_unequal_nodes_and_other_layouts_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="nodes of equal size: 5 ranks do not make nodes of 2"):
        from_environment(5, 0, {OVERRIDE: "2"})
    with pytest.raises(ValueError, match="whole number"):
        from_environment(4, 0, {OVERRIDE: "two"})
    with pytest.raises(ValueError, match="laid out node by node; rank 1 is local rank 0 of "
                                         "node 1"):
        from_environment(4, 1, {"HOROVOD_LOCAL_SIZE": "2", "HOROVOD_LOCAL_RANK": "0",
                                "HOROVOD_CROSS_RANK": "1"})


def test_a_bad_between_is_refused_at_construction():
    assert_construction_fails(ValueError, "between must be 'nodes'", between="racks")


def test_two_levels_fold_when_due():
    """delay='s default fold becomes "due" with two levels (a node's ranks fold alike);
    "arrived" is refused with the reason; the other techniques are left as they are."""
    from hvdsync.core import rules
    configs = rules.configure(op="average", sparse_as_dense=False, delay=dict(staleness=2),
                              clip=1.0)
    two = rules.for_nodes(configs)
    assert two["delay"].fold == "due" and configs["delay"].fold == "auto"
    assert two["clip"] == configs["clip"]
    with pytest.raises(ValueError, match="fold='arrived' cannot run with between='nodes'"):
        rules.for_nodes(rules.configure(op="average", sparse_as_dense=False,
                                        delay=dict(staleness=2, fold="arrived")))


# -- on real ranks ------------------------------------------------------------------------------
STEPS = 12
#: case -> the optimizer's keywords (between="nodes" added)
CASES = {
    "nothing on": {},
    "clip": dict(clip=1.0),
    "threshold": dict(threshold=dict(threshold=0.5, max_skip=4)),
    "select": dict(select=dict(k=1)),
    "lowrank": dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0)),
    # staleness 2: at each averaging step several global gradients are due at once, some
    # arrived on one rank of a node and not on the other; their waits (and the owned results'
    # sharing inside the node) go in one order on every rank (11 steps: the last is local)
    "delay": dict(delay=dict(staleness=2, average_every=3), _steps=STEPS - 1),
    "streaming": dict(delay="streaming"),
    "fp16": dict(compression="fp16"),
    # a GradScaler (the node reduces unscaled gradients), and two backward passes a step
    "amp threshold": dict(threshold=dict(threshold=0.5, max_skip=4), _scaler=2.0 ** 10),
    "accumulated lowrank": dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0),
                                backward_passes_per_step=2),
    # a row-sparse table beside the MLP: its rows gathered (counts first), or summed dense
    "sparse": dict(sparse=dict(dense_ratio=math.inf, one_round=False), _model="embedded"),
    "sparse dense": dict(sparse=0, _model="embedded"),
}
SPARSE_CASES = ("sparse", "sparse dense")


class Embedded(nn.Module):
    """The MLP with a row-sparse table added to its input: each rank's batch touches rows of
    its own (``sparse=``'s rows on real ranks)."""

    def __init__(self):
        super().__init__()
        self.table = nn.EmbeddingBag(64, 12, mode="sum", sparse=True)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + self.table((x.abs() * 8).long().clamp(max=63)))


def trained(keywords: dict, between: str | None, nan_rank: int = -1) -> dict:
    """On a rank: STEPS steps (or ``_steps``) of the MLP on this rank's batches, then flush();
    its parameters, the first and last losses, and its bytes a step (between nodes, inside
    the node). ``nan_rank``: its loss is NaN at the sixth step."""
    import hvdsync.torch as hvd
    torch.manual_seed(0)
    kw = dict(keywords)
    model = Embedded() if kw.pop("_model", None) == "embedded" else MLP()
    if kw.pop("compression", None) == "fp16":
        kw["compression"] = hvd.Compression.fp16
    scale = kw.pop("_scaler", None)
    steps = kw.pop("_steps", STEPS)
    scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale,
                                                             growth_interval=10 ** 6)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), between=between,
                                   scaler=scaler, **kw)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    passes, losses = kw.get("backward_passes_per_step", 1), []
    for step, (x, y) in enumerate(teacher_batches(hvd.rank(), steps)):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(passes), y.chunk(passes)):
            loss = nn.functional.cross_entropy(model(xs), ys)
            loss = loss * (float("nan") if step == 5 and hvd.rank() == nan_rank else 1.0)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is None:
            opt.step()
        else:
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    opt.flush()
    total = opt.stats.as_dict()["total"]
    return dict(params=torch.cat([p.detach().flatten() for p in model.parameters()]),
                before_flush=before,
                first=losses[0], last=losses[-1], summary=opt.stats.summary(),
                sent=total["bytes_sent"] / steps, dense=total["bytes_dense"] / steps,
                inside=total.get("bytes_intra_node", 0) / steps)


def nodes_body(cases: dict[str, dict], flat: tuple[str, ...], nan: tuple[str, ...] = ()
               ) -> dict:
    """Every case in turn on this rank: two-level; flat too for those in ``flat``; again with
    a NaN on rank 1 for those in ``nan``."""
    import hvdsync.torch as hvd
    hvd.init(process_sets=hvd.node_process_sets())
    out = {}
    for name, keywords in cases.items():
        out[name] = trained(keywords, "nodes")
        if name in flat:
            out[f"{name}, flat"] = trained(keywords, None)
    for name in [c for c in nan if c in cases]:
        out[f"{name}, NaN"] = trained(cases[name], "nodes", nan_rank=1)
    try:  # a choice from this rank's own timing would differ between a node's ranks
        trained(dict(delay=dict(staleness=1, fold="arrived")), "nodes")
    except ValueError as e:
        out["refused"] = str(e)
    return out


#: the cases run again with a NaN gradient on rank 1 (node 0) at one step
NAN_CASES = ("nothing on", "threshold", "delay", "streaming")
#: the cases run flat as well: the bytes a node sends between nodes against a flat rank's,
#: and nothing on's average against Horovod's
FLAT_CASES = ("nothing on", "lowrank", "fp16") + SPARSE_CASES


def identical(runs: list[dict], case: str) -> bool:
    return all(torch.equal(r[case]["params"], runs[0][case]["params"]) for r in runs)


@pytest.mark.parametrize("launcher", ["horovodrun", "torchrun"])
def test_two_nodes_of_two_ranks(launcher):
    cases = CASES if launcher == "horovodrun" else {k: CASES[k] for k in ("nothing on",
                                                                           "threshold",
                                                                           "delay",
                                                                           "streaming")}
    runs = run_job(nodes_body, 4, (cases, FLAT_CASES, NAN_CASES), timeout=600,
                   env={OVERRIDE: "2"}, launcher=launcher)
    for case in cases:
        assert identical(runs, case), case  # every rank of every node, after flush()
        # one replica per node: a node's ranks alike even before flush() (0, 1 and 2, 3)
        for a, b in ((0, 1), (2, 3)):
            assert torch.equal(runs[a][case]["before_flush"], runs[b][case]["before_flush"]), \
                (case, a, b)
        if case in ("delay", "streaming"):  # local steps between nodes: the nodes differ
            assert not torch.equal(runs[0][case]["before_flush"],
                                   runs[2][case]["before_flush"]), case
        assert runs[0][case]["last"] < runs[0][case]["first"], case  # it learns
        two = runs[0][case]
        # the node's gradient reduced in full precision: the dense bytes, every step (and what
        # another rank of the node sent, shared; a sparse table: its rows)
        assert two["inside"] >= two["dense"] > 0 or case in SPARSE_CASES, case
        assert "between='nodes': 2 nodes x 2 ranks" in two["summary"], two["summary"]
    for case in (f"{c}, NaN" for c in NAN_CASES if c in cases):  # skipped, or zeroed, alike
        assert identical(runs, case) and torch.isfinite(runs[0][case]["params"]).all(), case
    assert "delay= fold='arrived' cannot run with between='nodes'" in runs[0]["refused"]
    nothing = runs[0]["nothing on"]
    # nothing on: Horovod's average, summed in another order (inside the node first)
    torch.testing.assert_close(nothing["params"], runs[0]["nothing on, flat"]["params"],
                               rtol=1e-5, atol=1e-6)
    # between nodes a node sends what a rank of the flat job sends: one worker's bytes, the
    # collectives split between its ranks (each rank's its own share)
    for case in [c for c in ("nothing on", "lowrank", "fp16", "sparse dense") if c in cases]:
        for node in ((0, 1), (2, 3)):
            assert sum(runs[r][case]["sent"] for r in node) == pytest.approx(
                runs[0][f"{case}, flat"]["sent"], rel=1e-12), case
        assert 0 < runs[0][case]["sent"] < runs[0][f"{case}, flat"]["sent"], case
    assert runs[0]["nothing on, flat"]["sent"] == nothing["dense"]
    # sparse='s rows: the node's gradient holds its ranks' rows (each once), gathered by one
    # rank of the node at a time -- a node sends no more than its ranks did flat
    for case in [c for c in SPARSE_CASES if c in cases]:
        for node in ((0, 1), (2, 3)):
            assert all(runs[r][case]["sent"] > 0 for r in node), case
            assert sum(runs[r][case]["sent"] for r in node) <= sum(
                runs[r][f"{case}, flat"]["sent"] for r in node), case


def edge_body() -> dict:
    """One job's layout (the override the launcher gave): nothing on and a technique, each
    two-level and flat."""
    return nodes_body({"nothing on": {}, "threshold": CASES["threshold"]},
                      ("nothing on", "threshold"))


@pytest.mark.parametrize("per_node, what", [("1", "flat"), ("2", "one node")])
def test_one_rank_per_node_is_flat_and_one_node_is_horovods_step(per_node, what):
    """Two ranks: as two nodes of one rank, two-level is the flat exchange bit for bit; as one
    node of two, it is Horovod's synchronous step -- a technique does nothing and sends
    nothing between nodes, and the statistics say so."""
    runs = run_job(edge_body, 2, (), timeout=300, env={OVERRIDE: per_node})
    for r in runs:
        if what == "flat":
            assert torch.equal(r["threshold"]["params"], r["threshold, flat"]["params"])
            assert r["threshold"]["inside"] == 0
            assert "one rank per node: the flat exchange" in r["threshold"]["summary"]
        else:
            assert torch.equal(r["threshold"]["params"], r["nothing on, flat"]["params"])
            assert "synchronous inside it, as Horovod: no technique runs" in \
                r["threshold"]["summary"]
        assert torch.equal(r["nothing on"]["params"], r["nothing on, flat"]["params"])


# -- checkpoints: a two-level run resumed in fresh processes --------------------------------------
#: tests/test_torch_resume.py's exact cases, two-level
RESUMED = {name: dict(options, between="nodes") for name, options in (
    ("plain", {}), ("threshold", dict(threshold=dict(threshold=0.6, max_skip=4))),
    ("lowrank", dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0))),
    ("outer", dict(delay=dict(exchange_gradients=False, average_every=4, fragments=2,
                              overlap=2, mix=0.5, compress="int8", outer_lr=0.7,
                              outer_momentum=0.9))))}


def test_a_two_level_run_resumes_exactly_in_fresh_processes(tmp_path):
    """Saved after 8 steps (the outer exchange in flight, no flush), restored into new
    processes (every rank its own memory, or rank 0's file on every rank through the
    helper): the next 8 steps equal the uninterrupted run's, bit for bit, on every rank."""
    from tests.test_torch_resume import first_job  # ("outer" is saved in flight there too)
    env = {OVERRIDE: "2", "HOROVOD_FUSION_THRESHOLD": "0"}
    uninterrupted = run_job(first_job, 4, (str(tmp_path), RESUMED), timeout=600, env=env)
    resumed = run_job(second_jobs_of, 4, (str(tmp_path),), timeout=600, env=env)
    for rank, (a, b) in enumerate(zip(uninterrupted, resumed)):
        for how in ("helper", "own"):
            for case in RESUMED:
                for x, y in zip(a[case], b[how][case]["params"]):
                    assert (x == y).all(), (case, how, rank)


def second_jobs_of(directory: str) -> dict:
    from tests.test_torch_resume import second_job
    return {how: second_job(directory, how, RESUMED) for how in ("helper", "own")}


def test_torchrun_restarts_a_two_level_job_that_lost_a_rank_or_a_whole_node(tmp_path):
    """``torchrun --max-restarts 1`` on 2 nodes x 2: one rank of a node dies, and in another
    job both ranks of node 1. The restarted workers resume from the last checkpoints and end
    with identical replicas after flush(), equal bit for bit to an uninterrupted job resumed
    from the same checkpoints."""
    from tests.test_torch_resume import restarted_job, resumed_job
    env = {OVERRIDE: "2", "HOROVOD_FUSION_THRESHOLD": "0"}
    results = {}
    for what, lost in (("a rank", (1,)), ("a node", (2, 3))):
        directory = tmp_path / what.replace(" ", "_")
        directory.mkdir()
        results[what] = run_job(restarted_job, 4, (str(directory), RESUMED, lost),
                                timeout=600, launcher="torchrun", restarts=1, env=env)
        assert [r["restarts"] for r in results[what]] == [1] * 4, what
    # (the checkpoints of both jobs are the same bits: every case is deterministic)
    uninterrupted = run_job(resumed_job, 4, (str(directory), RESUMED), timeout=600,
                            launcher="torchrun", env=env)
    for what, ranks in results.items():
        for rank, r in enumerate(ranks):
            for case in RESUMED:
                assert r["cases"][case]["dropped"] == [], (what, case)
                for x, y in zip(uninterrupted[0]["cases"][case]["params"],
                                r["cases"][case]["params"]):
                    assert (x == y).all(), (what, case, rank)


@pytest.mark.parametrize("launcher", ["horovodrun", "torchrun"])
def test_a_stalled_rank_of_a_node_is_reported_by_every_other_rank(launcher):
    """Rank 3 (node 1) stops for 3 s in step 3 of a two-level job: its node's other rank waits
    in the node's reduction, node 0's ranks between nodes or inside their node; each reports
    the stall with the step and what it waits for, and the job ends."""
    from tests.test_entries import one_rank_stops
    out = run_job(one_rank_stops, 4, (3.0, 3, dict(threshold=0.5, between="nodes")),
                  timeout=200, launcher=launcher,
                  env={OVERRIDE: "2", "HVDSYNC_STALL_WARNING_SECONDS": "1"})
    # (rank 3 itself is not held to silence, as in the 2-rank test: on two loaded cores it
    # may wait a second for the others in a later step, a true report too)
    for rank in (0, 1, 2):
        # (four ranks on two cores: rank 3 may stop before Horovod's background thread has
        # sent its step-2 collectives, and then the others truly wait in step 2; a rank may
        # also have waited a second at an earlier step, a true report too)
        reports = out[rank].split("hvdsync: stall: ")[1:]
        assert any(r.startswith(f"rank {rank} has waited ") and "docs/failures.md" in r
                   and re.search(r"in a training step \(step [23]\)", r)
                   for r in reports), (rank, out)
