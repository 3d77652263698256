"""The two-level mode (``between="nodes"``, docs/nodes.md) in the performance model and the
advisor.

A step of it: the node's ranks average each ready group inside the node, blocking (a ring at
the intra-node bandwidth); then the technique runs between the nodes once per node -- as on a
cluster of one worker per node whose link is the node's NIC (each cross-node collective is run
by one rank of the node). Its local steps keep one replica per node, not per rank.

Its steps to Horovod's target: :func:`hvdsync.tools.steps.steps_factor` at one replica per
node.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from hvdsync.tools import perfmodel
from hvdsync.tools.perfmodel import Cluster, Constants, ModelSizes, Prediction
from hvdsync.tools.steps import SUFFIX, steps_factor


def between(cluster: Cluster) -> Cluster:
    """The cluster the techniques see between nodes: one worker per node behind the node's
    NIC (``cluster.bandwidth_gbit`` is a rank's share of it)."""
    g = cluster.ranks_per_node
    return replace(cluster, ranks=cluster.ranks // g, ranks_per_node=1,
                   bandwidth_gbit=cluster.bandwidth_gbit * g)


def inside_s(model: ModelSizes, cluster: Cluster, c: Constants) -> float:
    """Seconds a step spends averaging the dense gradient inside the node (not hidden: the
    reduction blocks backward's hook)."""
    g = cluster.ranks_per_node
    node = Cluster(ranks=g, bandwidth_gbit=cluster.intra_bandwidth_gbit,
                   latency_us=cluster.intra_latency_us)
    # (the intra-node rate is the node reduction's own, as given: ``max_gbit`` caps what
    # the engine's collectives reach on a link, which the node reduction does not cross)
    return perfmodel.allreduce_s(model.params * model.value_bytes, node,
                                 replace(c, max_gbit=None))


def predict(technique: str, model: ModelSizes, cluster: Cluster,
            c: Constants = perfmodel.CALIBRATED, **settings: Any) -> Prediction:
    """``technique`` (a key of :data:`hvdsync.tools.perfmodel.TECHNIQUES`) two-level on
    ``cluster``: its step, and bytes per rank a step between nodes (a node's are one
    worker's, shared by its ranks)."""
    g = cluster.ranks_per_node
    pred = perfmodel.predict(technique, model, between(cluster), replace(c, cores=None),
                          **settings)
    inside = inside_s(model, cluster, c) if g > 1 else 0.0
    step = pred.step_s + inside
    notes = list(pred.notes) + [f"{inside * 1e3:.1f} ms inside the node"]
    if c.cores is not None and cluster.ranks > c.cores:  # every rank on the machine's cores
        slow = 1 + (c.oversubscribed - 1) * (cluster.ranks / c.cores - 1)
        step *= slow
        notes.append(f"{cluster.ranks} ranks on {c.cores} cores: x{slow:.1f}")
    return Prediction(technique + SUFFIX, step, pred.bytes_per_step / g, pred.collectives,
                      pred.compute_s, pred.exposed_comm_s + inside, pred.memory_bytes, notes)


def rows(model: ModelSizes, cluster: Cluster, c: Constants, family: str,
         measured: dict[str, tuple[Optional[float], str]], techniques: list[str],
         base_step_s: float) -> list[dict[str, Any]]:
    """The advisor's two-level rows (one per technique of ``techniques``), none where the job
    has one node or one rank per node (the mode is the flat exchange or Horovod's there)."""
    g = cluster.ranks_per_node
    if g == 1 or cluster.ranks == g:
        return []
    out = []
    for t in techniques:
        pred = predict(t, model, cluster, c)
        factor, source = steps_factor(measured, family, pred.technique, cluster.ranks // g)
        to_target = None if factor is None else pred.step_s * max(factor, 1.0) / base_step_s
        out.append(dict(prediction=pred, steps_factor=factor, source=source,
                        time_to_target=to_target))
    return out
