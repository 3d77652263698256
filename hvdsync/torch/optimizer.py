"""hvdsync's torch ``DistributedOptimizer``: Horovod's contract, hvdsync's control of sends.

The wrapper owns one post-accumulate-grad hook per parameter. When the last parameter of a
*layer* (see :mod:`hvdsync.layers`) has its gradient for this step, the layer's send starts
at once, overlapping the rest of backward; ``synchronize()`` (called by ``step()``) sends
what has not been sent (unused parameters get zero gradients, as in Horovod), waits, and
writes the reduced gradients back into ``p.grad`` before the wrapped optimizer steps.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any, Optional

import torch
from horovod.torch.compression import Compression
from horovod.torch.mpi_ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum,
                                   global_process_set)

from hvdsync.clipping import ClipConfig
from hvdsync.config import (check_bool, check_reduce_op, positive_float, positive_int,
                            reject_unknown_kwargs)
from hvdsync.delay import DelayConfig
from hvdsync.layers import Grouping, build_layers
from hvdsync.select import SelectConfig
from hvdsync.sparse import SparseConfig
from hvdsync.stats import SyncStats
from hvdsync.threshold import ThresholdConfig
from hvdsync.torch.clipping import LayerClipper
from hvdsync.torch.comm import GradientAllreduce, Pending, payload_bytes
from hvdsync.torch.delay import DelayedGradients
from hvdsync.torch.select import SelectedPushes
from hvdsync.torch.sparse import SparseExchange
from hvdsync.torch.threshold import AccumulationThreshold

_HOROVOD_ARGS = ("named_parameters", "compression", "backward_passes_per_step", "op",
                 "gradient_predivide_factor", "num_groups", "groups", "sparse_as_dense",
                 "process_set")
_HVDSYNC_ARGS = ("layers", "clip", "threshold", "sparse", "select", "delay")


class _DistributedOptimizer:
    """Mixed in front of the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    # -- construction -----------------------------------------------------------------------
    def _hvdsync_init(self, named_parameters, compression, backward_passes_per_step, op,
                      gradient_predivide_factor, groups, sparse_as_dense, process_set,
                      layers: Grouping, clip: ClipConfig | None,
                      threshold: ThresholdConfig | None, sparse: SparseConfig | None,
                      select: SelectConfig | None, delay: DelayConfig | None) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        names = _parameter_names(params, named_parameters)
        self._param_names: dict[torch.Tensor, str] = names
        by_name = {n: p for p, n in names.items()}

        if groups is not None and layers is not None:
            raise ValueError("pass either groups (Horovod's) or layers (hvdsync's), not both")
        grouping = layers if layers is not None else _groups_to_names(groups, names)
        trainable = [names[p] for p in params if p.requires_grad]
        self._layers = build_layers(trainable, grouping)
        self._layer_params: list[list[tuple[str, torch.Tensor]]] = [
            [(n, by_name[n]) for n in layer.param_names] for layer in self._layers]
        self._layer_of: dict[torch.Tensor, int] = {
            p: layer.index for layer in self._layers for p in (by_name[n] for n in layer.param_names)}

        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._compression = compression
        self._allreduce = GradientAllreduce(compression, op, gradient_predivide_factor,
                                            sparse_as_dense, process_set)
        layer_names = [layer.name for layer in self._layers]
        self.stats = SyncStats(layer_names)
        self._clipper = (LayerClipper(clip, len(self._layers), layer_names, self.stats)
                         if clip is not None else None)
        self._sparse = (SparseExchange(sparse, self._allreduce, self.stats)
                        if sparse is not None else None)
        self._select = (SelectedPushes(select, self._layer_params, process_set, self.stats)
                        if select is not None else None)
        self._threshold = (AccumulationThreshold(
            threshold, [[p for _, p in lp] for lp in self._layer_params], self.state,
            process_set, self.stats) if threshold is not None else None)
        self._delay = (DelayedGradients(delay, self._allreduce, self._layer_params, layer_names,
                                        process_set, self.stats) if delay is not None else None)
        #: ``(layer name, time.perf_counter())`` when each layer's send started, for the
        #: current step (or the last one, after ``step()``): shows sends overlapping backward.
        self.send_times: list[tuple[str, float]] = []
        self._step_open = False

        self._pending: dict[int, Pending] = {}
        self._sparse_queue: list[tuple[int, torch.Tensor]] = []
        self._sparse_done: set[torch.Tensor] = set()
        self._named_params = [item for lp in self._layer_params for item in lp]
        self._synchronized = False
        self._should_synchronize = True
        self._reset_step_counters()
        self._hook_handles = []
        if process_set.included():
            for p in self._layer_of:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _reset_step_counters(self) -> None:
        self._passes_left = {p: self.backward_passes_per_step for p in self._layer_of}
        self._ready_in_layer = [0] * len(self._layers)
        self._prepared = [False] * len(self._layers)
        self._dispatched = [False] * len(self._layers)

    # -- backward: per-parameter hook ---------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        left = self._passes_left[p] - 1
        if left < 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._passes_left[p] = left
        if left == 0:
            li = self._layer_of[p]
            self._ready_in_layer[li] += 1
            if self._ready_in_layer[li] == len(self._layer_params[li]):
                self._prepare_layer(li)
                # With a threshold the send/skip decision needs every layer's accumulation,
                # and sparse gradients are sent together after the counts collective, so
                # those sends start in synchronize(); the rest right now, overlapping backward.
                if self._threshold is None and not self._has_sparse(li):
                    self._dispatch(li)

    def _has_sparse(self, li: int) -> bool:
        return self._sparse is not None and any(
            p.grad is not None and p.grad.is_sparse for _, p in self._layer_params[li])

    def _prepare_layer(self, li: int) -> None:
        """The layer's local gradient is final: fill unused ones with zeros, clip locally."""
        params = self._layer_params[li]
        for _, p in params:
            if p.grad is None:
                # Unused on this rank; other ranks may have a gradient, so still take part
                # (Horovod does the same), with zero rows where other ranks' are sparse.
                sparse = self._sparse is not None and self._sparse.is_sparse(p)
                p.grad = self._sparse.empty_gradient(p) if sparse else torch.zeros_like(p)
            # What plain Horovod would send: a sparse gradient as backward left it.
            self.stats.dense(payload_bytes(p.grad))
            if p.grad.is_sparse and self._sparse is not None:
                self._sparse.coalesce(p)  # before clipping, so the duplicates are counted
        if self._clipper is not None and self._clipper.config.mode == "local":
            self._clipper.clip(li, [p for _, p in params])
        if self._select is not None:
            self._select.layer_ready(li)
        self._prepared[li] = True

    def _dispatch(self, li: int) -> None:
        """Send the layer, or (with ``select=``) skip it if it is not pushed this step."""
        self._dispatched[li] = True
        if self._select is not None and not self._select.pushes(li):
            self.stats.skipped(self._layers[li].name)
        else:
            self._send_layer(li)

    def _send_layer(self, li: int) -> None:
        params = self._layer_params[li]
        name = self._layers[li].name
        if not self._step_open:
            self._step_open = True
            self.send_times = []
        self.send_times.append((name, time.perf_counter()))
        if self._sparse is not None:
            sparse = {p for _, p in params if p.grad.is_sparse or self._sparse.is_sparse(p)}
            self._sparse_queue += [(li, p) for _, p in params
                                   if p in sparse and p not in self._sparse_done]
            params = [(n, p) for n, p in params if p not in sparse]
        if self._delay is not None:
            self._add_pending(li, self._delay.start(li, f"hvdsync.{name}", params))
        else:
            self._add_pending(li, self._allreduce.start(f"hvdsync.{name}", params))

    def _add_pending(self, li: int, pending: Pending) -> None:
        mine = self._pending.setdefault(li, Pending())
        mine.finishers += pending.finishers
        mine.nbytes += pending.nbytes
        mine.collectives += pending.collectives

    def _send_sparse(self) -> None:
        """Send the queued sparse gradients together (one grouped collective per route)."""
        for li, pending in self._sparse.start(self._sparse_queue).items():
            self._add_pending(li, pending)
        self._sparse_queue = []

    # -- Horovod's public API ---------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every layer's reduction; afterwards ``p.grad`` holds the reduced gradients."""
        if not self.process_set.included():
            self._synchronized = True
            return
        held: set[int] = set()
        self._sparse_done = set()
        if self._sparse is not None:
            # Layers with an unused parameter whose layout (sparse or dense) no rank has
            # shown yet wait for the shared layouts before they are filled and sent.
            held = {self._layer_of[p] for p in self._sparse.begin(self._named_params)}
        # Layers in fixed order, so every rank starts the remaining collectives alike.
        for li in range(len(self._layers)):
            if not self._prepared[li] and li not in held:
                self._prepare_layer(li)
        if self._sparse is not None and self._sparse.config.one_round:
            items = [(self._layer_of[p], p) for _, p in self._named_params
                     if p in self._sparse.predicted]
            for li, pending in self._sparse.start_predicted(items).items():
                self._add_pending(li, pending)
            self._sparse_done = {p for _, p in items}
            for li in sorted(held):
                self._prepare_layer(li)
        if self._threshold is not None:
            for li, send in enumerate(self._threshold.decide()):
                if send:
                    self._threshold.before_send(li)
                    self._send_layer(li)
                else:
                    self._threshold.on_skip(li)
                    self.stats.skipped(self._layers[li].name)
        else:
            for li in range(len(self._layers)):
                if not self._dispatched[li]:
                    self._dispatch(li)
        if self._sparse_queue:
            self._send_sparse()
        for li in sorted(self._pending):
            self.stats.sent(self._layers[li].name, self._pending[li].nbytes,
                            self._pending[li].collectives)
        clip_after = self._clipper is not None and self._clipper.config.mode == "global"
        for li in sorted(self._pending):
            self._pending[li].wait()
            if clip_after:
                self._clipper.clip(li, [p for _, p in self._layer_params[li]])
        self._pending.clear()
        self._reset_step_counters()
        if self._delay is not None:
            self._delay.fold(self.state)
        if self._sparse is not None:
            self._sparse.end_step()
        if self._select is not None:
            self._select.end_step()
        if self._clipper is not None:
            self._clipper.end_step()
        self.stats.end_step()
        self._synchronized = True
        self._step_open = False

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
        result = super().step(closure)
        if self._delay is not None:
            self._delay.after_optimizer_step(self.state)
        return result

    def flush(self) -> int:
        """With ``delay=``: wait for every outstanding global gradient and average the
        parameters (and, with ``optimizer_state="average"``, the optimizer state), so every
        replica is identical -- e.g. before evaluating or saving, or at the end of training.
        Call it on every rank (it is a collective unless the last step already averaged).

        The outstanding global gradients are not folded in as another optimizer step: the
        averaged parameters already hold every rank's local contribution of those steps,
        whose average is their global gradient. Returns how many this rank dropped (also
        counted as ``discarded`` in ``stats``); training that ends on a multiple of
        ``average_every`` steps has none. Without ``delay=`` it does nothing and returns 0.
        """
        if self._delay is None or not self.process_set.included():
            return 0
        return self._delay.flush(self.state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super().zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = positive_int("backward_passes_per_step", passes)
        self._reset_step_counters()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state plus hvdsync's own under ``"hvdsync"``."""
        state = super().state_dict()
        own = {}
        if self._clipper is not None:
            own["clip"] = self._clipper.policy.state_dict()
        if self._threshold is not None:
            own["threshold"] = self._threshold.policy.state_dict()
        if self._select is not None:
            own["select"] = self._select.state_dict(self._param_names)
        if self._delay is not None:
            own["delay"] = self._delay.policy.state_dict()
        if own:
            state["hvdsync"] = own
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        own = state_dict.pop("hvdsync", {})
        if self._clipper is not None and "clip" in own:
            self._clipper.policy.load_state_dict(own["clip"])
        if self._threshold is not None:
            self._threshold.forget()
            if "threshold" in own:
                self._threshold.policy.load_state_dict(own["threshold"])
        if self._select is not None:
            if "select" in own:
                self._select.load_state_dict(
                    own["select"], {n: p for p, n in self._param_names.items()})
            else:
                self._select.forget()
        if self._delay is not None:
            self._delay.discard()
            if "delay" in own:
                self._delay.policy.load_state_dict(own["delay"])
        for pending in self._pending.values():
            pending.wait()
        self._pending.clear()
        self._synchronized = False
        self._should_synchronize = True
        self._reset_step_counters()
        super().load_state_dict(state_dict)

    @property
    def selection(self) -> dict[str, list]:
        """With ``select=``: the last step's per-layer ``local_scores``, rank-averaged
        ``scores``, ``residual_norms`` and (hypernet) ``alpha``, and the layers chosen for the
        next step (``next``, layer names). Empty without ``select=``."""
        if self._select is None:
            return {}
        nxt = [layer.name for layer, s in zip(self._layers, self._select.selector.selected) if s]
        return {**self._select.last, "next": nxt}

    @property
    def delay_status(self) -> dict[str, Any]:
        """With ``delay=``: finished ``step`` count, ids (step numbers) of the ``outstanding``
        global gradients, the ids the last step folded in (``last_folded``, newest first) and
        the ``staleness`` histogram ``{lag in steps: count}``. Empty without ``delay=``."""
        return self._delay.status() if self._delay is not None else {}

    @property
    def layers(self):
        """The layers in send order, as :class:`hvdsync.Layer` objects."""
        return list(self._layers)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                         compression: Any = Compression.none,
                         backward_passes_per_step: int = 1,
                         op: Any = Average,
                         gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0,
                         groups: Any = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         *,
                         layers: Grouping = None,
                         clip: ClipConfig | dict | float | None = None,
                         threshold: ThresholdConfig | dict | float | None = None,
                         sparse: SparseConfig | dict | bool | float | None = None,
                         select: SelectConfig | dict | float | None = None,
                         delay: DelayConfig | dict | bool | int | None = None,
                         **unknown: Any) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so ``step()`` uses gradients reduced across Horovod ranks.

    Takes ``horovod.torch.DistributedOptimizer``'s arguments with the same meaning, and with
    no hvdsync technique enabled gives the same parameters. The returned object is an instance
    of the wrapped optimizer's class (sharing its ``param_groups`` and ``state``) with
    ``synchronize()``, ``skip_synchronize()`` and ``stats`` (:class:`hvdsync.SyncStats`).

    Args:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``model.named_parameters()``; names identify collectives and group
            parameters into layers. Without it every parameter is its own layer.
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
        backward_passes_per_step: backward passes accumulated locally before a reduction.
        op: ``hvd.Average`` (default) or ``hvd.Sum`` (Adasum is not supported).
        gradient_predivide_factor: with Average, scale by 1/f before and f/size after the sum.
        num_groups: deprecated Horovod alias of ``groups=int``.
        groups: Horovod's explicit grouping: an int (contiguous chunks of parameters) or a list
            of lists of parameters reduced together. Mutually exclusive with ``layers``.
        sparse_as_dense: reduce sparse gradients as dense tensors.
        process_set: reduce over this Horovod process set only.
        layers: hvdsync's grouping of parameters into layers (the unit sent together and,
            with the techniques, decided on): ``None`` groups by module, or a callable /
            mapping from parameter name to layer name, see :data:`hvdsync.layers.Grouping`.
        clip: per-layer gradient clipping pipelined with the sends
            (:class:`hvdsync.ClipConfig`, a dict of its fields, or a number meaning
            ``max_norm``); see :mod:`hvdsync.clipping`.
        threshold: communicate a layer only when its accumulated gradient is large enough
            (:class:`hvdsync.ThresholdConfig`, a dict of its fields, or a number); see
            :mod:`hvdsync.threshold`.
        sparse: exchange row-sparse gradients (embeddings) with one counts collective and one
            grouped allgather of deduplicated rows, switching to a dense allreduce where that
            is cheaper (``True``, :class:`hvdsync.SparseConfig`, a dict of its fields, or a
            number meaning ``dense_ratio``); see :mod:`hvdsync.sparse`. Exclusive with
            ``sparse_as_dense``.
        select: push only the top-k layers per step, ranked by a tiny hypernetwork trained
            alongside the model (or by residual norm / at random); the others accumulate
            into a residual pushed later (:class:`hvdsync.SelectConfig`, a dict of its fields,
            or a number meaning ``k``); see :mod:`hvdsync.select`. Exclusive with
            ``threshold``.
        delay: update with the local gradient at once and fold in each step's global
            gradient when it arrives (at most ``staleness`` steps late), averaging the
            parameters every ``average_every`` steps (:class:`hvdsync.DelayConfig`, a dict
            of its fields, ``True`` for the defaults, or an int meaning ``staleness``); see
            :mod:`hvdsync.delay`. Needs ``op=Average``; not combinable with ``threshold``,
            ``select``, ``sparse`` or global-mode ``clip``. Call :meth:`flush` before
            evaluating or saving to make the replicas identical.
    """
    reject_unknown_kwargs(unknown, _HOROVOD_ARGS + _HVDSYNC_ARGS, "DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already wrapped by hvdsync.torch.DistributedOptimizer")
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise TypeError("compression must provide compress() and decompress(), e.g. "
                        f"hvd.Compression.fp16; got {compression!r}")
    positive_int("backward_passes_per_step", backward_passes_per_step)
    check_reduce_op(op, average=Average, sum_=Sum, adasum=Adasum, others=(Min, Max, Product),
                    gradient_predivide_factor=positive_float("gradient_predivide_factor",
                                                             gradient_predivide_factor))
    check_bool("sparse_as_dense", sparse_as_dense)
    clip = ClipConfig.coerce(clip)
    threshold = ThresholdConfig.coerce(threshold)
    sparse = SparseConfig.coerce(sparse)
    select = SelectConfig.coerce(select)
    delay = DelayConfig.coerce(delay)
    if delay is not None:
        _check_delay_combination(op, clip, threshold, sparse, select)
    if select is not None and threshold is not None:
        raise ValueError("select= and threshold= both decide which layers are sent each step; "
                         "pass one of them")
    if sparse is not None and sparse_as_dense:
        raise ValueError("sparse_as_dense=True always sends sparse gradients dense; sparse= "
                         "chooses per step (dense_ratio=0 always sends dense): pass one of them")
    if sparse is not None and op not in (Average, Sum):
        raise ValueError("sparse= sums gathered rows, so it supports op=Average or op=Sum only")
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a horovod ProcessSet, got {process_set!r}")
    if num_groups:
        warnings.warn("num_groups is deprecated; use groups", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups

    cls = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    # Share the wrapped optimizer's state (param_groups, state, defaults, hooks): it keeps
    # its own hyper-parameters and anything it already accumulated.
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvdsync_init(named_parameters, compression, backward_passes_per_step, op,
                          gradient_predivide_factor, groups, sparse_as_dense, process_set,
                          layers, clip, threshold, sparse, select, delay)
    return wrapped


def _check_delay_combination(op, clip, threshold, sparse, select) -> None:
    """delay= replaces the gradient exchange itself; refuse what it cannot be combined with."""
    if op != Average:
        raise ValueError("delay= mixes local gradients with averaged global ones, so it needs "
                         "op=Average")
    others = {"threshold": threshold, "select": select, "sparse": sparse}
    given = [name for name, value in others.items() if value is not None]
    if given:
        raise ValueError(f"delay= cannot be combined with {', '.join(given)}= (each of them "
                         "decides what is sent each step); pass one of them")
    if clip is not None and clip.mode == "global":
        raise ValueError("delay= folds the global gradient in later, so clip mode 'global' "
                         "(clipping the averaged gradient before the step) does not apply; "
                         "use clip mode 'local'")


def _parameter_names(params: list[torch.Tensor],
                     named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]]
                     ) -> dict[torch.Tensor, str]:
    """Name of every optimized parameter, validating ``named_parameters`` like Horovod."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
    if isinstance(named_parameters, (str, bytes, dict)) or not isinstance(named_parameters, Iterable):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually produced by model.named_parameters()")
    pairs = list(named_parameters)
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError("named_parameters should be a sequence of (name, parameter) "
                             "tuples, usually produced by model.named_parameters(); got an "
                             f"item of type {type(item).__name__}")
    counts = Counter(n for n, _ in pairs)
    dups = sorted(n for n, c in counts.items() if c > 1)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(dups)}")
    names = {p: n for n, p in pairs}
    unnamed = [f"param_groups position {i} (shape {tuple(p.shape)})"
               for i, p in enumerate(params) if p not in names]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         f"were not named: {'; '.join(unnamed[:5])}")
    return {p: names[p] for p in params}


def _groups_to_names(groups: Any, names: dict[torch.Tensor, str]) -> Grouping:
    """Horovod's ``groups`` (int, or lists of tensors) as a name-based grouping."""
    if groups is None:
        return None
    if isinstance(groups, int) and not isinstance(groups, bool):
        return groups
    if isinstance(groups, list):
        out = []
        for group in groups:
            if not isinstance(group, (list, tuple)):
                raise ValueError("groups should be a positive int or a list of lists of "
                                 "torch.Tensor")
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor")
                if p not in names:
                    raise ValueError("groups contains a tensor that the optimizer does not "
                                     f"optimize (shape {tuple(p.shape)})")
            out.append([names[p] for p in group if p.requires_grad])
        return out
    raise ValueError(f"groups should be a positive int or a list of lists of torch.Tensor, "
                     f"got {groups!r}")
