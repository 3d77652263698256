"""The technique interface: what every technique is asked, and when, in both adapters.

A *technique* is one of hvdsync's options or the plain exchange itself, with one *role*: a
**transform** changes a layer's gradient where it stands (``clip``); a **decider** chooses
which layers go this step and keeps what does not (``threshold``, ``select``); a
**transport** moves a layer's gradient between ranks (plain, ``sparse``, ``lowrank``,
``delay``) -- each parameter by exactly one, the first whose :meth:`Transport.owns` claims it.
:class:`hvdsync.core.pipeline.StepPipeline` calls the *moments* of the roles in one order every
step; docs/design.md, "One lifecycle: roles and moments", has the table (eager and traced).
Deciders plan step ``t`` at the end of step ``t - 1`` from values every rank shares, so each
send starts in backward; a step non-finite on any rank is skipped on every rank. ``ks`` are
positions of parameters inside layer ``li``. Techniques reach the framework only through the
adapter's ports (:mod:`hvdsync.core.ports`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from hvdsync.core.wire import Pending
from hvdsync.core.ports import Communicator, Gradients, TensorOps
from hvdsync.core.stats import SyncStats

TRANSFORM, DECIDER, TRANSPORT = "transform", "decider", "transport"
#: the role of a technique that synchronizes the replicas after the update (delay='s K-step
#: synchronization: :mod:`hvdsync.techniques.outer`)
SYNC = "sync"
#: the host flag (:meth:`Technique.host_flags`) that moves a traced local step's host moments
#: before its update
BEFORE_UPDATE = "before_update"


def control_part(values: Sequence[float], control: Sequence[str], name: str,
                 num_layers: int) -> Optional[list[float]]:
    """Statistic ``name``'s per-layer values in a control vector laid out as ``control``
    (``None`` if it carries no such statistic)."""
    if name not in control:
        return None
    i = control.index(name) * num_layers
    return list(values[i:i + num_layers])


def control_dtype(ops: "TensorOps", tensors: Iterable[Any]) -> str:
    """The precision a decider's control vector travels in: float64 beside float64
    gradients, else float32 -- the data's, so that Horovod fuses the vector with the step's
    data into one collective instead of running it as a round of its own after them (about a
    tenth of a decider's step on loopback: benchmarks/results/keras_lab_notes.md, "A
    decider's floor"). Its statistics
    are float32 values either way; a float32 average of them rounds once more."""
    return "float64" if any(ops.dtype_key(t) == "float64" for t in tensors) else "float32"


def shared_ok(shared: Sequence[float]) -> bool:
    """Whether a decider's shared control vector says the step was finite everywhere: its
    last entry (the ranks' non-finite flags, averaged) is 0 and every statistic is finite."""
    return shared[-1] == 0 and all(math.isfinite(x) for x in shared[:-1])


def accumulated(ops: "TensorOps", held: Any, kept: Sequence[tuple[str, Any]]) -> dict:
    """A decider's kept gradients (``(key, gradient)``) added to what ``held`` holds for their
    keys (a copy where it holds nothing): one multi-tensor add and one copy for all."""
    adds = [(key, grad) for key, grad in kept if key in held]
    firsts = [(key, grad) for key, grad in kept if key not in held]
    out = {}
    if adds:
        out.update(zip([key for key, _ in adds], ops.add_all([held[key] for key, _ in adds],
                                                             [grad for _, grad in adds])))
    if firsts:
        out.update(zip([key for key, _ in firsts], ops.clone_all([grad for _, grad in firsts])))
    return out


def refill(mapping: Any, items: dict) -> None:
    """Replace a technique's per-parameter memory in place (it may be a dict, or the Keras
    compiled path's variable-backed view of the same keys)."""
    mapping.clear()
    mapping.update(items)


@dataclass
class Parts:
    """What a technique is built from (its package's ``build(config, parts)``): the adapter's
    ports, the optimizer's layer names and statistics, and the techniques an adapter builds
    itself, by config class
    (``builds[type(config)](config)``, in place of the package's ``build``: ``sparse=``'s
    exchange over the adapter's row-sparse primitives)."""

    grads: Gradients
    ops: TensorOps
    comm: Communicator
    stats: SyncStats
    layer_names: list[str]
    builds: dict[type, Callable[[Any], Any]] = field(default_factory=dict)


# -- the roles -------------------------------------------------------------------------------
class Technique:
    """Base of every technique: each moment does nothing unless overridden."""

    #: what it is called in stats, status and ``opt.techniques`` ("clip", "threshold", ...;
    #: "plain" for the plain exchange)
    name: str = ""
    role: str = ""

    @property
    def keyword(self) -> str:
        """The keyword that configures it (its :attr:`name`, but for a technique one keyword
        builds beside another: ``delay=``'s synchronization): techniques of one keyword share
        its checkpoint entry, each with keys of its own."""
        return self.name

    #: whether it reads parameter values during the step (Keras then hands them to the step
    #: with the gradients, read by the compiled function before the update)
    reads_values: bool = False
    #: the keys of its ``state_dict()`` that hold this rank's own memory (residuals,
    #: accumulations...): checkpoints keep them per rank and never give them to another
    per_rank: tuple[str, ...] = ()
    #: whether its result depends on the gradients' scale (it reads their values, or keeps
    #: them across steps): under loss scaling it must see them unscaled (``scaler=``)
    scale_sensitive: bool = True
    #: whether a tracing adapter builds it into the traced step itself (Keras' compiled train
    #: function, :mod:`hvdsync.keras.graph`; else the step pipeline runs eagerly inside it)
    traceable: bool = False
    #: its traced form, an object holding the technique that a tracing adapter builds into the
    #: step in place of the eager moments (``clip=``: :class:`hvdsync.techniques.clip.traced.
    #: TracedClip`; ``delay=``: :class:`hvdsync.techniques.delay.traced.TracedDelay`), else
    #: ``None`` (a transport with rounds of its own is :class:`hvdsync.core.traced.TracedRounds`)
    traced: Any = None
    #: the other techniques (by name) its traced form is built beside; ``None``: any traceable
    #: one (a tracing adapter runs the step pipeline eagerly for any other combination)
    traced_with: Optional[tuple[str, ...]] = None
    def layer_ready(self, li: int, ks: list[int]) -> None:
        """Layer ``li``'s local gradient is final (its missing gradients filled)."""

    def group_ready(self, layers: list[tuple[int, list[int]]]) -> None:
        """A *ready group* of layers (``(li, ks)`` each; docs/design.md, "Ready groups"):
        their local gradients are final and none of them is sent yet. Transforms and deciders
        do their tensor work here, for the whole group at once (a few multi-tensor ops, not a
        few ops per tensor); transports are asked :meth:`layer_ready` per layer instead.
        Default: :meth:`layer_ready` for each layer."""
        for li, ks in layers:
            self.layer_ready(li, ks)

    def memory_to_trace(self, params: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The per-parameter memory a traced step keeps in device variables: per memory name,
        the keys (of ``params``, every parameter by :meth:`Gradients.key`) it may hold and
        each one's value while it holds nothing (a host array). The adapter hands the
        variable-backed mappings back through ``use_memory`` (:meth:`Transport.use_memory`;
        a decider's is declared by :class:`Decider`). Default: none."""
        return {}

    def host_flags(self) -> dict[str, Any]:
        """What the host decides between steps that a traced step branches on (by name, a
        boolean or a list of them; a tracing adapter keeps each in a device boolean or
        boolean vector, written whenever it changed: after a step, a restore, shared state
        taken). :data:`BEFORE_UPDATE` true: the next traced step that updates locally runs
        :meth:`before_optimizer_step` on the host before its update (the technique reads the
        parameters as they are then), not after it. Default: none."""
        return {}

    def after_wait(self, layers: list[int]) -> None:
        """Every reduction of the step has arrived (``layers``: every layer it exchanged):
        finish them (lowrank: ``P Q^T``; the transports first) or change them (clip's global
        mode)."""

    def before_optimizer_step(self) -> None:
        """Every reduced gradient is in place; the wrapped optimizer steps next."""

    def end_step(self, ok: bool) -> None:
        """The exchange of this step is over (read device values once); ``ok``: the step's
        gradients were finite on every rank (else it is skipped everywhere: learn nothing
        from it)."""

    def after_optimizer_step(self) -> None:
        """The wrapped optimizer has updated the parameters."""

    def flush_replicas(self) -> int:
        """Make the replicas identical now (a collective on every rank); returns how many
        outstanding exchanges this rank dropped. Default: nothing to do."""
        return 0

    def discard(self) -> int:
        """Finish and drop every exchange it has in flight across steps (a checkpoint is
        loaded, or the world is about to change: Horovod Elastic); a failed one is dropped
        too. Returns how many there were. Default: none."""
        return 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this technique (see docs/checkpoints.md)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict`."""

    def forget(self) -> None:
        """Drop memory of the model as it was (a checkpoint without this technique's state
        was loaded)."""

    def drop_per_rank(self) -> None:
        """Drop this rank's own memory (the :attr:`per_rank` part), keeping what every rank
        shares: a checkpoint restored another rank's memory, or none, on some rank."""
        self.forget()

    def status(self) -> dict:
        """What it did last, for logs and tests (plain data)."""
        return {}

    def beside_join(self, by_name: bool) -> Optional[str]:
        """Why its steps cannot go on while a rank waits in ``hvd.join()`` (which takes part
        in them with zero gradients, docs/backends.md), or ``None`` where they can
        (``by_name``: on Horovod, whose joined rank answers allreduces only)."""
        return None


class Transform(Technique):
    """Changes a layer's gradients before its send or once its average arrived (clip=); its
    moments are :meth:`Technique.group_ready` and :meth:`Technique.after_wait`."""

    role = TRANSFORM


#: The per-layer statistics a decider's control vector can carry (:attr:`Decider.control`),
#: each one value per layer of the model, computed alike by both adapters:
#:
#: * ``"held"``: the norm of what the layer holds after the step (its accumulation or
#:   residual with this step's gradient when kept back; 0 when sent);
#: * ``"expected"``: ``"held"`` plus the norm of this step's gradient (the size of one more);
#: * ``"sync_norm"``: the norm of the layer's parameters as of its last sync point;
#: * ``"dot"``: ``<g, theta>``, this step's gradient against the parameters;
#: * ``"dot_squared"``: the square of this rank's ``"dot"`` (averaged: a curvature estimate).
CONTROL_STATISTICS = ("held", "expected", "sync_norm", "dot", "dot_squared")

#: what a layer the plan keeps back does in the step (:attr:`Decider.kept_layers`)
LOCAL_STEP, WITHHELD = "local step", "withheld"


class Decider(Technique):
    """Chooses which layers go each step. Besides the step's moments it declares what its
    traced form (:class:`hvdsync.core.kept_layers.KeptLayers`, which a tracing adapter builds
    into the step) needs: the plan as a host flag (:meth:`host_flags`), the statistics it
    shares (:attr:`control`), what a kept-back layer does (:attr:`kept_layers`), where its
    per-parameter memory lives (:meth:`use_memory`), and the next plan from the shared
    vector (:meth:`plan_from`)."""

    role = DECIDER
    num_layers: int = 0
    #: the statistics of its control vector, in order (names from :data:`CONTROL_STATISTICS`):
    #: one value per layer each, then the ranks' non-finite flag; averaged over ranks
    control: tuple[str, ...] = ()
    _control_dtype: Optional[str] = None
    #: :data:`LOCAL_STEP` (a kept-back layer is updated with this rank's own gradient from a
    #: sync point it returns to before its next send) or :data:`WITHHELD` (it does not move)
    kept_layers: str = WITHHELD

    def host_flags(self) -> dict[str, Any]:
        """``plan``: whether each layer is sent this step (:meth:`decision`)."""
        return {"plan": [bool(self.decision(li)) for li in range(self.num_layers)]}

    def control_dtype_of(self, ops: TensorOps, grads: Gradients) -> str:
        """:func:`control_dtype` of its step's gradients (every layer's, at :meth:`share`;
        taken once: a model's dtypes do not change)."""
        if self._control_dtype is None:
            self._control_dtype = control_dtype(
                ops, (grads.get(li, k) for li in range(self.num_layers)
                      for k in range(grads.size(li))))
        return self._control_dtype

    @property
    def control_name(self) -> str:
        """The name of its control-plane collective (the same in every adapter)."""
        return f"hvdsync.control.{self.name}"

    def use_memory(self, held: Any, sync_points: Any) -> None:
        """Keep the per-parameter memory in these mappings (by :meth:`Gradients.key`) instead
        of dicts: ``held``, what kept-back layers hold (an accumulation, a residual);
        ``sync_points``, with :data:`LOCAL_STEP`, each skipping parameter and its optimizer
        state as at its last sync (:meth:`Gradients.snapshot`)."""
        raise NotImplementedError(f"{self.name} declares no per-parameter memory")

    def plan_from(self, shared: Sequence[float], local: Sequence[float]) -> None:
        """The next step's plan from a step finite everywhere: ``shared``, the control vector
        averaged over ranks (:attr:`control`'s statistics, then the flag); ``local``, this
        rank's own values of the same statistics."""

    def decision(self, li: int) -> bool:
        """Whether layer ``li`` is sent this step: planned at the end of the last step from
        shared values, so the same on every rank and known before backward."""
        return True

    def on_send_group(self, layers: list[tuple[int, list[int]]]) -> None:
        """The ready group's layers that go this step (``(li, ks)`` each): put what each kept
        back into its gradient, for all of them at once (a few multi-tensor ops; nothing is
        forgotten yet: the step may turn out non-finite)."""

    def on_skip(self, li: int, ks: list[int]) -> None:
        """Layer ``li`` does not go this step: keep its gradient (provisionally; the
        arithmetic may wait for :meth:`share`, its gradient is not sent)."""

    def share(self, local_bad: Any) -> None:
        """Every layer of the step has been sent or kept back: start the control-plane
        exchange of what the next plan needs, with ``local_bad`` (a device flag,
        :meth:`TensorOps.bad` of this rank's kept-back gradients: they carry no data to
        tell whether they were finite)."""

    def settle(self, data_ok: bool) -> bool:
        """After every wait: whether this step's gradients were finite on every rank
        (``data_ok``: what the exchanged gradients say). Commit this step's memory and plan
        the next step if so, leave both as they were if not; same answer on every rank."""
        return data_ok


class Transport(Technique):
    role = TRANSPORT

    def owns(self, li: int, k: int) -> bool:
        """Whether this transport moves parameter ``k`` of layer ``li`` (the last transport
        moves whatever no other claims)."""
        return True

    def start(self, li: int, ks: list[int], layer: list) -> Optional[Pending]:
        """Start sending parameters ``ks`` of layer ``li`` (``layer``: its gradients as they
        are now, by position); ``None``: queued until :meth:`start_early` / :meth:`send_rest`.
        The pending's result is their reduced gradients (written back by the pipeline), or
        ``None`` where the transport writes them itself."""
        raise NotImplementedError

    def group_started(self) -> None:
        """Every layer of a ready group has been started (:meth:`start`) or kept back by the
        decider: rounds that gather several layers may go now."""

    def fill(self, li: int, k: int) -> Any:
        """A gradient for a parameter that has none on this rank, if this transport knows
        its layout (``None``: zeros)."""
        return None

    def backward_done(self, missing: list[int]) -> list[int]:
        """Every layer that backward makes ready on this rank is ready; ``missing``: the
        layers it did not. Returns those of them that can be filled only after
        :meth:`start_early` (a layout that only its early round tells)."""
        return []

    def start_early(self) -> dict[int, Pending]:
        """Collectives that must run before held layers can be filled."""
        return {}

    def send_rest(self) -> dict[int, Pending]:
        """The end of backward: every layer is started or kept back -- send what is still
        queued; returns what each layer waits for."""
        return {}

    def use_memory(self, memory: dict[str, Any]) -> None:
        """Keep the memories :meth:`memory_to_trace` named in these mappings (the dict
        interface, as the eager step uses them, plus, for the traced step, ``read(key)`` --
        the value, or the empty one -- and ``write(key, value, when)``: where the device
        boolean ``when`` holds, or always: ``True``)."""
        raise NotImplementedError(f"{self.name} keeps no memory for a trace")
