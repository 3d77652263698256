"""The two-level mode on Keras' TensorFlow backend (``between="nodes"``, docs/nodes.md): a
step's gradients are averaged inside the node in full precision, then the step pipeline (run
eagerly: :func:`hvdsync.keras.graph.eager_step`) runs the techniques on that node gradient
between nodes. Each cross-node data collective runs on the node's *leader* (local rank 0),
its result shared inside the node (:class:`LeaderCross`), so a node's link carries one
worker's bytes. Horovod registers process sets at ``init``:
``hvd.init(process_sets=hvd.node_process_sets())``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import tensorflow as tf
from horovod.tensorflow import ProcessSet, mpi_ops
from horovod.tensorflow.mpi_ops import Sum

from hvdsync.core.stats import SyncStats
from hvdsync.core.topology import Communicators, Topology, levels, process_set_ranks
from hvdsync.keras.comm import KerasCommunicator, payload_bytes
from hvdsync.safety.watchdog import guard

#: the process sets :func:`node_process_sets` gave, by their ranks
_REGISTERED: dict[tuple[int, ...], ProcessSet] = {}


def node_process_sets() -> list[ProcessSet]:
    """Every node's process set, then each local rank's across the nodes, as this job is laid
    out (:mod:`hvdsync.core.topology`): ``hvd.init(process_sets=hvd.node_process_sets())``
    registers what ``between="nodes"`` runs on. Empty where the job is not several nodes of
    several ranks."""
    return [_REGISTERED.setdefault(tuple(r), ProcessSet(r)) for r in process_set_ranks()]


def _registered(ranks: list[int]) -> ProcessSet:
    found = _REGISTERED.get(tuple(ranks))
    if found is None or found.process_set_id is None:
        raise RuntimeError("between='nodes' on Horovod runs on process sets registered at "
                           "init: call hvd.init(process_sets=hvd.node_process_sets())")
    return found


def communicators(between: Optional[str], make: Callable[..., Any], process_set: ProcessSet,
                  techniques: list[str]) -> Communicators:
    """The communicators of a Keras optimizer with ``between=``
    (:func:`hvdsync.core.topology.levels`; ``make(process_set, wire, cls)``: a ``cls``
    (:class:`KerasCommunicator`), ``wire``: with the optimizer's compression)."""
    size, rank = mpi_ops.size(), mpi_ops.rank()

    def two_level(topology: Topology) -> Communicators:
        node = _registered(topology.node_ranks(topology.node_of(rank)))
        cross = make(_registered(topology.cross_ranks(topology.local_rank_of(rank))), True,
                     LeaderCross)
        cross.node, cross.carries = node, topology.local_rank_of(rank) == 0
        return Communicators(cross, NodeReduce(make(node, False)), make(process_set, True),
                             topology)
    return levels(between, process_set, size, rank, make, two_level, techniques)


class NodeReduce:
    """Averages (or sums) a step's gradients inside the node, in full precision, before
    anything else sees them; counts the bytes (``bytes_intra_node``)."""

    def __init__(self, comm: KerasCommunicator):
        self.comm = comm

    def __call__(self, grads: list) -> list:
        out = self.comm.reduce(grads, name="hvdsync.node")
        self.comm.stats.count("bytes_intra_node", sum(payload_bytes(g) for g in grads))
        return out


class LeaderCross(KerasCommunicator):
    """The cross-node communicator of a rank in the two-level mode: its data collectives run
    on the node's leader (``carries``), their results shared inside ``node`` -- a sum in
    which the other ranks bring zeros, as int32 words (the same bits). Horovod's eager
    TensorFlow ops block and a step's exchange runs in one background thread, so the node's
    ranks cannot take turns owning them as hvdsync.torch's ``OwnedCross`` does without
    waiting on each other. What is small or differs between a node's ranks (control rounds,
    entry tags, the setup's gathers) every rank runs itself, over its local rank's ranks."""

    node: ProcessSet

    def _moved(self, name: Optional[str], start: Callable[[], list], like: list,
               gathered: bool = False) -> list:
        got = list(start()) if self.carries else None
        if gathered:  # (the others learn the gathered lengths first)
            lengths = [tf.constant([int(g.shape[0]) for g in got] if got is not None
                                   else [0] * len(like), tf.int64)]
            lengths = _shared(self.node, f"{name}.lengths", None if got is None else lengths,
                              lengths, self.stats)[0].numpy().tolist()
            like = [tf.zeros([n, *t.shape[1:]], t.dtype) for n, t in zip(lengths, like)]
        return _shared(self.node, f"{name}.shared", got, like, self.stats)


def _shared(node: ProcessSet, name: str, tensors: Optional[list], like: list,
            stats: SyncStats) -> list:
    """``tensors`` (the leader's; ``None`` elsewhere: zeros shaped ``like``) on every rank of
    ``node``: summed as int32 words -- one rank's bits and zeros, so the same bits -- in one
    allreduce; counts its bytes (``bytes_intra_node``)."""
    src = tensors if tensors is not None else [tf.zeros(t.shape, t.dtype) for t in like]
    raw = [tf.reshape(tf.bitcast(t, tf.uint8), [-1]) for t in src]
    n = sum(int(r.shape[0]) for r in raw)
    words = tf.concat(raw + [tf.zeros([(-n) % 4], tf.uint8)], 0)
    with guard(f"the allreduce {name!r} (shared inside the node)"):
        summed = mpi_ops._allreduce(tf.bitcast(tf.reshape(words, [-1, 4]), tf.int32),
                                    name=name, op=Sum, process_set=node)
    stats.count("bytes_intra_node", n + (-n) % 4)
    flat, out, at = tf.reshape(tf.bitcast(summed, tf.uint8), [-1]), [], 0
    for t, r in zip(src, raw):
        piece = flat[at:at + int(r.shape[0])]
        at += int(r.shape[0])
        if t.dtype.size > 1:
            piece = tf.reshape(piece, [-1, t.dtype.size])
        out.append(tf.reshape(tf.bitcast(piece, t.dtype), t.shape))
    return out
