"""hvdsync's Keras 3 ``DistributedOptimizer`` (TensorFlow backend): Horovod's contract,
hvdsync's control of what is sent.

The wrapper is a subclass of the wrapped optimizer's class whose gradient application first
exchanges the gradients across ranks. It works in ``model.fit`` in the default compiled mode
(and with ``run_eagerly=True``). A *layer* is one Keras layer's trainable variables (variable
paths ``dense_1/kernel`` + ``dense_1/bias`` -> ``dense_1``). With no technique or ``clip=``
only, the exchange is built into the compiled function; otherwise the step pipeline runs
eagerly inside it (:mod:`hvdsync.keras.graph`). Either way every rank builds the same
collectives in the same order (layers in a fixed order, decisions from shared values only).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Optional

import keras
import tensorflow as tf
from horovod.tensorflow import mpi_ops
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.mpi_ops import Average, ProcessSet, global_process_set

if TYPE_CHECKING:  # (typing.Unpack is Python 3.11's)
    from typing_extensions import Unpack

    from hvdsync.techniques import TechniqueKeywords

from hvdsync.safety import agreement, checkpoint, elastic
from hvdsync.core import rules
from hvdsync.core.api import SyncAPI
from hvdsync.core.config import check_bool
from hvdsync.core.topology import check_between
from hvdsync.keras.graph import eager_step, graph_runs, graph_step, in_xla_context
from hvdsync.keras.mixed_precision import LossScaleOptimizer, share_loss_scale_decision
from hvdsync.keras.backend import KerasGradients, Slots
from hvdsync.keras.ops import KerasOps
from hvdsync.keras.comm import KerasCommunicator
from hvdsync.keras.memory import VariableMemory
from hvdsync.keras import nodes
from hvdsync.keras.params import (groups_to_names, keras_layer_of, mixed_in,
                                  relative_names)
from hvdsync.keras.sparse import TracedSparse
from hvdsync.techniques.sparse.config import SparseConfig
from hvdsync.keras.flags import HostFlags, Traffic
from hvdsync.keras.state import KerasCheckpointing
from hvdsync.core.kept_layers import KeptLayers
from hvdsync.core.layers import Layer, build_layers
from hvdsync.core.pipeline import StepPipeline
from hvdsync.core.rules import build_techniques
from hvdsync.core.stats import SyncStats
from hvdsync.core.technique import Parts

_HOROVOD_ARGS = ("name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
                 "gradient_predivide_factor", "op", "backward_passes_per_step",
                 "average_aggregated_gradients", "num_groups", "groups", "process_set",
                 "scale_local_gradients")


class _Hvdsync:
    """All of the wrapper's own state, in one plain object: Keras tracks lists and dicts set
    on an optimizer and would adopt the model variables they hold as optimizer variables."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


class _DistributedOptimizer(KerasCheckpointing, SyncAPI):
    """Mixed in front of the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    _hv: _Hvdsync

    # -- construction ---------------------------------------------------------------------
    def build(self, variables):
        super().build(variables)
        self._hvdsync_build(list(variables))
        caller = sys._getframe(1).f_locals.get("self")  # Keras' LossScaleOptimizer.build?
        if isinstance(caller, LossScaleOptimizer) and caller.inner_optimizer is self:
            share_loss_scale_decision(caller, self._hv.process_set)

    def _hvdsync_build(self, variables: list) -> None:
        hv = self._hv
        hv.layers = build_layers([v.path for v in variables], hv.grouping)
        by_path = {v.path: v for v in variables}
        layer_vars = [[by_path[n] for n in layer.param_names] for layer in hv.layers]
        # stats and collective names without the model's auto-numbered name ("sequential_1/"),
        # which can differ between ranks that built other models first
        names = relative_names([layer.name for layer in hv.layers])
        hv.layers = [Layer(n, layer.index, layer.param_names) for n, layer in zip(names, hv.layers)]
        hv.stats = SyncStats(names)

        def make(process_set: ProcessSet, wire: bool, cls: type = KerasCommunicator) -> Any:
            return cls(hv.compression if wire else Compression.none, hv.op,
                       hv.predivide if wire else 1.0, hv.sparse_as_dense, process_set, hv.stats)
        levels = nodes.communicators(hv.between, make, hv.process_set, list(hv.configs))
        #: the techniques' (between nodes with between="nodes"); every rank's: the setup check
        hv.comm, hv.everyone, hv.node, hv.levels = (levels.comm, levels.agree or levels.comm,
                                                   levels.node, levels)
        hv.stats.levels = levels.describe()
        configs = ({} if levels.synchronous  # one node: Horovod's synchronous exchange
                   else rules.for_nodes(hv.configs) if levels.node is not None else hv.configs)
        hv.grads = KerasGradients(layer_vars, Slots(self.variables, variables),
                                  update=self._update_uncounted)
        hv.techniques = build_techniques(rules.for_tracing(configs), Parts(
            hv.grads, KerasOps(), hv.comm, hv.stats, names,
            builds={SparseConfig: lambda c: TracedSparse(c, hv.grads, hv.comm, hv.stats)}))
        hv.pipeline = StepPipeline(names, hv.techniques, hv.grads, KerasOps(), hv.stats, hv.comm)
        # HVDSYNC_KERAS_PIPELINE=1: every step through the eager step pipeline (to compare);
        # two levels: always (hvdsync.keras.nodes)
        hv.graph_path = (graph_runs(hv.techniques) and hv.node is None
                         and os.environ.get("HVDSYNC_KERAS_PIPELINE") != "1")
        hv.signatures = [checkpoint.signature(v.shape, v.dtype) for vs in layer_vars for v in vs]
        with tf.init_scope():  # build may run while the train function is traced: go eager
            decider = hv.pipeline.decider
            #: the decider's traced form, its memory in variables (hvdsync.core.kept_layers)
            hv.kept = (KeptLayers(decider, hv.grads, KerasOps(),
                                  VariableMemory.of_parameters(hv.grads, False, "held"),
                                  VariableMemory.of_parameters(hv.grads, True, "copy"))
                       if hv.graph_path and decider is not None else None)
            #: what the compiled step branches on that the host decides, and what a
            #: transport's traced rounds sent (hvdsync.keras.graph)
            hv.flags = HostFlags(hv.pipeline) if hv.graph_path else None
            hv.traffic = Traffic(len(names)) if hv.graph_path else None
            if hv.graph_path:  # technique memory in variables, for the compiled step
                params = {hv.grads.key_of(v): v for vs in layer_vars for v in vs}
                for t in hv.techniques:
                    memory = t.memory_to_trace(params)
                    if memory:
                        t.use_memory({name: VariableMemory.of_host_values(
                            hv.grads, values, name=f"{t.name}_{name}")
                            for name, values in memory.items()})
            #: a checkpoint was restored: the next compiled step runs the agreement check
            hv.restored = tf.Variable(False, trainable=False, name="hvdsync_restored")
            hv.layer_signatures = [(name, [checkpoint.signature(v.shape, v.dtype) for v in vs])
                                   for name, vs in zip(names, layer_vars)]
            # under Horovod Elastic a rank joining later builds its optimizer while the others
            # wait in the state's sync(): the check runs there (hvdsync.keras.elastic)
            if hv.process_set.included() and not elastic.launched():
                self._agree()
            if hv.pending_state is not None:
                state, hv.pending_state = hv.pending_state, None
                self._load_state(state)

    # -- the step ---------------------------------------------------------------------------
    def _backend_apply_gradients(self, grads, trainable_variables):
        hv = self._hv
        if in_xla_context():
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

    def _update_uncounted(self, grads: list, variables: list) -> None:
        """The wrapped optimizer's update of ``variables`` alone, outside a training step
        (``flush()``): the iteration count (learning-rate schedules) stays as it was."""
        iterations = self._iterations.numpy()
        self._apply_update(grads, variables)
        self._iterations.assign(iterations)

    def _exchange_and_apply(self, grads, variables) -> None:
        hv = self._hv
        grads, variables = list(grads), list(variables)
        if not hv.process_set.included():
            self._apply_update(grads, variables)
            return
        if hv.graph_path:
            self._uncount_skipped(graph_step(
                hv.comm, hv.pipeline, hv.grads.layer_positions(variables), grads, variables,
                self._apply_update, hv.restored, hv.flags, hv.traffic, self._iterations + 1,
                hv.kept))
            return
        if hv.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]

        def run(step_grads: list, values: list) -> tuple[list, bool]:
            if hv.node is not None:  # two levels: the node's gradient, in full precision
                step_grads = hv.node(step_grads)
            hv.grads.begin_step(variables, step_grads, values)
            hv.pipeline.finish_backward()  # every layer is ready at once in Keras
            return hv.grads.grads, hv.pipeline.step_ok
        self._uncount_skipped(eager_step(run, hv.pipeline.after_optimizer_step, grads,
                                         variables, self._apply_update,
                                         any(t.reads_values for t in hv.techniques)))

    def _uncount_skipped(self, applied: tf.Tensor) -> None:
        """A step skipped on every rank (non-finite somewhere) does not count: Keras adds one
        to ``iterations`` after every apply, so take it back (as Keras' own
        LossScaleOptimizer leaves a skipped step uncounted)."""
        always = tf.get_static_value(applied)  # (a local step applies every time)
        if not (always is not None and bool(always)) and not self.gradient_accumulation_steps:
            self._iterations.assign_add(tf.cast(applied, self._iterations.dtype) - 1)

    # -- Horovod Elastic (hvdsync.keras.elastic, docs/elastic.md) ----------------------------
    def _agree(self) -> None:
        """Check that every rank built this optimizer alike (layers, options): raises
        ``RanksDisagree`` on every rank otherwise."""
        hv = self._hv
        agreement.require(hv.everyone, hv.layer_signatures, hv.configs,
                          dict(hv.horovod_options, nodes=str(hv.levels.topology)))
        if isinstance(hv.levels.topology, str):  # (every rank alike, past the check)
            raise ValueError(hv.levels.topology)

    def _leave_world(self) -> None:
        """Horovod is about to start again with other ranks: everything in flight is finished,
        or dropped where it fails; the next step starts clean."""
        if self.built and self._hv.process_set.included():
            self._hv.pipeline.leave_world()

    def _join_world(self) -> None:
        """Horovod runs again, perhaps with other ranks. The communicator reads the rank count
        at every use; what a traced train function holds of it is traced again
        (``KerasState.sync`` drops the model's train functions). The entry tags start over,
        as a rank that joins now starts them."""
        if self.built and getattr(self._hv, "comm", None) is not None:
            self._hv.comm.entries.reset()

    # -- hvdsync's public API -----------------------------------------------------------------
    def _sync_pipeline(self) -> Optional[StepPipeline]:
        return getattr(self._hv, "pipeline", None)

    def _sync_included(self) -> bool:
        return self._hv.process_set.included()

    @property
    def stats(self) -> SyncStats:
        """Communication statistics (:class:`hvdsync.SyncStats`); available once built."""
        if not hasattr(self._hv, "stats"):
            raise AttributeError("stats exist once the optimizer is built (after the first "
                                 "training step or optimizer.build(model.trainable_variables))")
        return self._hv.stats

    @property
    def layers(self) -> list[Layer]:
        """The layers in send order, as :class:`hvdsync.Layer` objects (once built)."""
        return list(getattr(self._hv, "layers", []))


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
                         between: Optional[str] = None,
                         **keywords: Unpack[TechniqueKeywords],
                         ) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so its updates use gradients reduced across Horovod ranks.

    Horovod's arguments with the same meaning (``device_dense``/``device_sparse`` stay ``""``,
    ``scale_local_gradients`` ``True``); with no technique on, the updates equal Horovod's.
    Returns an instance of a subclass of the optimizer's class (saved files load anywhere)
    sharing its state, with ``stats``, ``flush()``, ``techniques`` and each one's status.

    Args:
        optimizer: the Keras optimizer to wrap (built or not).
        name: a new name for it.
        device_dense: Horovod's; only ``""`` (and ``device_sparse``).
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
        op: ``hvd.Average`` or ``hvd.Sum``.
        sparse_as_dense: reduce ``IndexedSlices`` gradients (embeddings) as dense tensors.
        gradient_predivide_factor: with Average, scale by 1/f before and f/size after the sum.
        backward_passes_per_step: batches accumulated locally before one exchange and update
            (summed, as Horovod; averaged with ``average_aggregated_gradients=True``).
        groups: Horovod's grouping (an int, or ``num_groups``, its deprecated form: contiguous
            chunks; lists of variables reduced together); not with ``layers``.
        process_set: reduce over this Horovod process set only.
        average_aggregated_gradients: average the accumulated batches instead of summing.
        scale_local_gradients: Horovod's; only ``True``.
        between: ``"nodes"``: the techniques between nodes only, once per node, a full-precision
            average inside each (docs/nodes.md). Default: every rank alike.
        **keywords: hvdsync's ``layers=`` (by Keras layer, or a callable / mapping) and its
            techniques ``clip=``, ``threshold=``, ``select=``, ``sparse=``, ``lowrank=``,
            ``delay=``, each a config, a dict of its fields or a shorthand
            (:class:`hvdsync.techniques.TechniqueKeywords`).
    """
    between = check_between(between)
    layers, techniques = rules.given(keywords, _HOROVOD_ARGS, "DistributedOptimizer")
    if isinstance(optimizer, LossScaleOptimizer):  # wrap what it wraps; it decides for all
        inner = DistributedOptimizer(
            optimizer.inner_optimizer, name, device_dense, device_sparse, compression,
            sparse_as_dense, gradient_predivide_factor, op, backward_passes_per_step,
            average_aggregated_gradients, num_groups, groups, process_set,
            scale_local_gradients, layers=layers, between=between, **techniques)
        return LossScaleOptimizer(inner, initial_scale=optimizer.initial_scale,
                                  dynamic_growth_steps=optimizer.dynamic_growth_steps,
                                  name=optimizer.name)
    _check_wrappable(optimizer, device_dense or device_sparse, scale_local_gradients)
    check_bool("average_aggregated_gradients", average_aggregated_gradients)
    configs, groups = rules.check_arguments(
        mpi_ops, compression=compression, backward_passes_per_step=backward_passes_per_step,
        op=op, gradient_predivide_factor=gradient_predivide_factor,
        sparse_as_dense=sparse_as_dense, process_set=process_set, num_groups=num_groups,
        groups=groups, layers=layers, **techniques)
    grouping = layers if layers is not None else groups_to_names(groups)
    options = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                   backward_passes_per_step=backward_passes_per_step,
                   average_aggregated_gradients=average_aggregated_gradients,
                   gradient_predivide_factor=gradient_predivide_factor, between=between)
    wrapped = _wrap(optimizer, name, backward_passes_per_step)
    object.__setattr__(wrapped, "_hv", _Hvdsync(
        **options, predivide=gradient_predivide_factor, process_set=process_set,
        grouping=grouping if grouping is not None else keras_layer_of, configs=configs,
        # what every rank must agree on (agreement.require), as Horovod names it
        pending_state=None, horovod_options=dict(options, process_set=process_set.ranks)))
    if optimizer.built:
        wrapped._hvdsync_build(list(optimizer._trainable_variables))
    return wrapped


def _check_wrappable(optimizer: Any, device: Any, scale_local_gradients: Any) -> None:
    """A clear error for what :func:`DistributedOptimizer` cannot wrap (``device``: Horovod's
    ``device_dense`` or ``device_sparse``)."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a keras.optimizers.Optimizer (Keras 3), got "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already wrapped by hvdsync.keras.DistributedOptimizer")
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(f"hvdsync.keras needs Keras' TensorFlow backend (Horovod's ops are "
                           f"TensorFlow ops); KERAS_BACKEND is {keras.backend.backend()!r}")
    if device:
        raise ValueError("device_dense/device_sparse are not supported by hvdsync.keras (the "
                         "reductions run where the gradients are)")
    if scale_local_gradients is not True:
        raise ValueError("scale_local_gradients=False is not supported by hvdsync.keras")


def _wrap(optimizer: Any, name: Optional[str], backward_passes_per_step: int) -> Any:
    """An instance of a subclass of the optimizer's class, sharing its state (variables,
    hyper-parameters, tracker), that accumulates ``backward_passes_per_step`` batches."""
    if backward_passes_per_step > 1 and optimizer.built:
        raise ValueError("backward_passes_per_step > 1 needs an optimizer that is not built "
                         "yet (its accumulators are created when it is built)")
    if backward_passes_per_step <= 1 and optimizer.gradient_accumulation_steps:
        raise ValueError("the optimizer has gradient_accumulation_steps set; use "
                         "backward_passes_per_step instead (the accumulation must happen "
                         "before the exchange)")
    wrapped = mixed_in(optimizer, _DistributedOptimizer, name)
    if backward_passes_per_step > 1:
        wrapped.gradient_accumulation_steps = backward_passes_per_step
    return wrapped
