"""Nodes, not GPUs, on Keras' TensorFlow backend (``between="nodes"``, docs/nodes.md): 4 real
horovodrun ranks as 2 nodes x 2 (``HVDSYNC_RANKS_PER_NODE=2``), ``fit`` with each technique
two-level leaves identical replicas after ``FlushCallback`` and learns; nothing on equals the
flat average; a node's link carries one worker's bytes (its leader's), the reduction inside
the node is full precision; a NaN on one rank, mixed precision and gradient accumulation hold.
(Keras on its torch backend runs hvdsync.torch's two levels: tests/test_keras_torch.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from hvdsync.core.topology import OVERRIDE
from tests.keras_models import fit_body

#: case -> (fit_body's options with between="nodes" added, its keywords)
CASES = {
    "nothing on": ({}, {}),
    "threshold": (dict(threshold=dict(threshold=0.6, max_skip=3)), {}),
    "select": (dict(select=dict(k=1, selector="norm", max_wait=2)), {}),
    "lowrank": (dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0)), {}),
    "fp16": (dict(compression="fp16"), {}),
    # (a global gradient folded when due; the parameters averaged every 5 steps: the last of
    # the 12 is a local one)
    "delay": (dict(delay=dict(staleness=1, average_every=5)), {}),
    "streaming": (dict(delay="streaming"), {}),
    "sparse": (dict(sparse=True), dict(model="embedding")),
    # the second batch's gradient NaN on rank 1 (node 0): the step skipped everywhere
    "streaming, NaN": (dict(delay="streaming"), dict(nan_rank=1)),
    "mixed threshold": (dict(threshold=dict(threshold=0.6, max_skip=3)), dict(mixed=True)),
    "accumulated lowrank": (dict(lowrank=dict(rank=2, warmup_steps=2, min_compression=0),
                                 backward_passes_per_step=2), {}),
}
#: run flat as well: the bytes a node sends two-level against a flat rank's
FLAT = ("nothing on", "lowrank", "fp16")


def nodes_body(directory: str) -> dict:
    """Every case on this rank: two-level (and flat for :data:`FLAT`), after ``fit`` and
    ``FlushCallback``: the final weights, the loss, the bytes a step; then the checkpoint
    cases' uninterrupted runs, saved in ``directory`` (:func:`first_job`)."""
    import hvdsync.keras as hvd
    from tests.test_keras_reliability import keras_first_job
    hvd.init(process_sets=hvd.node_process_sets())
    out = {}
    runs = [(name, "nodes") for name in CASES] + [(name, None) for name in FLAT]
    for name, between in runs:
        options, kw = CASES[name]
        options = dict(options, between=between)
        if options.pop("compression", None) == "fp16":
            options["compression"] = hvd.Compression.fp16
        r = fit_body(options, "momentum", 0.05, 12, 16, callbacks=("broadcast", "flush"), **kw)
        total, steps = r["stats"]["total"], r["iterations"]
        out[name if between else f"{name}, flat"] = dict(
            final=np.concatenate([v.ravel() for _, v in sorted(r["final"].items())]),
            # after the last step, before FlushCallback
            before=np.concatenate([v.ravel() for _, v in sorted(r["weights"][-1].items())]),
            first=r["logs"][0]["loss"], last=r["logs"][-1]["loss"],
            sent=total["bytes_sent"] / steps, dense=total["bytes_dense"] / steps,
            inside=total.get("bytes_intra_node", 0) / steps)
    out["resumed"] = keras_first_job(directory, _resumed())
    return out


#: the job's environment (Horovod's fusion off: the checkpoint cases' sums in a fixed order)
ENV = {OVERRIDE: "2", "HOROVOD_FUSION_THRESHOLD": "0"}


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("keras_nodes"))


@pytest.fixture(scope="module")
def ranks(directory):
    from hvdsync.testing import run_ranks
    return run_ranks(nodes_body, 4, (directory,), timeout=600, env=ENV)


@pytest.mark.parametrize("case", list(CASES))
def test_every_technique_two_level_leaves_identical_finite_replicas(ranks, case):
    for r in ranks:  # every rank of every node, after FlushCallback
        np.testing.assert_array_equal(r[case]["final"], ranks[0][case]["final"], err_msg=case)
    assert np.isfinite(ranks[0][case]["final"]).all(), case
    assert ranks[0][case]["last"] < ranks[0][case]["first"], case  # it learns
    # one replica per node: a node's ranks alike before the flush too; with local steps
    # between nodes (delay=), the nodes apart
    for a, b in ((0, 1), (2, 3)):
        np.testing.assert_array_equal(ranks[a][case]["before"], ranks[b][case]["before"])
    if case.startswith(("delay", "streaming")):
        assert not np.array_equal(ranks[0][case]["before"], ranks[2][case]["before"]), case
    two = ranks[0][case]
    # the node's gradient averaged in full precision, every step (and the leader's results
    # shared: a sparse table's rows are fewer than its dense bytes)
    assert two["inside"] >= two["dense"] > 0 or case == "sparse", case


def test_nothing_on_is_the_flat_average(ranks):
    """Averaged inside the node first, then between nodes: Horovod's average in another
    order of sums."""
    np.testing.assert_allclose(ranks[0]["nothing on"]["final"],
                               ranks[0]["nothing on, flat"]["final"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", FLAT)
def test_a_node_sends_one_workers_bytes_between_nodes(ranks, case):
    """The node's leader (local rank 0) carries the data collectives: it sends what a rank of
    the flat job sends, its node's other rank nothing (control rounds aside: not counted as
    data)."""
    for leader, other in ((0, 1), (2, 3)):
        assert ranks[leader][case]["sent"] == pytest.approx(ranks[0][f"{case}, flat"]["sent"],
                                                            rel=1e-12), case
        assert ranks[other][case]["sent"] == 0, case
    if case == "nothing on":
        assert ranks[0]["nothing on, flat"]["sent"] == ranks[0]["nothing on"]["dense"]


# -- checkpoints: a two-level run resumed in fresh processes --------------------------------------
def _resumed() -> dict:
    """tests/test_keras_reliability.py's cases, two-level."""
    from tests.test_keras_reliability import RESUME
    return {name: dict(RESUME[name], between="nodes")
            for name in ("threshold", "outer", "mixed_float16")}


def second_job(directory: str) -> dict:
    import hvdsync.keras as hvd
    from tests.test_keras_reliability import keras_second_job
    hvd.init(process_sets=hvd.node_process_sets())
    return keras_second_job(directory, "every_rank", _resumed())


def test_a_two_level_run_resumes_exactly_in_fresh_processes(ranks, directory):
    """Saved after 8 steps with hvd.save_model (every rank's memory; the outer exchange in
    flight), loaded into new processes: the next 8 steps equal the uninterrupted run's, bit
    for bit, on every rank."""
    from hvdsync.testing import run_ranks
    second = run_ranks(second_job, 4, (directory,), timeout=600, env=ENV)
    for rank, (a, b) in enumerate(zip((r["resumed"] for r in ranks), second)):
        for case in _resumed():
            assert b[case]["iterations"] == 16
            for x, y in zip(a[case], b[case]["weights"]):
                np.testing.assert_array_equal(y, x, err_msg=f"{case} rank {rank}")


# -- where two levels reduce to one ---------------------------------------------------------------
def edge_body() -> dict:
    """This job's layout (the override the launcher gave): nothing on and threshold=, each
    two-level and flat; the final weights."""
    import hvdsync.keras as hvd
    hvd.init(process_sets=hvd.node_process_sets())
    out = {}
    for name in ("nothing on", "threshold"):
        for between in ("nodes", None):
            r = fit_body(dict(CASES[name][0], between=between), "momentum", 0.05, 8, 16,
                         record_weights=False)
            out[f"{name}, {between or 'flat'}"] = np.concatenate([v.ravel() for _, v in
                                                   sorted(r["final"].items())])
    return out


@pytest.mark.parametrize("per_node, what", [("1", "flat"), ("2", "one node")])
def test_one_rank_per_node_is_flat_and_one_node_is_horovods_step(per_node, what):
    """Two ranks: as two nodes of one rank, two-level is the flat exchange bit for bit; as
    one node of two, Horovod's synchronous step (a technique does nothing)."""
    from hvdsync.testing import run_ranks
    runs = run_ranks(edge_body, 2, timeout=300, env={OVERRIDE: per_node})
    for r in runs:
        flat = "threshold, flat" if what == "flat" else "nothing on, flat"
        np.testing.assert_array_equal(r["threshold, nodes"], r[flat])
        np.testing.assert_array_equal(r["nothing on, nodes"], r["nothing on, flat"])
    if what == "one node":  # (threshold= keeps layers back when it runs: it did not here)
        assert not np.array_equal(runs[0]["threshold, flat"], runs[0]["nothing on, flat"])
