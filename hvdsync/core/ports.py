"""What an adapter provides to the framework-neutral core: its gradients
(:class:`Gradients`), its arithmetic (:class:`TensorOps`) and its collectives
(:class:`Communicator`), what every technique may use of them. What one technique alone needs of
an adapter is declared in its package (``hvdsync/techniques/<name>/ports.py``). The core
reaches the framework through these only; the contract test (tests/test_contracts.py) checks
every call against them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

from hvdsync.core.wire import Pending


class Gradients(Protocol):
    """One step's gradients, and the parameters and optimizer state they belong to, by layer
    ``li`` and position ``k`` inside the layer (torch: ``p.grad``; Keras: the step's list)."""

    def size(self, li: int) -> int: ...
    def get(self, li: int, k: int) -> Any: ...
    def set(self, li: int, k: int, value: Any) -> None: ...
    def layers(self, lis: Sequence[int]) -> list[list]:
        """Each of layers ``lis``'s gradients (a list per layer, ``None`` where one has
        none), in one call."""
    def write(self, items: Sequence[tuple[int, Sequence[int], Sequence[Any]]]) -> None:
        """Set, for each ``(li, ks, values)``, parameter ``k`` of layer ``li``'s gradient to
        its value: many :meth:`set` in one call."""
    def ready(self, lis: Sequence[int]) -> list[int]:
        """Layers ``lis``'s local gradients are final: before anything sees them, undo the
        loss scale (torch ``scaler=``). Returns each one's payload bytes (what plain Horovod
        would send: a sparse gradient's rows)."""
    def missing(self, li: int) -> list[int]: ...
    def zeros(self, li: int, k: int) -> Any: ...
    def value(self, li: int, k: int) -> Any: ...
    def is_row_sparse(self, li: int, k: int) -> bool: ...
    def working(self) -> Any:
        """A context for the step's work after backward made layers ready (a ready group's,
        ``synchronize()``'s): where the adapter runs it (torch on CUDA: optionally a side
        stream); :meth:`joined` once the step's work is queued."""
    def joined(self) -> None:
        """The step's work is queued; what the caller runs next waits for it."""
    def layer_bytes(self, li: int) -> int:
        """Layer ``li``'s parameters' bytes (what a dense gradient of it weighs: the same on
        every rank and every step, unlike the payload of a sparse one)."""
    def snapshot(self, key: str) -> Any:
        """The parameter ``key`` and the optimizer's state for it, as they are now."""
    def restore(self, key: str, snap: Any) -> None:
        """Put the parameter ``key`` and its optimizer state back to ``snap``."""
    def key(self, li: int, k: int) -> str: ...
    def param_keys(self, li: int) -> list[str]:
        """The keys of layer ``li``'s parameters in :meth:`replica_tensors` order (valid
        outside a step, unlike :meth:`key`, whose ``k`` is a position in the step's
        gradients)."""
    def name(self, li: int, k: int) -> str: ...
    def to_saved(self, key: str, x: Any) -> Any: ...
    def from_saved(self, key: str, x: Any) -> Any: ...
    def before_optimizer_step(self, ok: bool) -> None:
        """The step's gradients are final; ``ok``: they were finite on every rank (else the
        step is skipped everywhere: make that visible to what steps next, e.g. a loss scaler)."""
    def after_optimizer_step(self) -> None: ...


class Arithmetic(Protocol):
    """Elementwise arithmetic on the adapter's tensors, and the step's few host reads
    (device scalars stay on the device until :meth:`to_host`, read once per step)."""

    def add(self, a: Any, b: Any) -> Any:
        """``a + b`` as a new tensor."""
    def bad(self, tensors: Sequence[Any]) -> Any:
        """A device float scalar: 1 if any value of ``tensors`` is NaN or Inf, else 0."""
    def all_finite(self, tensors: Sequence[Any]) -> bool:
        """Whether every value of ``tensors`` is finite (one device read)."""
    def accumulate(self, acc: Any, x: Any, sign: int = 1) -> Any:
        """``acc + x`` (``sign=-1``: ``acc - x``), in place where the framework allows (the
        caller owns ``acc``)."""
    def clone(self, t: Any) -> Any: ...
    def clone_all(self, tensors: Sequence[Any]) -> list:
        """Copies of ``tensors`` (one multi-tensor op where the framework has one)."""
    def accumulate_all(self, accs: Sequence[Any], xs: Sequence[Any], sign: int = 1) -> list:
        """:meth:`accumulate` pairwise over two lists, at once."""
    def zero(self) -> Any: ...
    def to_host(self, scalars: Sequence[Any]) -> list[float]:
        """Device scalars as floats, in one read."""
    def nbytes(self, t: Any) -> int: ...
    def dtype_key(self, t: Any) -> str: ...
    def zeros_like(self, t: Any) -> Any: ...
    def cast(self, t: Any, dtype: Optional[str] = None, like: Any = None) -> Any:
        """``t`` as ``dtype`` (a name: ``"float16"``), or as ``like``'s dtype."""
    def add_all(self, a: Sequence[Any], b: Sequence[Any]) -> list:
        """``a + b`` pairwise, as new tensors (one multi-tensor op where there is one)."""
    def sub_all(self, a: Sequence[Any], b: Sequence[Any]) -> list:
        """``a - b`` pairwise, as new tensors (one multi-tensor op where there is one)."""


class LayerStatistics(Protocol):
    """Per-layer numbers in a few multi-tensor ops (clip=, the deciders' scores)."""

    def norm(self, tensors: Sequence[Any]) -> Any:
        """L2 norm of all ``tensors`` together (0 for none), a device scalar."""
    def dot(self, pairs: Sequence[tuple[Any, Any]]) -> Any:
        """Sum of the dot products of the pairs, a device scalar."""
    def norms(self, layers: Sequence[Sequence[Any]]) -> Any:
        """Each layer's :meth:`norm` (its tensors together), as one float32 device vector
        (0 for a layer with no values): a few multi-tensor ops for all of them."""
    def in_layer_order(self, n: int, parts: Sequence[tuple[Sequence[int], Any]]) -> Any:
        """One float32 vector of ``n`` entries from per-group vectors (``(layers,
        values)``: ``values[i]`` is layer ``layers[i]``'s); a layer in no part gets 0."""
    def concat(self, parts: Sequence[Any], dtype: str = "float32") -> Any:
        """Device vectors and scalars end to end, as one vector of ``dtype`` (a control
        vector: :func:`control_dtype`)."""
    def read(self, vectors: Sequence[Any]) -> list[list[float]]:
        """Device vectors as lists of floats, in one read."""


class Branching(Protocol):
    """What a step that may be traced (Keras' compiled step) branches and fuses with."""

    def cond(self, flag: Any, yes: Callable[[], Any], no: Callable[[], Any]) -> Any:
        """``yes()`` where the device boolean ``flag`` holds, else ``no()`` (both give the same
        structure of tensors): a Python ``if`` where the step runs eagerly, a branch of the
        graph where it is traced (both branches are built; one runs)."""
    def where(self, flag: Any, yes: Any, no: Any) -> Any:
        """``yes`` where the device boolean ``flag`` holds, else ``no`` (tensors, or nested
        dicts and lists of them alike: a snapshot): a Python choice where the step runs
        eagerly, a select in a trace (no branch)."""
    def vector(self, scalars: Sequence[Any], dtype: str = "float64") -> Any:
        """Device scalars as one vector of ``dtype`` (a traced step's control vector:
        :func:`control_dtype`)."""


class TensorOps(Arithmetic, LayerStatistics, Branching, Protocol):
    """The arithmetic techniques share, by kind: a technique calls it as ``ops``. What one
    technique alone needs of an adapter is declared in its own package (``ports.py``:
    lowrank's factors, sparse's rows, the outer synchronization's coding...); an adapter
    implements both."""


class Communicator(Protocol):
    """Moves tensors between ranks (see each adapter's ``comm.py``)."""

    size: int
    #: whether the engine pairs collectives across ranks by name (Horovod: a rank may start
    #: them in its own order); ``False`` (torch.distributed pairs them by order): every rank
    #: must start them in the same order, so a technique must not start one because a poll
    #: on this rank said an earlier one had arrived
    matches_by_name: bool
    #: what this rank is doing (a step, ``flush()``, a save), told to the other ranks before
    #: each entry's first collective and compared (:class:`hvdsync.safety.entries.Entries`)
    entries: Any

    def allreduce(self, name: str, tensors: list) -> Pending: ...
    def dispatch(self, background: bool = False) -> None:
        """Hand the collectives asked for so far to the engine (where they are queued:
        Keras' eager requests go in one grouped call; ``background``: on its thread)."""
    def control(self, values: list[float], name: str, dtype: str = "float64"
                ) -> list[float]: ...
    def control_async(self, values: Any, name: str, dtype: str = "float64") -> Pending:
        """:meth:`control`, started now: ``values`` a list of floats or a device vector
        (:meth:`TensorOps.concat`: built on the device, no host read before it goes); the
        pending's ``wait()`` gives the averages as floats."""
    def gather_json(self, obj: Any, name: str) -> list:
        """Every rank's ``obj`` (JSON data), in rank order (a blocking exchange)."""
