"""The two-level mode in the performance model and the advisor (no ranks, in seconds): steps to
target by replica count (hvdsync.tools.steps), the two-level prediction
(hvdsync.tools.twolevel) and the advisor's rows and line to paste (docs/at-scale.md)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from hvdsync.tools import advise, perfmodel, steps, twolevel
from hvdsync.tools.perfmodel import Cluster, LayerSize, ModelSizes

MB = 1 << 20
MEASURED = {"hvdsync lowrank": (1.7, "flat cell"), "hvdsync streaming": (1.2, "2-rank cell")}


def _model(layers: int = 8, compute_s: float = 0.1) -> ModelSizes:
    sizes = tuple(LayerSize(f"l{i}", 4 * MB, ((1024, 4 * MB // 1024),)) for i in range(layers))
    return ModelSizes(sizes, compute_s / 3, 2 * compute_s / 3)


@pytest.fixture
def curves(monkeypatch):
    """Factors measured at 2 and 4 replicas (flat), and at 2 nodes (two-level)."""
    fake = {"fam": {"hvdsync streaming": {2: (1.2, "a"), 4: (1.5, "b")},
                    "hvdsync streaming, nodes": {2: (1.1, "c")},
                    "ddp post-local sgd": {2: (1.4, "d"), 4: (1.3, "e")}}}
    monkeypatch.setattr(steps, "BY_REPLICAS", fake)
    return fake


def test_a_factor_is_read_where_measured_and_on_its_line_elsewhere(curves):
    f = steps.steps_factor
    assert f(MEASURED, "fam", "hvdsync streaming", 4) == (1.5, "b")
    # 0.3 per doubling of replicas: 8 replicas one doubling on, 64 four
    assert f(MEASURED, "fam", "hvdsync streaming", 8)[0] == pytest.approx(1.8)
    assert f(MEASURED, "fam", "hvdsync streaming", 64)[0] == pytest.approx(2.7)
    assert "extended to 64" in f(MEASURED, "fam", "hvdsync streaming", 64)[1]
    # a two-level row measured at 2 nodes grows as the flat technique does per doubling
    assert f(MEASURED, "fam", "hvdsync streaming, nodes", 2) == (1.1, "c")
    assert f(MEASURED, "fam", "hvdsync streaming, nodes", 8)[0] == pytest.approx(1.7)
    # fewer steps at more replicas (noise) is never extended downwards
    assert f(MEASURED, "fam", "ddp post-local sgd", 32)[0] == pytest.approx(1.3)


def test_a_per_step_technique_keeps_its_flat_factor_at_any_size(curves):
    for replicas in (2, 8, 512):
        assert steps.steps_factor(MEASURED, "fam", "hvdsync lowrank, nodes", replicas) == \
            MEASURED["hvdsync lowrank"]
        assert steps.steps_factor(MEASURED, "other", "hvdsync streaming", replicas) == \
            MEASURED["hvdsync streaming"]
    assert steps.steps_factor(MEASURED, "fam", "hvdsync select", 4) == (None, "not measured")


def test_two_level_is_the_technique_between_nodes_plus_the_node_reduction():
    m, c = _model(), replace(perfmodel.CALIBRATED, cores=None)
    cluster = Cluster(ranks=16, bandwidth_gbit=0.5, ranks_per_node=4, intra_bandwidth_gbit=200)
    nodes = twolevel.between(cluster)
    assert (nodes.ranks, nodes.ranks_per_node, nodes.bandwidth_gbit) == (4, 1, 2.0)
    # the node's reduction at the intra-node rate as given (no max_gbit: Horovod's own cap)
    inside = perfmodel.allreduce_s(m.params * 4, Cluster(ranks=4, bandwidth_gbit=200,
                                                          latency_us=cluster.intra_latency_us),
                                   replace(c, max_gbit=None))
    for t in ("horovod", "hvdsync lowrank", "hvdsync streaming"):
        p, flat = twolevel.predict(t, m, cluster, c), perfmodel.predict(t, m, nodes, c)
        assert p.technique == t + ", nodes"
        assert p.step_s == pytest.approx(flat.step_s + inside)
        # a node's link carries one worker's bytes, shared by its ranks
        assert p.bytes_per_step == pytest.approx(flat.bytes_per_step / 4)


def test_the_advisor_adds_two_level_rows_only_on_several_nodes_of_several_ranks():
    m = _model()
    for cluster, expected in ((Cluster(ranks=32, bandwidth_gbit=0.1, ranks_per_node=8), True),
                              (Cluster(ranks=8, bandwidth_gbit=0.1, ranks_per_node=8), False),
                              (Cluster(ranks=8, bandwidth_gbit=0.1, ranks_per_node=1), False)):
        rows = advise.advise(m, cluster, "transformer", advise.GPU_CLUSTER)["rows"]
        names = [r["prediction"].technique for r in rows]
        assert any(n.endswith(", nodes") for n in names) is expected, (cluster, names)
        if expected:
            assert "hvdsync streaming, nodes" in names and "horovod, nodes" not in names


def test_a_two_level_recommendation_pastes_the_mode_and_the_node_sets(monkeypatch, capsys):
    """With the two-level row made the fastest to the target, the advisor names it and the
    lines to paste turn it on (hvd.init with the node sets, between="nodes")."""
    real = twolevel.rows

    def faster(*a, **kw):
        out = real(*a, **kw)
        for r in out:
            if r["time_to_target"] is not None and r["prediction"].technique.startswith(
                    "hvdsync streaming"):
                r["time_to_target"] = 0.01
        return out
    monkeypatch.setattr(twolevel, "rows", faster)
    advise.main(["--preset", "gpt-125m", "--ranks", "64", "--ranks-per-node", "8",
                 "--bandwidth", "1"])
    out = capsys.readouterr().out
    assert re.search(r"^recommended: hvdsync streaming, nodes --", out, re.M), out
    lines = out.splitlines()
    assert lines[-2] == "    hvd.init(process_sets=hvd.node_process_sets())"
    assert lines[-1].endswith('delay="streaming", between="nodes")'), out
    assert advise.line_to_paste("hvdsync lowrank").count("\n") == 0
