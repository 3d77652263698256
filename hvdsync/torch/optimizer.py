"""hvdsync's torch ``DistributedOptimizer``: Horovod's contract, hvdsync's control of sends.

The wrapper owns one post-accumulate-grad hook per parameter. When the last parameter of a
*layer* (see :mod:`hvdsync.core.layers`) has its gradient for this step, the layer goes to the
step pipeline (:mod:`hvdsync.core.pipeline`), which runs the configured techniques on it and
starts its send at once, overlapping the rest of backward; ``synchronize()`` (called by
``step()``) hands the pipeline the rest (unused parameters get zero gradients, as in
Horovod), waits, and leaves the reduced gradients in ``p.grad`` for the wrapped optimizer.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Iterable
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:  # (typing.Unpack is Python 3.11's)
    from typing_extensions import Unpack

    from hvdsync.techniques import TechniqueKeywords

from hvdsync.safety import agreement, checkpoint, elastic
from hvdsync.core import rules
from hvdsync.core.api import SyncAPI
from hvdsync.core.config import non_negative_float, positive_int
from hvdsync.core.topology import check_between
from hvdsync.core.layers import Grouping, Layer, build_layers
from hvdsync.core.groups import default_group_bytes
from hvdsync.core.pipeline import StepPipeline
from hvdsync.core.rules import build_techniques
from hvdsync.core.stats import SyncStats
from hvdsync.core.technique import Parts
from hvdsync.torch import engine, joined, nodes
from hvdsync.torch.backend import TorchGradients
from hvdsync.torch.ops import TorchOps
from hvdsync.torch.comm import TorchCommunicator
from hvdsync.torch.params import groups_to_names, parameter_names
from hvdsync.torch.rows import row_exchange
from hvdsync.techniques.sparse.config import SparseConfig
from hvdsync.torch.saving import tensors_only

_HOROVOD_ARGS = ("named_parameters", "compression", "backward_passes_per_step", "op",
                 "gradient_predivide_factor", "num_groups", "groups", "sparse_as_dense",
                 "process_set")


class _DistributedOptimizer(SyncAPI):
    """Mixed in front of the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    # -- construction -----------------------------------------------------------------------
    def _hvdsync_init(self, named_parameters, compression, backward_passes_per_step, op,
                      gradient_predivide_factor, groups, sparse_as_dense, process_set,
                      layers: Grouping, configs: dict[str, Any], scaler: Any,
                      group_bytes: Optional[tuple[int, int]],
                      between: Optional[str] = None) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        names = parameter_names(params, named_parameters)
        by_name = {n: p for p, n in names.items()}
        # Horovod's own attributes that scripts reach for
        self._parameter_names = names
        self._requires_update = {p for p in params if p.requires_grad}
        grouping = layers if layers is not None else groups_to_names(groups, names)
        self._layers = build_layers([names[p] for p in params if p.requires_grad], grouping)
        layer_params = [[(n, by_name[n]) for n in layer.param_names] for layer in self._layers]
        # the hooked parameters and their layers, by position (the hook gets its position:
        # no tensor hashing on the hot path)
        self._hooked = [p for lp in layer_params for _, p in lp]
        self._layer_at = [li for li, lp in enumerate(layer_params) for _ in lp]
        self._layer_sizes = [len(lp) for lp in layer_params]

        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._compression = compression
        layer_names = [layer.name for layer in self._layers]
        self.stats = SyncStats(layer_names, backend=engine.active_name())
        self._grads = TorchGradients(layer_params, self, scaler,
                                     base_step=super(_DistributedOptimizer, self).step)
        levels = nodes.communicators(
            between, process_set, lambda ps, wire, reduce=None: TorchCommunicator(
                compression if wire else engine.ops().Compression.none, reduce or op,
                gradient_predivide_factor if wire else 1.0, sparse_as_dense, ps, self.stats),
            self.stats, list(configs))
        self._comm = comm = levels.comm
        #: every rank of the process set (the techniques' comm is the cross-node one with
        #: between="nodes"): the setup check, a checkpoint's every-rank memory
        self._everyone = levels.agree or comm
        self._grads.node_reduce = levels.node
        if levels.synchronous:  # one node: Horovod's synchronous exchange, nothing else
            configs = {}
        elif levels.node is not None:
            configs = rules.for_nodes(configs)
        self.stats.levels = levels.describe()
        self._techniques = build_techniques(configs, Parts(
            self._grads, TorchOps(), comm, self.stats, layer_names,
            builds={SparseConfig: lambda c: row_exchange(c, self._grads, comm, self.stats)}))
        if group_bytes is None:
            group_bytes = default_group_bytes([t.name for t in self._techniques],
                                              comm.matches_by_name)
        self._pipeline = StepPipeline(layer_names, self._techniques, self._grads, TorchOps(),
                                      self.stats, comm, *group_bytes)
        comm.entries.beside_join = joined.refusal(self._techniques, process_set,
                                                  levels.node is not None, comm.matches_by_name)
        self._steps_joined = 0  # steps taken in hvd.join() with zero gradients
        joined.register(self)
        self._param_signatures = [checkpoint.signature(p.shape, p.dtype)
                                  for lp in layer_params for _, p in lp]
        layers_seen = [(name, [checkpoint.signature(p.shape, p.dtype) for _, p in lp])
                       for name, lp in zip(layer_names, layer_params)]

        def agree() -> None:
            """Every rank checks it has the same setup (a collective; the process set's ranks
            as they are now: Horovod Elastic changes them)."""
            agreement.require(self._everyone, layers_seen, configs, dict(
                op=op, compression=compression,
                backward_passes_per_step=backward_passes_per_step,
                gradient_predivide_factor=gradient_predivide_factor,
                sparse_as_dense=sparse_as_dense, process_set=process_set.ranks,
                between=between, nodes=str(levels.topology)))
            if isinstance(levels.topology, str):  # (every rank alike, past the check)
                raise ValueError(levels.topology)
        self._agree = agree
        # under Horovod Elastic a rank joining later builds its optimizer while the others
        # wait in the state's sync(): the check runs there, on every rank (hvdsync.torch.elastic)
        if process_set.included() and not elastic.launched():
            self._agree()
        self._start_hooks(process_set)

    def _start_hooks(self, process_set: Any) -> None:
        """A step's counters, and a hook on every parameter of the process set's ranks."""
        self._synchronized = False
        self._should_synchronize = True
        self._closed: Optional[str] = None
        self._reset_step_counters()
        self._hook_handles = []
        _take_over(self._hooked)
        if process_set.included():
            for i, p in enumerate(self._hooked):
                self._hook_handles.append(p.register_post_accumulate_grad_hook(
                    functools.partial(self._on_grad, i)))
                p._hvdsync_owner = weakref.ref(self)

    def close(self, why: str = "it was closed") -> None:
        """Stop synchronizing: remove the per-parameter hooks. A later ``synchronize()`` or
        ``step()`` raises, naming ``why`` (it would update with this rank's gradients alone).
        Wrapping the same parameters again closes the earlier wrapper. With ``delay=``,
        :meth:`flush` first."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._closed = why
        for p in self._hooked:
            if _owner(p) is self:
                del p._hvdsync_owner

    def _backward_seen(self) -> bool:
        """Whether a hook counted a backward pass since the last ``synchronize()``."""
        return any(left != self.backward_passes_per_step for left in self._passes_left)

    def _reset_step_counters(self) -> None:
        self._passes_left = [self.backward_passes_per_step] * len(self._hooked)
        #: per layer, its parameters whose gradient is not final yet this step
        self._unready_in_layer = list(self._layer_sizes)

    # -- backward: per-parameter hook ---------------------------------------------------------
    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        left = self._passes_left[i] - 1
        if left < 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._passes_left[i] = left
        if left == 0:
            li = self._layer_at[i]
            self._unready_in_layer[li] -= 1
            if not self._unready_in_layer[li]:
                self._pipeline.layer_ready(li)

    # -- Horovod's public API ---------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every layer's reduction; afterwards ``p.grad`` holds the reduced gradients."""
        if self._closed is not None:
            raise RuntimeError(f"hvdsync: this DistributedOptimizer no longer synchronizes: "
                               f"{self._closed}; step the optimizer that wraps its parameters "
                               "now (this one would update with this rank's gradients alone)")
        if not self.process_set.included():
            self._synchronized = True
            return
        self._pipeline.finish_backward()
        self._reset_step_counters()
        self._synchronized = True
        self._grads.hand_over(self._pipeline.step_ok)

    @contextmanager
    def skip_synchronize(self):
        """Make ``step()`` not synchronize, for ``synchronize(); clip; step()`` patterns."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        if not self._pipeline.step_ok:  # non-finite on some rank: skipped on every rank
            self._pipeline.step_ok = True
            return None
        result = super().step(closure)
        if self.process_set.included():
            self._pipeline.after_optimizer_step()
        return result

    def _step_joined(self, step: int) -> None:
        """``hvd.join()`` on the torch engine: the other ranks take step ``step``; this one, out
        of data, takes it with them with zero gradients -- the same collectives, decisions
        and update, so its replica and state stay theirs (hvdsync.torch.joined). Its entry
        tag was the join loop's round."""
        for p in self._hooked:
            p.grad = None  # (the step gives a layer without a gradient zeros, as Horovod)
        self._comm.entries.joined_round()
        self._steps_joined += 1
        self.step()
        for p in self._hooked:
            p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pipeline.busy:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super().zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = positive_int("backward_passes_per_step", passes)
        self._reset_step_counters()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state plus hvdsync's own under ``"hvdsync"``
        (docs/checkpoints.md)."""
        state = super().state_dict()
        if self._configured:
            # tensors and plain data: loads with torch.load's default weights_only=True
            state["hvdsync"] = tensors_only(self._technique_state())
        return state

    def _technique_state(self) -> dict:
        """hvdsync's checkpoint entry (docs/checkpoints.md): the techniques' shared state and
        this rank's memory."""
        return checkpoint.state_of(self._configured, self._param_signatures,
                                   self.process_set.rank(), self.process_set.size())

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        own = state_dict.pop("hvdsync", None)
        self._pipeline.abandon_step()
        self._start_clean()
        super().load_state_dict(state_dict)
        self._restore_techniques(own)

    def _restore_techniques(self, own: Optional[dict]) -> None:
        """Load hvdsync's checkpoint entry (``None``: a checkpoint without one: the techniques
        start afresh); the next step checks that every rank restored the same."""
        restored = True
        if own is not None:
            restored = checkpoint.load_into(self._configured, own, self._param_signatures,
                                            self.process_set.rank(), self.process_set.size())
        else:
            for t in self._configured:
                t.forget()
        self._pipeline.after_load(restored)

    def _unscaled_by(self, scaler: Any) -> None:
        """``scaler.unscale_(self)`` is about to run (Horovod's mixed-precision recipe, or
        ``scaler.step``). Without ``scaler=`` the techniques that depend on the gradients'
        scale worked on scaled ones (a clip limit 2^16 times too tight, accumulations at
        changing scales): refuse before the update, naming the fix."""
        if self._grads.scaler is not None or not scaler.is_enabled():
            return
        sensitive = [t.name for t in self._pipeline.techniques if t.scale_sensitive]
        if sensitive:
            raise RuntimeError(
                f"hvdsync: a GradScaler is unscaling this optimizer's gradients (scale "
                f"{scaler.get_scale():g}), but hvd.DistributedOptimizer was not given it: "
                f"{', '.join(s + '=' for s in sensitive)} worked on the scaled gradients, "
                "which would make this update wrong. Pass the same scaler as "
                "hvd.DistributedOptimizer(..., scaler=scaler) (docs/mixed_precision.md)")

    # -- Horovod Elastic (hvdsync.torch.elastic, docs/elastic.md) ----------------------------
    def _leave_world(self) -> None:
        """Horovod is about to start again with other ranks: everything in flight is finished,
        or dropped where it fails; the next step starts clean."""
        if self.process_set.included():
            self._pipeline.leave_world()
        self._start_clean()

    def _start_clean(self) -> None:
        """The next step starts from nothing: no pass counted, nothing synchronized."""
        self._synchronized = False
        self._should_synchronize = True
        self._reset_step_counters()

    def _join_world(self) -> None:
        """Horovod runs again, perhaps with other ranks: read them anew."""
        self._comm.refresh()

    # -- hvdsync's API (with SyncAPI's) --------------------------------------------------------
    def _sync_pipeline(self) -> StepPipeline:
        return self._pipeline

    def _sync_included(self) -> bool:
        return self.process_set.included()

    @property
    def layers(self) -> list[Layer]:
        """The layers in send order, as :class:`hvdsync.Layer` objects."""
        return list(self._layers)


def _watch_unscale() -> None:
    """Let a wrapped optimizer see ``GradScaler.unscale_`` called on it (``_unscaled_by``):
    the one moment a loss scaler the wrapper was not given shows itself."""
    original = torch.amp.GradScaler.unscale_
    if getattr(original, "hvdsync_watch", False):
        return

    @functools.wraps(original)
    def unscale_(scaler, optimizer):
        if isinstance(optimizer, _DistributedOptimizer):
            optimizer._unscaled_by(scaler)
        return original(scaler, optimizer)
    unscale_.hvdsync_watch = True
    torch.amp.GradScaler.unscale_ = unscale_


_watch_unscale()


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                         compression: Any = None,
                         backward_passes_per_step: int = 1,
                         op: Any = None,
                         gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0,
                         groups: Any = None,
                         sparse_as_dense: bool = False,
                         process_set: Any = None,
                         *,
                         scaler: Any = None,
                         group_mb: Optional[float] = None,
                         between: Optional[str] = None,
                         **keywords: Unpack[TechniqueKeywords]) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so ``step()`` uses gradients reduced across the ranks (on Horovod
    or torch.distributed: :mod:`hvdsync.torch.engine`).

    Takes ``horovod.torch.DistributedOptimizer``'s arguments with the same meaning; with no
    technique on, it gives the same parameters. Returns an instance of the optimizer's class
    sharing its ``param_groups`` and ``state``, with ``synchronize()``, ``skip_synchronize()``,
    ``flush()``, ``stats`` (:class:`hvdsync.SyncStats`) and ``techniques``. A step whose
    gradients hold NaN/Inf on any rank is skipped on every rank (docs/failures.md).

    Args:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``model.named_parameters()``; names identify collectives and group
            parameters into layers. Without it every parameter is its own layer.
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
        op: ``hvd.Average`` or ``hvd.Sum``.
        backward_passes_per_step: backward passes accumulated locally before a reduction.
        gradient_predivide_factor: with Average, scale by 1/f before and f/size after the sum.
        num_groups: Horovod's deprecated form of ``groups=int``.
        groups: Horovod's grouping: an int (contiguous chunks) or lists of parameters reduced
            together; not with ``layers``.
        sparse_as_dense: reduce sparse gradients as dense tensors.
        process_set: reduce over this process set only (default: every rank).
        **keywords: hvdsync's ``layers=`` (its grouping of parameters into layers) and its
            techniques ``clip=``, ``threshold=``, ``select=``, ``sparse=``, ``lowrank=``,
            ``delay=``, each a config, a dict of its fields or a shorthand
            (:class:`hvdsync.techniques.TechniqueKeywords`). With ``delay=`` call ``flush()``
            before evaluating or saving.
        scaler: the ``torch.amp.GradScaler`` of mixed precision: the techniques see unscaled
            gradients; ``synchronize()`` leaves them scaled (docs/mixed_precision.md).
        group_mb: the size of a *ready group* in MiB: backward's consecutive layers are
            clipped, measured and sent a group at a time, a few multi-tensor ops per group
            (docs/design.md, "Ready groups"). Default: DDP's buckets, the step's first 1 MiB
            and the others 25 MiB; on Horovod with nothing on, every layer alone (as
            Horovod's optimizer sends them; its cycle fuses them). A number: every group
            that size (``25``: the fewest ops; ``0``: every layer alone, sent the moment it
            is ready).
        between: ``"nodes"``: the techniques run between nodes only, on each node's gradient,
            which its ranks average inside the node in full precision first (docs/nodes.md;
            on Horovod, ``hvd.init(process_sets=hvd.node_process_sets())``). Default: every
            rank alike, as Horovod.
    """
    layers, techniques = rules.given(keywords, _HOROVOD_ARGS + ("scaler", "group_mb",
                                                                "between"),
                                     "DistributedOptimizer")
    between = check_between(between)
    # (None: the default, core.groups.default_group_bytes, once the techniques are known)
    group_bytes = (None if group_mb is None else
                   (int(non_negative_float("group_mb", group_mb) * 2**20),) * 2)
    _check_wrappable(optimizer, scaler)
    compression, op, process_set, configs, groups = checked_arguments(
        compression, op, process_set, backward_passes_per_step, gradient_predivide_factor,
        sparse_as_dense, num_groups, groups, layers, techniques)

    cls = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    # Share the wrapped optimizer's state (param_groups, state, defaults, hooks): it keeps
    # its own hyper-parameters and anything it already accumulated.
    wrapped.__dict__.update(optimizer.__dict__)
    if between and op not in (engine.ops().Average, engine.ops().Sum):
        raise ValueError("between='nodes' reduces inside the node, then between nodes: it "
                         "supports op=Average or op=Sum")
    wrapped._hvdsync_init(named_parameters, compression, backward_passes_per_step, op,
                          gradient_predivide_factor, groups, sparse_as_dense, process_set,
                          layers, configs, scaler, group_bytes, between)
    return wrapped


def checked_arguments(compression: Any, op: Any, process_set: Any,
                      backward_passes_per_step: int, gradient_predivide_factor: float,
                      sparse_as_dense: bool, num_groups: int, groups: Any, layers: Any,
                      techniques: dict[str, Any]) -> tuple[Any, Any, Any, dict, Any]:
    """Horovod's arguments and hvdsync's techniques checked on the active engine (also for
    Keras on its torch backend), with Horovod's defaults for what was not given (no
    compression, ``Average``, the global process set): ``(compression, op, process_set,
    configs, groups)``."""
    ops = engine.ops()
    compression = ops.Compression.none if compression is None else compression
    op = ops.Average if op is None else op
    if process_set is None or (getattr(process_set, "process_set_id", None) == 0
                               and not isinstance(process_set, ops.ProcessSet)):
        process_set = ops.global_process_set  # Horovod's global set on the torch backend too
    configs, groups = rules.check_arguments(
        ops, compression=compression, backward_passes_per_step=backward_passes_per_step,
        op=op, gradient_predivide_factor=gradient_predivide_factor,
        sparse_as_dense=sparse_as_dense, process_set=process_set, num_groups=num_groups,
        groups=groups, layers=layers, **techniques)
    return compression, op, process_set, configs, groups


def _owner(p: torch.Tensor) -> Any:
    """The live hvdsync wrapper whose hooks synchronize ``p``, if any."""
    ref = getattr(p, "_hvdsync_owner", None)
    return ref() if ref is not None else None


def _take_over(params: list[torch.Tensor]) -> None:
    """A wrapper that synchronizes these parameters already hands them over (rebuilding the
    optimizer to load a checkpoint): its hooks would fire too, counting every backward
    twice."""
    earlier = {id(o): o for p in params
               if (o := _owner(p)) is not None}
    for wrapper in earlier.values():
        wrapper.close("a newer DistributedOptimizer wraps its parameters")


def _check_wrappable(optimizer: Any, scaler: Any) -> None:
    """A clear error for what :func:`DistributedOptimizer` cannot wrap."""
    if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in
                                      ("get_scale", "is_enabled", "update", "unscale_")):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already wrapped by hvdsync.torch.DistributedOptimizer")
