"""What an adapter provides to the framework-neutral core: its gradients
(:class:`Gradients`), its arithmetic (:class:`TensorOps`) and its collectives
(:class:`Communicator`). The core reaches the framework through these only; the contract
test (tests/test_contracts.py) checks every call against them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Optional, Protocol

from hvdsync.core.pending import Pending


class Gradients(Protocol):
    """One step's gradients, and the parameters and optimizer state they belong to, by layer
    ``li`` and position ``k`` inside the layer (torch: ``p.grad``; Keras: the step's list)."""

    def size(self, li: int) -> int: ...
    def get(self, li: int, k: int) -> Any: ...
    def set(self, li: int, k: int, value: Any) -> None: ...
    def missing(self, li: int) -> list[int]: ...
    def zeros(self, li: int, k: int) -> Any: ...
    def value(self, li: int, k: int) -> Any: ...
    def is_row_sparse(self, li: int, k: int) -> bool: ...
    def payload_bytes(self, li: int) -> int: ...
    def working(self) -> Any:
        """A context for the step's work after backward made layers ready (a ready group's,
        ``synchronize()``'s): where the adapter runs it (torch on CUDA: optionally a side
        stream); :meth:`joined` once the step's work is queued."""
    def joined(self) -> None:
        """The step's work is queued; what the caller runs next waits for it."""
    def layer_bytes(self, li: int) -> int:
        """Layer ``li``'s parameters' bytes (what a dense gradient of it weighs: the same on
        every rank and every step, unlike :meth:`payload_bytes` of a sparse one)."""
    def snapshot(self, key: str) -> Any:
        """The parameter ``key`` and the optimizer's state for it, as they are now."""
    def restore(self, key: str, snap: Any) -> None:
        """Put the parameter ``key`` and its optimizer state back to ``snap``."""
    def update_only(self, grads: dict[str, Any]) -> None:
        """Outside a step: one update of the wrapped optimizer with ``grads`` (by key) for
        those parameters only; every other parameter and its state stay as they are, and no
        step is counted (``flush()`` of layers a decider kept back)."""
    def withhold(self, li: int, k: int) -> None: ...
    def replica_tensors(self, li: int, with_state: bool) -> list: ...
    def key(self, li: int, k: int) -> str: ...
    def param_keys(self, li: int) -> list[str]:
        """The keys of layer ``li``'s parameters in :meth:`replica_tensors` order (valid
        outside a step, unlike :meth:`key`, whose ``k`` is a position in the step's
        gradients)."""
    def name(self, li: int, k: int) -> str: ...
    def to_saved(self, key: str, x: Any) -> Any: ...
    def from_saved(self, key: str, x: Any) -> Any: ...
    def prepare(self, li: int) -> None:
        """Before anything sees layer ``li``'s local gradient (torch: undo the loss scale)."""
    def before_optimizer_step(self, ok: bool) -> None:
        """The step's gradients are final; ``ok``: they were finite on every rank (else the
        step is skipped everywhere: make that visible to what steps next, e.g. a loss scaler)."""
    def after_optimizer_step(self) -> None: ...


class Arithmetic(Protocol):
    """Elementwise arithmetic on the adapter's tensors, and the step's few host reads
    (device scalars stay on the device until :meth:`to_host`, read once per step)."""

    def add(self, a: Any, b: Any) -> Any:
        """``a + b`` as a new tensor."""
    def mul(self, a: Any, b: Any) -> Any:
        """``a * b`` (elementwise) as a new tensor."""
    def bad(self, tensors: Sequence[Any]) -> Any:
        """A device float scalar: 1 if any value of ``tensors`` is NaN or Inf, else 0."""
    def all_finite(self, tensors: Sequence[Any]) -> bool:
        """Whether every value of ``tensors`` is finite (one device read)."""
    def zero_if(self, flag: Any, tensors: Sequence[Any]) -> list:
        """``tensors``, or zeros like them where the device ``flag`` (from :meth:`bad`) is 1."""
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


class LayerStatistics(Protocol):
    """Per-layer numbers in a few multi-tensor ops (clip=, the deciders' scores)."""

    def norm(self, tensors: Sequence[Any]) -> Any:
        """L2 norm of all ``tensors`` together (0 for none), a device scalar."""
    def dot(self, pairs: Sequence[tuple[Any, Any]]) -> Any:
        """Sum of the dot products of the pairs, a device scalar."""
    def norms(self, layers: Sequence[Sequence[Any]]) -> Any:
        """Each layer's :meth:`norm` (its tensors together), as one float32 device vector
        (0 for a layer with no values): a few multi-tensor ops for all of them."""
    def dots(self, layers: Sequence[Sequence[tuple[Any, Any]]]) -> Any:
        """Each layer's :meth:`dot` of its pairs, as one float32 device vector."""
    def in_layer_order(self, n: int, parts: Sequence[tuple[Sequence[int], Any]]) -> Any:
        """One float32 vector of ``n`` entries from per-group vectors (``(layers,
        values)``: ``values[i]`` is layer ``layers[i]``'s); a layer in no part gets 0."""
    def concat(self, parts: Sequence[Any], dtype: str = "float32") -> Any:
        """Device vectors and scalars end to end, as one vector of ``dtype`` (a control
        vector: :func:`control_dtype`)."""
    def read(self, vectors: Sequence[Any]) -> list[list[float]]:
        """Device vectors as lists of floats, in one read."""


class Factors(Protocol):
    """Low-rank factors (lowrank=): the adapter says how a tensor is viewed as a matrix."""

    def matrix_shape(self, t: Any) -> Optional[tuple[int, int]]:
        """``(rows, cols)`` of ``t`` as a matrix; ``None`` for vectors and scalars."""
    def matrix(self, t: Any) -> Any: ...
    def from_matrix(self, m: Any, like: Any) -> Any:
        """``m`` (from :meth:`matrix`) in the shape of ``like``."""
    def matmul(self, a: Any, b: Any, transpose_a: bool = False,
               transpose_b: bool = False) -> Any: ...
    def matmul_all(self, a: Sequence[Any], b: Sequence[Any], transpose_a: bool = False,
                   transpose_b: bool = False) -> list:
        """:meth:`matmul` pairwise, at once (one multi-tensor op where there is one)."""
    def orthonormal_all(self, ps: Sequence[Any]) -> list:
        """:meth:`orthonormal` of each (matrices of a shape in one batched call)."""
    def orthonormal(self, p: Any) -> Any:
        """An orthonormal basis of ``p``'s columns (QR's Q, same shape); deterministic."""
    def from_host(self, values: Any, like: Any) -> Any:
        """``values`` (a numpy array) as a tensor with ``like``'s dtype and device."""


class OuterArithmetic(Protocol):
    """The outer synchronization's arithmetic (delay=, hvdsync/techniques/outer/sync.py)."""

    def add_scaled(self, acc: Any, x: Any, alpha: float) -> Any:
        """``acc + alpha * x``, in place where the framework allows (the caller owns ``acc``)."""
    def zeros_like(self, t: Any) -> Any: ...
    def assign(self, target: Any, value: Any) -> None:
        """Write ``value`` into a parameter (or state tensor) of
        :meth:`Gradients.replica_tensors`."""
    def cast(self, t: Any, dtype: Optional[str] = None, like: Any = None) -> Any:
        """``t`` as ``dtype`` (a name: ``"float16"``), or as ``like``'s dtype."""
    def encode(self, tensors: Sequence[Any], codec: str, chunk: int) -> list:
        """``tensors`` flattened into one vector and encoded (``"bf16"``: its bits as int16;
        ``"int8"``: codes and a float32 scale per ``chunk`` values): the tensors to gather."""
    def decode(self, parts: Sequence[Any], like: Sequence[Any], codec: str,
               chunk: int) -> list:
        """Inverse of :meth:`encode`: tensors shaped (and typed) like ``like``."""
    def decode_sum(self, gathered: Sequence[Any], size: int, codec: str, chunk: int,
                   like: Sequence[Any]) -> list:
        """The average of every rank's :meth:`decode`-d piece of an allgather of
        :meth:`encode`'s parts (``size`` equal pieces each), summed in rank order (the same
        bits on every rank), shaped like ``like``."""
    def add_all(self, a: Sequence[Any], b: Sequence[Any]) -> list:
        """``a + b`` pairwise, as new tensors (one multi-tensor op where there is one)."""
    def sub_all(self, a: Sequence[Any], b: Sequence[Any]) -> list:
        """``a - b`` pairwise, as new tensors (one multi-tensor op where there is one)."""
    def add_scaled_all(self, a: Sequence[Any], b: Sequence[Any], alpha: float) -> list:
        """``a + alpha * b`` pairwise, as new tensors."""
    def assign_all(self, targets: Sequence[Any], values: Sequence[Any]) -> None:
        """:meth:`assign` pairwise."""
    def part(self, gathered: Any, rank: int, size: int) -> Any:
        """Rank ``rank``'s piece of a 1-d allgather result of ``size`` equal pieces."""


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
    def fused(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` -- arithmetic of these ops over lists of tensors (``None`` for an absent
        one), with no host read, no branch on a tensor's value and no collective -- as the
        adapter runs it best: one compiled call where every op costs a dispatch of its own
        (Keras, eager: 50-150 us an op), as it is where ops are cheap (torch). Wrap once,
        call often: a compiled form is kept per call structure. Worth it for dozens of ops a
        call (a traced call's argument handling costs ~0.3 ms in Keras), not for a few."""


class TensorOps(Arithmetic, LayerStatistics, Factors, OuterArithmetic, Branching, Protocol):
    """All the arithmetic techniques need, by role: a technique calls it as ``ops``; an
    adapter implements each role its techniques use."""


class RowSparse(Protocol):
    """Row-sparse gradients (``sparse=``: torch's sparse COO tensors, Keras'
    ``IndexedSlices``), the primitives hvdsync/techniques/sparse/exchange.py is built on. A packed row
    is the row's values, then its int64 index bit-cast into columns of the value dtype (an
    allgather copies bytes); a scattered gradient is its dense rows with a "present" column
    of ones where a row is."""

    def coalesce(self, g: Any) -> tuple[Any, int]:
        """``g`` with duplicate rows summed, and how many rows that removed."""
    def layout(self, g: Any) -> tuple[int, int]:
        """``(distinct rows, sparse dimensions)`` of a row-sparse ``g``."""
    def row_count(self, g: Any) -> int:
        """The rows ``g`` holds (after the exchange: distinct)."""
    def empty(self, like: Any, sparse_dim: int) -> Any:
        """A row-sparse gradient with no rows for the parameter ``like``."""
    def as_rows(self, g: Any, sparse_dim: int) -> Any:
        """A dense ``g`` as a row-sparse one."""
    def pack(self, g: Any) -> tuple[Any, Any]:
        """``g``'s packed rows in the value dtype they travel in (after the adapter's
        compression), and what :meth:`unpack_summed` needs to undo it."""
    def unpack_summed(self, gathered: Any, ctx: Any, shape: tuple, sparse_dim: int,
                      divide_by: int) -> Any:
        """Every rank's packed rows as one gradient, duplicate rows summed, ``/ divide_by``."""
    def scatter(self, g: Any, shape: tuple) -> tuple[Any, Any]:
        """``g``'s rows scattered into the dense ``shape`` (flattened per row), the present
        column after them, in the dtype they travel in; and what undoes it."""
    def present_rows(self, summed: Any, ctx: Any, shape: tuple, sparse_dim: int,
                     divide_by: int) -> Any:
        """The rows of a summed :meth:`scatter` that some rank had, ``/ divide_by``."""
    def codes(self, codes: Sequence[int], like: Any) -> Any:
        """``[1, w]``: the int64 ``codes``, to travel first in a grouped allgather of tensors
        like ``like`` (``None``: alone): bit-cast into its dtype where a group takes one
        dtype (Keras), as int64 where it may mix them (torch)."""
    def codes_of(self, gathered: Any, size: int) -> list[list[int]]:
        """Every rank's codes from a gathered :meth:`codes`."""
    def dtype_key(self, t: Any) -> str: ...
    def nbytes(self, t: Any) -> int: ...


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
    def flush(self, background: bool = False) -> None: ...
    def control(self, values: list[float], name: str, dtype: str = "float64"
                ) -> list[float]: ...
    def control_async(self, values: Any, name: str, dtype: str = "float64") -> Pending:
        """:meth:`control`, started now: ``values`` a list of floats or a device vector
        (:meth:`TensorOps.concat`: built on the device, no host read before it goes); the
        pending's ``wait()`` gives the averages as floats."""
    def average(self, groups: list[tuple[str, list]]) -> tuple[int, int]: ...
    def allgather_async(self, name: str, tensors: list) -> Pending:
        """Start gathering every rank's 1-d ``tensors`` (same length on every rank); the
        pending's ``wait()`` gives, per tensor, the ranks' pieces concatenated in rank order."""
    def gather_json(self, obj: Any, name: str) -> list:
        """Every rank's ``obj`` (JSON data), in rank order (a blocking exchange)."""
    #: whether the reduction averages (``1 / size``) rather than sums (``sparse=`` divides
    #: its sums by the ranks then)
    averages: bool
    def gather_rows(self, name: str, tensors: list) -> Pending:
        """One grouped allgather of 2-d ``tensors`` of one dtype whose row counts differ
        between ranks (``sparse=``); ``wait()`` gives each one's rows in rank order."""
    def sum_rows(self, name: str, tensors: list) -> Pending:
        """One grouped allreduce (a sum) of ``tensors`` (``sparse=``'s dense route)."""
    def after_flush(self, fn: Callable[[Callable[[str, list], list]], Any]
                    ) -> Optional[Future]:
        """Where collectives block their caller (Keras' eager Horovod ops): run ``fn(reduce)``
        in the background thread right after the next background :meth:`flush`, in the same
        order on every rank, and return its future; ``reduce(name, tensors)`` is a blocking
        allreduce for the rounds that depend on the flush. ``None`` where collectives run
        asynchronously (torch): the caller starts those rounds itself, once the flush's have
        arrived."""
