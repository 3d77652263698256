"""The bench's methods (benchmarks/bench_suite.py): each peer and each hvdsync setting, by the
name ``--methods`` takes -- its ``kind`` (``horovod``, ``ddp``: benchmarks/ddp_peers.py,
``torchft``: benchmarks/torchft_peer.py, ``local``, ``hvdsync``), and its settings. ``extra``:
not in the default set."""

from __future__ import annotations

from typing import Any

from hvdsync.techniques.delay.config import STREAMING

THRESHOLD = dict(threshold=0.05, relative=True, max_skip=8)
STREAMING_CFG = dict(exchange_gradients=False, outer_lr=0.7, outer_momentum=0.9, **STREAMING)
LOWRANK = dict(rank=2, warmup_steps=10)
METHODS: dict[str, dict[str, Any]] = {
    "horovod": dict(kind="horovod"),
    # Horovod's fp16 compression crashes on sparse gradients (its sparse path hands
    # decompress() no context), so on embeddings it runs with a dense embedding gradient
    "horovod fp16": dict(kind="horovod", fp16=True, dense_model=True),
    "ddp+powersgd": dict(kind="ddp", hook="powersgd", dense_model=True),
    "ddp fp16": dict(kind="ddp", hook="fp16", dense_model=True),
    # post-local SGD: synchronous for the first 10 steps, then local steps with the model
    # averaged every 32 (PeriodicModelAverager): the closest peer of delay='s averaging
    "ddp post-local sgd": dict(kind="ddp", hook="post_local", dense_model=True),
    "hvdsync": dict(kind="hvdsync", kwargs={}),
    "hvdsync clip": dict(kind="hvdsync", kwargs=dict(clip=dict(max_norm=5.0))),
    "hvdsync threshold": dict(kind="hvdsync", kwargs=dict(threshold=THRESHOLD),
                              dense_model=True),
    "hvdsync select": dict(kind="hvdsync", kwargs=dict(select=dict(k=0.5)), dense_model=True),
    "hvdsync threshold + fp16": dict(kind="hvdsync", fp16=True, kwargs=dict(threshold=THRESHOLD),
                                     dense_model=True),
    "hvdsync select + fp16": dict(kind="hvdsync", fp16=True, kwargs=dict(select=dict(k=0.5)),
                                  dense_model=True),
    "hvdsync delay": dict(kind="hvdsync", kwargs=dict(delay=dict(staleness=4, average_every=32)),
                          dense_model=True),
    "hvdsync sparse": dict(kind="hvdsync", kwargs=dict(sparse=True), sparse_only=True),
    # rank and warm-up of the DDP+PowerSGD peer
    "hvdsync lowrank": dict(kind="hvdsync", kwargs=dict(lowrank=LOWRANK), dense_model=True),
    "hvdsync lowrank + fp16": dict(kind="hvdsync", fp16=True, kwargs=dict(lowrank=LOWRANK),
                                   dense_model=True),
    "hvdsync lowrank + threshold + fp16": dict(kind="hvdsync", fp16=True,
                                               kwargs=dict(lowrank=LOWRANK, threshold=THRESHOLD),
                                               dense_model=True),
    # the compressed exchange inside delay=: it overlaps the next steps (issue 19)
    "hvdsync lowrank + delay": dict(kind="hvdsync", dense_model=True, extra=True,
                                    kwargs=dict(lowrank=LOWRANK,
                                                delay=dict(staleness=1, average_every=32))),
    "hvdsync lowrank + delay + fp16": dict(kind="hvdsync", fp16=True, dense_model=True,
                                           extra=True,
                                           kwargs=dict(lowrank=LOWRANK,
                                                       delay=dict(staleness=1,
                                                                  average_every=32))),
    # local steps, nothing exchanged: each rank trains alone (the compute floor per step)
    "no exchange": dict(kind="local", dense_model=True),
    # torchft's (Streaming) DiLoCo, the real package (benchmarks/torchft_peer.py), with the
    # schedule of hvdsync's streaming preset; "torchft diloco k32" is plain DiLoCo
    "torchft streaming diloco": dict(kind="torchft", dense_model=True,
                                     diloco=dict(average_every=8, fragments=4, overlap=1,
                                                 mix=0.5, outer_lr=0.7, outer_momentum=0.9)),
    # one replica group per node (--ranks-per-node): DDP inside the node every step,
    # torchft's Streaming DiLoCo between the nodes
    "torchft streaming diloco, nodes": dict(kind="torchft", dense_model=True, extra=True,
                                            per_node=True,
                                            diloco=dict(average_every=8, fragments=4,
                                                        overlap=1, mix=0.5, outer_lr=0.7,
                                                        outer_momentum=0.9)),
    "torchft diloco k32": dict(kind="torchft", dense_model=True, extra=True,
                               diloco=dict(average_every=32, fragments=1, overlap=0, mix=0.0,
                                           outer_lr=0.7, outer_momentum=0.9)),
    "hvdsync diloco k32": dict(kind="hvdsync", dense_model=True, extra=True,
                               kwargs=dict(delay="diloco")),
    "hvdsync streaming k16": dict(kind="hvdsync", dense_model=True, extra=True,
                                  kwargs=dict(delay=dict(STREAMING_CFG, average_every=16))),
    "hvdsync streaming k4": dict(kind="hvdsync", dense_model=True, extra=True,
                                 kwargs=dict(delay=dict(STREAMING_CFG, average_every=4))),
    "hvdsync streaming k4 averaging": dict(
        kind="hvdsync", dense_model=True, extra=True,
        kwargs=dict(delay=dict(STREAMING_CFG, average_every=4, fragments=2, outer_lr=1.0,
                               outer_momentum=0.0))),
    "hvdsync streaming tau2": dict(kind="hvdsync", dense_model=True, extra=True,
                                   kwargs=dict(delay=dict(STREAMING_CFG, overlap=2))),
    "hvdsync streaming fp32": dict(kind="hvdsync", dense_model=True, extra=True,
                                   kwargs=dict(delay=dict(STREAMING_CFG, compress="none"))),
    # the seed's stale-gradient scheme, the recommended preset before issue 29
    "hvdsync delay + fp16": dict(kind="hvdsync", fp16=True, dense_model=True, extra=True,
                                 kwargs=dict(delay=dict(staleness=4, average_every=32))),
    "hvdsync recommended": dict(kind="hvdsync", fp16=True, kwargs=dict(delay="streaming"),
                                sparse_kwargs=dict(sparse=True)),
    # nodes of several ranks (--ranks-per-node): the techniques between nodes only, and
    # post-local SGD's local steps synchronous inside the node (its subgroup: the node)
    "hvdsync recommended, nodes": dict(kind="hvdsync", fp16=True, extra=True,
                                       kwargs=dict(delay="streaming", between="nodes"),
                                       sparse_kwargs=dict(sparse=True, between="nodes")),
    "hvdsync lowrank + fp16, nodes": dict(kind="hvdsync", fp16=True, dense_model=True,
                                          extra=True,
                                          kwargs=dict(lowrank=LOWRANK, between="nodes")),
    "ddp post-local sgd, nodes": dict(kind="ddp", hook="post_local", dense_model=True,
                                      extra=True, subgroup="node"),
    # torch's HierarchicalModelAverager: local steps on each rank, the parameters averaged
    # inside the node every step and across every rank every 32 (after the same 10
    # synchronous steps)
    "ddp hierarchical averaging, nodes": dict(kind="ddp", hook="post_local", dense_model=True,
                                              extra=True, averager="hierarchical"),
}
# select='s selectors at equal bytes (issue 20): a quarter of the dense bytes per step, a
# layer at least every 9 steps; "seed hypernet" is the seed design's objective and inputs.
# Not in the default set: ``--methods horovod "select hypernet @25%" ...``
SELECT_BUDGET = dict(budget=0.25, max_wait=8)
SELECTORS = {"select hypernet": dict(selector="hypernet"),
             "select seed hypernet": dict(selector="hypernet", objective="first_order",
                                          inputs="embedding"),
             "select norm": dict(selector="norm"), "select random": dict(selector="random"),
             "select round-robin": dict(selector="round_robin")}
for _label, _sel in SELECTORS.items():
    METHODS[f"hvdsync {_label} @25%"] = dict(kind="hvdsync", dense_model=True, extra=True,
                                              kwargs=dict(select={**SELECT_BUDGET, **_sel}))
# outer-optimizer variants of the streaming preset (per-step accuracy probes, issue 29):
# ``--methods horovod "hvdsync streaming lr1" ...``; compare ``finals`` (per seed) at equal steps
OUTER_VARIANTS = {"lr1": dict(outer_lr=1.0), "lr1 m0.8": dict(outer_lr=1.0, outer_momentum=0.8),
                  "lr0.85": dict(outer_lr=0.85), "lr0.6": dict(outer_lr=0.6),
                  "lr0.5": dict(outer_lr=0.5), "m0.8": dict(outer_momentum=0.8),
                  "mix0.25": dict(mix=0.25), "mix0.75": dict(mix=0.75),
                  "f8": dict(fragments=8), "k6 f3": dict(average_every=6, fragments=3)}
for _label, _cfg in OUTER_VARIANTS.items():
    METHODS[f"hvdsync streaming {_label}"] = dict(kind="hvdsync", dense_model=True, extra=True,
                                                   kwargs=dict(delay={**STREAMING_CFG, **_cfg}))
RECOMMENDED = ('delay="streaming" (local steps, outer Nesterov 0.7/0.9, K 8 in 4 fragments, '
               "overlap 1, mix 0.5, int8); with sparse gradients: sparse= + fp16")
