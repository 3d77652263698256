"""The rulebook: every technique, in the order it runs, and which combine and why not where
they do not -- data, in one place, for both adapters (their ``DistributedOptimizer``
factories call :func:`configure`, then :func:`build_techniques`).

:data:`PACKAGES` is the one line a technique has here: its keyword, in role order (clip
transforms; threshold and select decide; sparse, lowrank and delay transport -- without
``delay`` dense layers take the plain exchange), and the package that builds it
(``CONFIG`` and ``build(config, parts)``: a technique, or a list of them). The core
imports no technique: a package is
looked up by name when an optimizer is built. docs/design.md shows the exclusions as a table;
docs/internals.md, "Adding a technique", the steps.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

from hvdsync.core.config import (check_bool, check_reduce_op, positive_float, positive_int,
                                 reject_unknown_kwargs)
from hvdsync.core.layers import Grouping
from hvdsync.core.plain import Plain
from hvdsync.core.technique import Parts, Technique

#: every technique keyword, in role order (the order techniques run in), and its package
PACKAGES = {
    "clip": "hvdsync.techniques.clip",
    "threshold": "hvdsync.techniques.threshold",
    "select": "hvdsync.techniques.select",
    "sparse": "hvdsync.techniques.sparse",
    "lowrank": "hvdsync.techniques.lowrank",
    "delay": "hvdsync.techniques.delay",
}
TECHNIQUES = tuple(PACKAGES)


def package(name: str) -> ModuleType:
    """The package of technique ``name`` (imported at first use)."""
    return importlib.import_module(PACKAGES[name])


def config_class(name: str) -> type:
    """Technique ``name``'s config class (``ClipConfig``...)."""
    return package(name).CONFIG


@dataclass(frozen=True)
class Exclusion:
    """Two techniques (or a technique and a setting) that do not combine, and why."""

    first: str
    second: str
    why: str


#: Combinations refused at construction, in both adapters. Everything not listed combines.
EXCLUSIONS = (
    Exclusion("threshold", "select", "both decide which layers go each step; pass one of them"),
    Exclusion("delay", "threshold",
              "delay= replaces a dense layer's exchange with a local step and a later fold; "
              "a decider's skipped layers would need a fold rule of their own; pass one of them"),
    Exclusion("delay", "select",
              "delay= replaces a dense layer's exchange with a local step and a later fold; "
              "select= holds back the layers it does not pick (their residuals kept), which "
              "would need a fold rule of their own; pass one of them"),
    Exclusion("delay", "sparse",
              "delay= folds dense global gradients into later steps and averages the "
              "parameters every K steps; row-sparse gradients have no such fold yet; pass "
              "one of them"),
    Exclusion("delay", "clip mode 'global'",
              "delay= folds the global gradient in later, so clipping the averaged gradient "
              "before the step does not apply; use clip mode 'local'"),
    Exclusion("delay local steps (exchange_gradients=False)", "lowrank",
              "lowrank= compresses delay='s per-step gradient exchange, which local steps turn "
              "off; compress the outer exchange with delay=dict(compress='int8' or 'fp16')"),
    Exclusion("sparse", "sparse_as_dense",
              "sparse_as_dense=True always sends sparse gradients dense; sparse= chooses per "
              "step (dense_ratio=0 always sends dense): pass one of them"),
)

#: Techniques that run their exchange inside another's when both are on: carried -> (carrier,
#: why). The carrier's package gives ``carry(carrier, carried)``, which returns what takes the
#: carried technique's place in the step pipeline (its carried form, which owns no layer).
CARRIED = {
    "lowrank": ("delay", "delay= exchanges each step's gradient and folds the global one in up "
                         "to staleness steps later; with lowrank= that exchange is the "
                         "compressed one"),
}

#: Transports whose layers go every step, whatever a decider (``threshold=``, ``select=``)
#: plans: name -> why. Deciders govern every other transport's parameters.
UNDECIDED = {
    "sparse": "which parameters are row-sparse, and their rows, change with the batch; the "
              "counts are shared every step, so the rows go every step and the deciders "
              "govern the dense parameters",
}


#: What a technique takes in the two-level mode (``between="nodes"``): keyword -> (field, what
#: its ``"auto"`` becomes, the values refused, why). A node's ranks keep one replica, so every
#: choice they make must be the same on all of them.
TWO_LEVEL = {
    "delay": ("fold", "due", ("arrived",),
              "a node's ranks hold one replica and must fold alike; what has arrived by now "
              "differs between them, the step a global gradient is due does not"),
}
#: What a technique takes where the adapter traces its step (Keras' compiled one), in
#: :data:`TWO_LEVEL`'s shape; elsewhere each ``"auto"`` is the technique's own default.
TRACED = {
    "delay": ("fold", "due", (),
              "a compiled step cannot ask the host what has arrived; the step a global "
              "gradient is due is known when the step is traced"),
}


def for_nodes(configs: dict[str, Any]) -> dict[str, Any]:
    """``configs`` as the two-level mode runs them (:data:`TWO_LEVEL`); raises ``ValueError``
    for a setting it cannot run."""
    return _resolved(configs, TWO_LEVEL, "with between='nodes'")


def for_tracing(configs: dict[str, Any]) -> dict[str, Any]:
    """``configs`` as an adapter that traces its step runs them (:data:`TRACED`)."""
    return _resolved(configs, TRACED, "in a traced step")


def _resolved(configs: dict[str, Any], table: dict, where: str) -> dict[str, Any]:
    out = dict(configs)
    for name, (field, auto, refused, why) in table.items():
        cfg = out.get(name)
        value = getattr(cfg, field, None)
        if value in refused:
            raise ValueError(f"{name}= {field}={value!r} cannot run {where}: {why}; use "
                             f"{field}={auto!r}")
        if value == "auto":
            out[name] = dataclasses.replace(cfg, **{field: auto})
    return out


#: Transports whose step updates with this rank's own gradient: name -> why. Such a transport
#: checks the gradients it starts for NaN/Inf itself -- they are not averaged in the step, so
#: the verdict cannot come from exchanged values -- and the pipeline leaves them out of its own
#: check; it is the step's only transport but those it carries (:data:`CARRIED`). A tracing
#: adapter builds such a step from its traced form's ``trace_local`` and runs its moments on
#: the host around the update (:attr:`hvdsync.core.pipeline.StepPipeline.local_step`).
UPDATES_LOCALLY = {
    "delay": "each rank steps at once with its own gradient; the global one is folded in later "
             "(or the models synchronized after the update)",
}


def decided(transport: Technique) -> bool:
    """Whether deciders choose when ``transport``'s parameters go (:data:`UNDECIDED`)."""
    return transport.name not in UNDECIDED


#: Reduction ops each technique needs ("average", "sum"); missing: any op.
OPS = {
    "delay": ("average",),
    "sparse": ("average", "sum"),
    "threshold": ("average", "sum"),
    "select": ("average", "sum"),
    "lowrank": ("average", "sum"),
}
_OP_WHY = {
    "delay": "delay= mixes local gradients with averaged global ones, so it needs op=Average",
    "sparse": "sparse= sums gathered rows, so it supports op=Average or op=Sum only",
    "threshold": "threshold= sends sums of gradients accumulated over steps, so it supports "
                 "op=Average or op=Sum only",
    "select": "select= sends gradients plus what accumulated while a layer waited, so it "
              "supports op=Average or op=Sum only",
    "lowrank": "lowrank= reduces the factors of a product (P, then Q), so it supports "
               "op=Average or op=Sum only",
}


def given(keywords: dict[str, Any], others: tuple[str, ...],
          where: str) -> tuple[Grouping, dict[str, Any]]:
    """``(layers, {technique: value})`` from a factory's :class:`TechniqueKeywords`; any other
    name raises ``TypeError`` with a suggestion among these and ``others`` (its arguments)."""
    known = ("layers",) + TECHNIQUES
    reject_unknown_kwargs({k: v for k, v in keywords.items() if k not in known},
                          others + known, where)
    return keywords.get("layers"), {name: keywords.get(name) for name in TECHNIQUES}


def coerce(**given: Any) -> dict[str, Any]:
    """Every technique keyword's value as its config (or ``None`` when off)."""
    return {name: config_class(name).coerce(given.get(name)) for name in TECHNIQUES}


def configure(*, op: str, sparse_as_dense: bool, **given: Any) -> dict[str, Any]:
    """Coerce and check the techniques a ``DistributedOptimizer`` was given.

    ``op`` is the reduction as ``"average"``, ``"sum"`` or ``"other"``. Returns
    ``{keyword: config}`` for the techniques that are on, in role order; raises
    ``ValueError`` naming the rule a combination breaks.
    """
    configs = coerce(**given)
    on = {name for name, cfg in configs.items() if cfg is not None}
    clip = configs["clip"]
    if clip is not None and clip.mode == "global":
        on.add("clip mode 'global'")
    if sparse_as_dense:
        on.add("sparse_as_dense")
    delay = configs["delay"]
    if delay is not None and not delay.exchange_gradients:
        on.add("delay local steps (exchange_gradients=False)")
    for rule in EXCLUSIONS:
        if rule.first in on and rule.second in on:
            raise ValueError(f"{_kw(rule.first)} cannot be combined with {_kw(rule.second)}: "
                             f"{rule.why}")
    for name, ops in OPS.items():
        if name in on and op not in ops:
            raise ValueError(_OP_WHY[name])
    return {name: configs[name] for name in TECHNIQUES if configs[name] is not None}


def check_arguments(mpi_ops: Any, *, compression: Any, backward_passes_per_step: Any,
                    op: Any, gradient_predivide_factor: Any, sparse_as_dense: Any,
                    process_set: Any, num_groups: int, groups: Any, layers: Any,
                    **techniques: Any) -> tuple[dict[str, Any], Any]:
    """The checks both adapters' factories make on Horovod's arguments and hvdsync's.
    ``mpi_ops`` is the framework's Horovod ops module (``horovod.torch.mpi_ops`` or
    ``horovod.tensorflow.mpi_ops``: its ``Average``, ``Sum``, ``Adasum``, ``Min``, ``Max``,
    ``Product`` and ``ProcessSet``); ``techniques`` are the technique keywords as given.
    Returns the techniques' configs (:func:`configure`) and the grouping Horovod's
    ``num_groups``/``groups`` ask for."""
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise TypeError("compression must provide compress() and decompress(), e.g. "
                        f"hvd.Compression.fp16; got {compression!r}")
    positive_int("backward_passes_per_step", backward_passes_per_step)
    o = mpi_ops
    check_reduce_op(op, average=o.Average, sum_=o.Sum, adasum=o.Adasum,
                    others=(o.Min, o.Max, o.Product),
                    gradient_predivide_factor=positive_float("gradient_predivide_factor",
                                                             gradient_predivide_factor))
    check_bool("sparse_as_dense", sparse_as_dense)
    kind = "average" if op == o.Average else "sum" if op == o.Sum else "other"
    configs = configure(op=kind, sparse_as_dense=sparse_as_dense, **techniques)
    if not isinstance(process_set, o.ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet of the backend ({o.__name__}), e.g. "
                        f"hvd.global_process_set; got {process_set!r}")
    if num_groups:
        warnings.warn("num_groups is deprecated; use groups", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is not None and layers is not None:
        raise ValueError("pass either groups (Horovod's) or layers (hvdsync's), not both")
    return configs, groups


def pipeline_order(configs: dict[str, Any]) -> list[str]:
    """The techniques a wrapped optimizer runs, in pipeline order: the ones configured, then
    the plain exchange as the dense transport unless ``delay`` replaces it."""
    names = enabled(configs)
    return names if "delay" in names else names + ["plain"]


def _kw(name: str) -> str:
    return f"{name}=" if name in TECHNIQUES else name


def enabled(configs: dict[str, Optional[Any]]) -> list[str]:
    """The keywords that are on, in role order."""
    return [name for name in TECHNIQUES if configs.get(name) is not None]


def build_techniques(configs: dict[str, Any], parts: Parts) -> list[Technique]:
    """The techniques of one wrapped optimizer, in the rulebook's order, each built by its
    package from ``parts`` (the adapter's gradients, arithmetic, communicator and kernels), or
    by the adapter where it builds one itself (``parts.builds``)."""
    techniques: list[Technique] = []
    for name in pipeline_order(configs):  # (a keyword may build more than one: delay=)
        if name == "plain":
            built = Plain(parts.grads, parts.comm, parts.layer_names)
        elif type(configs[name]) in parts.builds:
            built = parts.builds[type(configs[name])](configs[name])
        else:
            built = package(name).build(configs[name], parts)
        techniques += built if isinstance(built, list) else [built]
    parts.stats.describe(enabled(configs), lambda: parts.comm.size)
    for carried, (carrier, _) in CARRIED.items():  # the compositions (CARRIED)
        by = next((t for t in techniques if t.name == carrier), None)
        if by is not None:
            techniques = [package(carrier).carry(by, t) if t.name == carried else t
                          for t in techniques]
    return techniques
