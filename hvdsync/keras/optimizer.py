"""hvdsync's Keras 3 ``DistributedOptimizer`` (TensorFlow backend): Horovod's contract,
hvdsync's control of what is sent.

The wrapper is a subclass of the wrapped optimizer's class whose gradient application first
exchanges the gradients across ranks. It works in ``model.fit`` in the default compiled mode
(and with ``run_eagerly=True``). A *layer* is one Keras layer's trainable variables (variable
paths ``dense_1/kernel`` + ``dense_1/bias`` -> ``dense_1``).

Two paths, chosen at construction:

* **plain** (no technique, or only ``clip``): Horovod's ops are built into the train function,
  one grouped allreduce per layer, each depending only on its layer's (clipped) gradient, so
  the graph executor sends a layer as soon as backward has produced it;
* **eager exchange** (``threshold``, ``select``, ``sparse``, ``delay``): these keep memory
  across steps and decide per step from statistics shared between ranks, so their exchange
  runs as Python inside ``tf.py_function`` (eager Horovod ops with explicit names), with the
  same framework-neutral policies as the torch adapter. A second ``tf.py_function`` after the
  update handles what must follow it (undoing skipped layers, averaging the replicas).

Either way every rank builds the same collectives in the same order (layers in a fixed order,
decisions from shared values only).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import numpy as np
import tensorflow as tf
import keras
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.mpi_ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum,
                                        global_process_set)

from hvdsync.clipping import ClipConfig
from hvdsync.config import (check_bool, check_reduce_op, positive_float, positive_int,
                            reject_unknown_kwargs)
from hvdsync.delay import DelayConfig
from hvdsync.keras.clipping import GraphClipper
from hvdsync.keras.comm import Reducer, payload_bytes
from hvdsync.keras.delay import EagerDelay
from hvdsync.keras.saving import STATE_KEY, pack_state, unpack_state
from hvdsync.keras.select import EagerSelect
from hvdsync.keras.sparse import EagerSparse
from hvdsync.keras.techniques import EagerTechnique, Slots, StepLayout
from hvdsync.keras.threshold import EagerThreshold
from hvdsync.layers import Grouping, build_layers
from hvdsync.select import SelectConfig
from hvdsync.sparse import SparseConfig
from hvdsync.stats import SyncStats
from hvdsync.threshold import ThresholdConfig

_HOROVOD_ARGS = ("name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
                 "gradient_predivide_factor", "op", "backward_passes_per_step",
                 "average_aggregated_gradients", "num_groups", "groups", "process_set",
                 "scale_local_gradients")
_HVDSYNC_ARGS = ("layers", "clip", "threshold", "sparse", "select", "delay")


def keras_layer_of(path: str) -> str:
    """Default layer of a variable: its Keras layer (``"dense_1/kernel"`` -> ``"dense_1"``)."""
    return path.rsplit("/", 1)[0] if "/" in path else path


class _Hvdsync:
    """All of the wrapper's own state, in one plain object: Keras tracks lists and dicts set
    on an optimizer and would adopt the model variables they hold as optimizer variables."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


class _DistributedOptimizer:
    """Mixed in front of the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    _hv: _Hvdsync

    # -- construction ---------------------------------------------------------------------
    def build(self, variables):
        super().build(variables)
        self._hvdsync_build(list(variables))

    def _hvdsync_build(self, variables: list) -> None:
        hv = self._hv
        names = [v.path for v in variables]
        hv.layers = build_layers(names, hv.grouping)
        hv.layer_of = {n: layer.index for layer in hv.layers for n in layer.param_names}
        layer_names = [layer.name for layer in hv.layers]
        hv.stats = SyncStats(layer_names)
        hv.variables = {v.path: v for v in variables}
        slots = Slots(self.variables, list(variables))
        hv.clipper = GraphClipper(hv.clip, layer_names, hv.stats) if hv.clip else None
        technique: Optional[EagerTechnique] = None
        if hv.threshold is not None:
            technique = EagerThreshold(hv.threshold, len(hv.layers), hv.reducer, slots, hv.stats)
        elif hv.select is not None:
            technique = EagerSelect(hv.select, len(hv.layers), hv.reducer, slots, hv.stats)
        elif hv.delay is not None:
            technique = EagerDelay(hv.delay, hv.reducer, slots, hv.stats)
        elif hv.sparse is not None:
            technique = EagerSparse(hv.sparse, hv.reducer, hv.stats)
        hv.technique = technique
        hv.last_layout = None
        if hv.pending_state is not None:
            state, hv.pending_state = hv.pending_state, None
            self._load_hvdsync_state(state)

    # -- the step ---------------------------------------------------------------------------
    def _backend_apply_gradients(self, grads, trainable_variables):
        hv = self._hv
        if _in_xla_context():
            raise RuntimeError("hvdsync.keras.DistributedOptimizer uses Horovod ops, which XLA "
                               "cannot compile: pass jit_compile=False to model.compile()")
        steps = self.gradient_accumulation_steps
        if not steps:
            return self._exchange_and_apply(grads, trainable_variables)
        # backward_passes_per_step: accumulate locally (Keras' accumulators), exchange and
        # update on every steps-th call -- a condition every rank evaluates alike.
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        accs = [self._accumulated_gradients[self._get_variable_index(v)]
                for v in trainable_variables]

        def update():
            total = [g + a for g, a in zip(grads, accs)]
            if hv.average_aggregated_gradients:
                total = [t / steps for t in total]
            self._exchange_and_apply(total, trainable_variables)
            self._backend_reset_gradient_accumulators()

        keras.ops.cond((self._iterations + 1) % steps == 0, update,
                       lambda: self._backend_increment_gradient_accumulators(grads, accs))

    def _apply_update(self, grads, variables) -> None:
        """The wrapped optimizer's own update, without its gradient accumulation."""
        steps = self.gradient_accumulation_steps
        self.gradient_accumulation_steps = None
        try:
            super()._backend_apply_gradients(grads, variables)
        finally:
            self.gradient_accumulation_steps = steps

    def _layout(self, variables) -> StepLayout:
        hv = self._hv
        positions: dict[int, list[int]] = {}
        for pos, v in enumerate(variables):
            positions.setdefault(hv.layer_of[v.path], []).append(pos)
        return StepLayout(list(variables), sorted(positions.items()),
                          [layer.name for layer in hv.layers])

    def _exchange_and_apply(self, grads, variables) -> None:
        hv = self._hv
        grads = list(grads)
        layout = self._layout(variables)
        hv.last_layout = layout
        if not hv.process_set.included():
            self._apply_update(grads, variables)
            return
        clip_records, clipped_layers = [], []
        local_clip = hv.clipper is not None and hv.clip.mode == "local"
        if local_clip:
            for li, positions in layout.layers:
                new, record = hv.clipper.clip(li, [grads[p] for p in positions],
                                              [variables[p] for p in positions])
                for p, g in zip(positions, new):
                    grads[p] = g
                clip_records.append(record)
                clipped_layers.append(li)
        if hv.technique is None:
            self._plain_exchange(layout, grads, clip_records, clipped_layers)
            return
        if not hv.technique.accepts_sparse and any(isinstance(g, tf.IndexedSlices) for g in grads):
            names = [v.path for v, g in zip(variables, grads) if isinstance(g, tf.IndexedSlices)]
            raise ValueError(f"{hv.technique_name}= does not support sparse (IndexedSlices) "
                             f"gradients, which {names} have: pass sparse_as_dense=True")
        if hv.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        new_grads = self._run_eagerly_in_step(hv.technique.before_apply, layout, grads,
                                              [v.value for v in variables]
                                              if hv.technique.needs_values else [])
        with tf.control_dependencies(_tensors_of(new_grads)):
            self._apply_update(new_grads, variables)
        after = [tf.convert_to_tensor(v.value) for v in variables]  # read after the update
        record = tf.stack(clip_records) if clip_records else tf.zeros([0, 2], tf.float32)

        def finish(record, *_):
            hv.technique.after_apply(layout)
            self._end_step(clipped_layers, record.numpy())
            return tf.zeros([], tf.int32)
        tf.py_function(finish, [record, *after], tf.int32)

    def _plain_exchange(self, layout: StepLayout, grads: list, clip_records, clipped_layers):
        """Horovod's path in the graph: one grouped allreduce per layer (fixed layer order)."""
        hv = self._hv
        reducer = hv.reducer
        sent, dense, collectives = [], [], []
        for li, positions in layout.layers:
            layer = [grads[p] for p in positions]
            reduced = reducer.reduce(layer)
            if hv.clipper is not None and hv.clip.mode == "global":
                reduced, record = hv.clipper.clip(li, reduced, [layout.variables[p]
                                                                for p in positions])
                clip_records.append(record)
                clipped_layers.append(li)
            for p, r in zip(positions, reduced):
                grads[p] = r
            sent.append(tf.add_n([_bytes_tensor(reducer, g, wire=True) for g in layer]))
            dense.append(tf.add_n([_bytes_tensor(reducer, g, wire=False) for g in layer]))
            collectives.append(reducer.collectives(layer) if reducer.size > 1 else 0)
        layers = [li for li, _ in layout.layers]
        self._apply_update(grads, layout.variables)
        record = tf.stack(clip_records) if clip_records else tf.zeros([0, 2], tf.float32)

        def finish(sent, dense, record):
            st = hv.stats
            for li, nbytes, d, c in zip(layers, sent.tolist(), dense.tolist(), collectives):
                st.dense(int(d))
                if reducer.size > 1:
                    st.sent(layout.names[li], int(nbytes), c)
            self._end_step(clipped_layers, record)
            return np.int32(0)
        tf.numpy_function(finish, [tf.stack(sent), tf.stack(dense), record], tf.int32,
                          stateful=True)

    def _run_eagerly_in_step(self, fn, layout: StepLayout, grads: list, values: list) -> list:
        """Run ``fn(layout, grads, values)`` eagerly inside the train function; gradients go in
        and out as tensors (``IndexedSlices`` as values + indices)."""
        flat, spec = _flatten(grads, [v.shape for v in layout.variables])

        def call(*tensors):
            n = len(flat)
            out = fn(layout, _unflatten(list(tensors[:n]), spec), list(tensors[n:]))
            out_flat, out_spec = _flatten(out, [v.shape for v in layout.variables])
            if [s[0] for s in out_spec] != [s[0] for s in spec]:
                raise RuntimeError("hvdsync: an eager technique changed the gradient layout")
            return out_flat
        results = tf.py_function(call, flat + list(values), [t.dtype for t in flat])
        for r, t in zip(results, flat):
            r.set_shape(t.shape if t.shape.is_fully_defined() else [None] * t.shape.rank)
        return _unflatten(list(results), spec)

    def _end_step(self, clipped_layers: list[int], records) -> None:
        hv = self._hv
        if hv.clipper is not None:
            hv.clipper.end_step(clipped_layers, np.asarray(records))
        hv.stats.end_step()

    # -- hvdsync's public API -----------------------------------------------------------------
    @property
    def stats(self) -> SyncStats:
        """Communication statistics (:class:`hvdsync.SyncStats`); available once built."""
        hv = self._hv
        if not hasattr(hv, "stats"):
            raise AttributeError("stats exist once the optimizer is built (after the first "
                                 "training step or optimizer.build(model.trainable_variables))")
        return hv.stats

    @property
    def hvdsync_layers(self):
        """The layers in send order, as :class:`hvdsync.Layer` objects (once built)."""
        return list(getattr(self._hv, "layers", []))

    @property
    def selection(self) -> dict[str, list]:
        """With ``select=``: the last step's per-layer scores and the layers chosen for the
        next step (``next``). Empty without ``select=``."""
        t = getattr(self._hv, "technique", None)
        if not isinstance(t, EagerSelect):
            return {}
        nxt = [layer.name for layer, s in zip(self._hv.layers, t.selector.selected) if s]
        return {**t.last, "next": nxt}

    @property
    def delay_status(self) -> dict[str, Any]:
        """With ``delay=``: finished ``step`` count, ``outstanding`` ids, ``last_folded`` and
        the ``staleness`` histogram. Empty without ``delay=``."""
        t = getattr(self._hv, "technique", None)
        return t.status() if isinstance(t, EagerDelay) else {}

    @property
    def sparse_routes(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """With ``sparse=``: per variable, the last step's route, per-rank distinct-row counts
        and the rows handed to the optimizer (duplicates across ranks summed)."""
        t = getattr(self._hv, "technique", None)
        return dict(t.last_routes) if isinstance(t, EagerSparse) else {}

    def flush(self) -> int:
        """With ``delay=``: wait for the outstanding global gradients and average the replicas
        (call on every rank, outside the train function -- e.g. after ``fit`` or through
        :class:`hvdsync.keras.callbacks.FlushCallback`). Returns how many outstanding global
        gradients this rank dropped (their content is in the averaged variables). Without
        ``delay=`` it does nothing and returns 0."""
        t = getattr(self._hv, "technique", None)
        if not isinstance(t, EagerDelay) or not self._hv.process_set.included():
            return 0
        return t.flush(self._hv.last_layout)

    # -- saving -------------------------------------------------------------------------------
    def _hvdsync_state(self) -> dict:
        hv = self._hv
        state = {}
        if getattr(hv, "clipper", None) is not None:
            state["clip"] = hv.clipper.policy.state_dict()
        t = getattr(hv, "technique", None)
        if t is not None:
            own = t.state_dict({path: str(i) for i, path in enumerate(hv.variables)})
            if own:
                state[hv.technique_name] = own
        return state

    def _load_hvdsync_state(self, state: dict) -> None:
        hv = self._hv
        for name in state:
            configured = (name == "clip" and hv.clip is not None) or name == hv.technique_name
            if not configured:
                raise ValueError(f"the saved optimizer has hvdsync {name}= state but this one "
                                 f"was not built with {name}=; pass the same options (e.g. to "
                                 "hvdsync.keras.load_model)")
        if "clip" in state:
            hv.clipper.policy.load_state_dict(state["clip"])
        if hv.technique is not None:
            if hv.technique_name in state:
                hv.technique.load_state_dict(state[hv.technique_name],
                                             {str(i): path for i, path in enumerate(hv.variables)})
            else:
                hv.technique.forget()

    def save_own_variables(self, store) -> None:
        super().save_own_variables(store)
        state = self._hvdsync_state() if self.built else {}
        if state:
            for key, value in pack_state(state).items():
                store[key] = value

    def load_own_variables(self, store) -> None:
        keys = list(store.keys())
        own = {k: store[k] for k in keys if k.startswith(STATE_KEY)}
        super().load_own_variables({k: store[k] for k in keys if not k.startswith(STATE_KEY)})
        if own:
            state = unpack_state({k: np.asarray(v) for k, v in own.items()})
            if self.built:
                self._load_hvdsync_state(state)
            else:
                self._hv.pending_state = state


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer,
                         name: Optional[str] = None,
                         device_dense: str = "",
                         device_sparse: str = "",
                         compression: Any = Compression.none,
                         sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0,
                         op: Any = Average,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False,
                         num_groups: int = 0,
                         groups: Any = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True,
                         *,
                         layers: Grouping = None,
                         clip: ClipConfig | dict | float | None = None,
                         threshold: ThresholdConfig | dict | float | None = None,
                         sparse: SparseConfig | dict | bool | float | None = None,
                         select: SelectConfig | dict | float | None = None,
                         delay: DelayConfig | dict | bool | int | None = None,
                         **unknown: Any) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so its updates use gradients reduced across Horovod ranks.

    Takes ``horovod.tensorflow.keras.DistributedOptimizer``'s arguments with the same meaning
    (``device_dense``/``device_sparse`` must stay ``""``, ``scale_local_gradients`` ``True``);
    with no technique enabled the updates equal averaged-gradient training. The result is an
    instance of a subclass of the optimizer's class (it serializes as that class, so
    ``model.save()`` files load anywhere) sharing the optimizer's state, with ``stats``,
    ``flush()``, ``selection``, ``delay_status``, ``sparse_routes``.

    Args:
        optimizer: the Keras optimizer to wrap (unbuilt or built).
        name: a new name for the optimizer (Horovod's argument).
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
        sparse_as_dense: reduce ``IndexedSlices`` gradients (embeddings) as dense tensors.
        gradient_predivide_factor: with Average, scale by 1/f before and f/size after the sum.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        backward_passes_per_step: gradients of this many batches are accumulated locally before
            one exchange and update (summed, as in Horovod; averaged with
            ``average_aggregated_gradients=True``).
        num_groups, groups: Horovod's grouping (an int: contiguous chunks of variables; a list of
            lists of variables reduced together). Mutually exclusive with ``layers``.
        process_set: reduce over this Horovod process set only.
        layers: hvdsync's grouping of variables into layers: ``None`` groups by Keras layer, or
            a callable / mapping from variable path to layer name.
        clip, threshold, sparse, select, delay: the techniques, as in
            :func:`hvdsync.torch.DistributedOptimizer` (config objects, dicts of their fields,
            or a number); see the modules of :mod:`hvdsync`.
    """
    reject_unknown_kwargs(unknown, _HOROVOD_ARGS + _HVDSYNC_ARGS, "DistributedOptimizer")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a keras.optimizers.Optimizer (Keras 3), got "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already wrapped by hvdsync.keras.DistributedOptimizer")
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(f"hvdsync.keras needs Keras' TensorFlow backend (Horovod's ops are "
                           f"TensorFlow ops); KERAS_BACKEND is {keras.backend.backend()!r}")
    if device_dense or device_sparse:
        raise ValueError("device_dense/device_sparse are not supported by hvdsync.keras (the "
                         "reductions run where the gradients are)")
    if scale_local_gradients is not True:
        raise ValueError("scale_local_gradients=False is not supported by hvdsync.keras")
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise TypeError("compression must provide compress() and decompress(), e.g. "
                        f"hvd.Compression.fp16; got {compression!r}")
    positive_int("backward_passes_per_step", backward_passes_per_step)
    check_bool("average_aggregated_gradients", average_aggregated_gradients)
    check_reduce_op(op, average=Average, sum_=Sum, adasum=Adasum, others=(Min, Max, Product),
                    gradient_predivide_factor=positive_float("gradient_predivide_factor",
                                                             gradient_predivide_factor))
    check_bool("sparse_as_dense", sparse_as_dense)
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a horovod ProcessSet, got {process_set!r}")
    clip = ClipConfig.coerce(clip)
    threshold = ThresholdConfig.coerce(threshold)
    sparse = SparseConfig.coerce(sparse)
    select = SelectConfig.coerce(select)
    delay = DelayConfig.coerce(delay)
    given = [n for n, v in (("threshold", threshold), ("select", select), ("sparse", sparse),
                            ("delay", delay)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(n + '=' for n in given)} each decide what is sent every "
                         "step; pass one of them (clip= combines with any)")
    if delay is not None and op != Average:
        raise ValueError("delay= mixes local gradients with averaged global ones, so it needs "
                         "op=Average")
    if sparse is not None and sparse_as_dense:
        raise ValueError("sparse_as_dense=True always sends sparse gradients dense; sparse= "
                         "chooses per step (dense_ratio=0 always sends dense): pass one of them")
    if sparse is not None and op not in (Average, Sum):
        raise ValueError("sparse= sums gathered rows, so it supports op=Average or op=Sum only")
    if clip is not None and clip.mode == "global" and given:
        raise ValueError(f"clip mode 'global' (clipping the averaged gradient) is supported on "
                         f"the plain path only, not with {given[0]}=; use clip mode 'local'")
    if given and backward_passes_per_step > 1:
        raise ValueError(f"{given[0]}= with backward_passes_per_step > 1 is not supported in "
                         "hvdsync.keras; accumulate with a larger batch instead")
    if num_groups:
        warnings.warn("num_groups is deprecated; use groups", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if groups is not None and layers is not None:
        raise ValueError("pass either groups (Horovod's) or layers (hvdsync's), not both")
    grouping = layers if layers is not None else _groups_to_names(groups)
    if grouping is None:
        grouping = keras_layer_of

    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    # Share the wrapped optimizer's state (variables, hyper-parameters, tracker).
    wrapped.__dict__.update(optimizer.__dict__)
    if name is not None:
        wrapped.name = name
    if backward_passes_per_step > 1:
        if optimizer.built:
            raise ValueError("backward_passes_per_step > 1 needs an optimizer that is not built "
                             "yet (its accumulators are created when it is built)")
        wrapped.gradient_accumulation_steps = backward_passes_per_step
    elif optimizer.gradient_accumulation_steps:
        raise ValueError("the optimizer has gradient_accumulation_steps set; use "
                         "backward_passes_per_step instead (the accumulation must happen "
                         "before the exchange)")
    technique = given[0] if given else None
    object.__setattr__(wrapped, "_hv", _Hvdsync(
        reducer=Reducer(compression, op, gradient_predivide_factor, sparse_as_dense,
                        process_set),
        grouping=grouping, clip=clip, threshold=threshold, sparse=sparse, select=select,
        delay=delay, technique_name=technique, process_set=process_set,
        sparse_as_dense=sparse_as_dense,
        average_aggregated_gradients=average_aggregated_gradients, pending_state=None))
    if optimizer.built:
        wrapped._hvdsync_build(list(optimizer._trainable_variables))
    return wrapped


def _groups_to_names(groups: Any) -> Grouping:
    if groups is None:
        return None
    if isinstance(groups, int) and not isinstance(groups, bool):
        return groups
    if isinstance(groups, (list, tuple)):
        out = []
        for group in groups:
            if not isinstance(group, (list, tuple)):
                raise ValueError("groups should be a positive int or a list of lists of "
                                 "variables")
            for v in group:
                if not hasattr(v, "path"):
                    raise ValueError(f"groups must consist of Keras variables, got "
                                     f"{type(v).__name__}")
            out.append([v.path for v in group])
        return out
    raise ValueError(f"groups should be a positive int or a list of lists of variables, got "
                     f"{groups!r}")


def _bytes_tensor(reducer: Reducer, g, wire: bool) -> tf.Tensor:
    """Payload bytes of ``g`` as a graph value (sparse sizes are only known at run time)."""
    if isinstance(g, tf.IndexedSlices) and not reducer.sparse_as_dense:
        return tf.cast(tf.size(g.values) * g.values.dtype.size
                       + tf.size(g.indices) * g.indices.dtype.size, tf.int64)
    if isinstance(g, tf.IndexedSlices):
        g = tf.convert_to_tensor(g)
    return tf.constant(reducer.wire_bytes(g) if wire else payload_bytes(g), tf.int64)


def _in_xla_context() -> bool:
    try:
        from tensorflow.python.ops import control_flow_util
        return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except Exception:  # pragma: no cover - private API moved
        return False


def _flatten(grads: list, shapes: list) -> tuple[list, list]:
    """Gradients as a flat list of tensors (``IndexedSlices`` as values, indices) and what it
    takes to rebuild them (the static dense shape comes from the variable)."""
    flat, spec = [], []
    for g, shape in zip(grads, shapes):
        if isinstance(g, tf.IndexedSlices):
            spec.append(("sparse", tuple(int(d) for d in shape)))
            flat += [g.values, g.indices]
        else:
            spec.append(("dense", None))
            flat.append(g)
    return flat, spec


def _unflatten(flat: list, spec: list) -> list:
    out, i = [], 0
    for kind, shape in spec:
        if kind == "sparse":
            out.append(tf.IndexedSlices(flat[i], flat[i + 1], tf.constant(shape, tf.int64)))
            i += 2
        else:
            out.append(flat[i])
            i += 1
    return out


def _tensors_of(grads: list) -> list:
    return [t for g in grads for t in ((g.values, g.indices) if isinstance(g, tf.IndexedSlices)
                                       else (g,))]
