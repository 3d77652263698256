"""Bodies for tests/test_torch_api.py: Horovod's torch API exercised name by name, each body run
as it is on both engines (``horovodrun``: Horovod; ``torchrun``: hvdsync.torch.c10d) so that the
test compares the two answers."""

from __future__ import annotations

import os
from typing import Any

DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64", "bool")
REDUCE_OPS = ("Sum", "Average", "Min", "Max", "Product")
#: what horovodrun sets in each rank's environment (hvd.init() on torchrun sets them too)
HOROVOD_ENVIRONMENT = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                       "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")


def _answer(call: Any) -> Any:
    """``call()``'s result as plain data (values and dtype), or ``"raises"``."""
    try:
        out = call()
    except Exception:  # noqa: BLE001 -- the comparison is of what each engine answers
        return "raises"
    if isinstance(out, (list, tuple)):
        return [_plain(o) for o in out]
    return _plain(out)


def _plain(t: Any) -> Any:
    import torch
    if isinstance(t, torch.Tensor):
        return [str(t.dtype), list(t.shape), t.double().reshape(-1).tolist()]
    return t


def _inputs(dtype: Any, r: int, rows: int) -> Any:
    """Rank ``r``'s tensor of ``dtype``: ``rows`` rows of 2, values that make each reduction
    and integer averaging (rounding) visible, small enough for int8 products."""
    import torch
    base = torch.tensor([[(r + 1) * (k + 1) % 5 + (k % 2), (k + 2 * r) % 3 + 1]
                         for k in range(rows)], dtype=torch.float64)
    if dtype.is_floating_point:
        base = base * 0.75
    elif dtype != torch.uint8 and dtype != torch.bool:
        base = base - 2.0  # negative values too: averages truncate towards zero
    return base.to(dtype)


def dtype_matrix() -> dict:
    """Every collective x every dtype x every reduce op Horovod names, with rank-dependent
    inputs: per case ``collective/dtype[/op]``, the result's dtype, shape and values, or
    ``"raises"``. Dtypes that Horovod's Gloo build refuses somewhere are also run widened
    (``dtype~wide``): the reference the test holds the torch engine's answer to."""
    import torch

    import hvdsync.torch as hvd
    hvd.init()
    r = hvd.rank()
    out: dict = {}
    for dn in DTYPES:
        dt = getattr(torch, dn)
        out.update(_cases(hvd, dn, lambda rows, dt=dt: _inputs(dt, r, rows)))
        if dn in WIDE:
            wide = getattr(torch, WIDE[dn])
            out.update(_cases(hvd, f"{dn}~{WIDE[dn]}",
                              lambda rows, dt=dt, wide=wide: _inputs(dt, r, rows).to(wide)))
    return out


#: dtypes Horovod's CPU build refuses in some collectives, and the dtype whose answer, cast
#: back, is the reference for them
WIDE = {"uint8": "int64", "int8": "int64", "int16": "int64", "bfloat16": "float32",
        "bool": "int32"}


def _cases(hvd: Any, dn: str, inputs: Any) -> dict:
    import torch
    n, r = hvd.size(), hvd.rank()
    x = inputs(2 * n)
    out = {}
    for op in REDUCE_OPS:
        o = getattr(hvd, op)
        out[f"allreduce/{dn}/{op}"] = _answer(lambda: hvd.allreduce(x, op=o))
        out[f"grouped_allreduce/{dn}/{op}"] = _answer(
            lambda: hvd.grouped_allreduce([x, x[:1].clone()], op=o))
    for op in ("Sum", "Average"):
        o = getattr(hvd, op)
        out[f"allreduce_scaled/{dn}/{op}"] = _answer(lambda: hvd.allreduce(
            x, op=o, prescale_factor=3.0, postscale_factor=0.5))
        out[f"reducescatter/{dn}/{op}"] = _answer(lambda: hvd.reducescatter(x, op=o))
        out[f"reducescatter_scaled/{dn}/{op}"] = _answer(lambda: hvd.reducescatter(
            x, op=o, prescale_factor=3.0, postscale_factor=0.5))
        out[f"grouped_reducescatter/{dn}/{op}"] = _answer(
            lambda: hvd.grouped_reducescatter([x, x[:n + 1].clone()], op=o))
    uneven = inputs(r + 1)
    out[f"allgather/{dn}"] = _answer(lambda: hvd.allgather(uneven))
    out[f"grouped_allgather/{dn}"] = _answer(lambda: hvd.grouped_allgather([uneven, x]))
    out[f"broadcast/{dn}"] = _answer(lambda: hvd.broadcast(x, root_rank=n - 1))
    inplace = x.clone()
    out[f"broadcast_/{dn}"] = _answer(lambda: (hvd.broadcast_(inplace, root_rank=1),
                                               inplace)[1])
    out[f"alltoall/{dn}"] = _answer(lambda: hvd.alltoall(x))
    splits = torch.tensor([(r + k) % 3 for k in range(n)], dtype=torch.int32)
    ragged = inputs(int(splits.sum()))
    out[f"alltoall_splits/{dn}"] = _answer(lambda: hvd.alltoall(ragged, splits=splits))
    return out


def autograd_walk() -> dict:
    """Gradients through Horovod's differentiable collectives: per collective, the input's
    gradient of a rank-weighted sum of the output."""
    import torch

    import hvdsync.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    calls = {
        "allreduce": lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0),
        "allreduce_average": lambda x: hvd.allreduce(x),
        "grouped_allreduce": lambda x: hvd.grouped_allreduce([x, x * 2])[1],
        "allgather": lambda x: hvd.allgather(x[:r + 1]),
        "grouped_allgather": lambda x: hvd.grouped_allgather([x, x[:1]])[0],
        "broadcast": lambda x: hvd.broadcast(x, root_rank=n - 1),
        "alltoall": lambda x: hvd.alltoall(x),
        "alltoall_splits": lambda x: hvd.alltoall(x, splits=_splits(r, n, 2 * n))[0],
        "reducescatter": lambda x: hvd.reducescatter(x, op=hvd.Sum),
        "grouped_reducescatter": lambda x: hvd.grouped_reducescatter([x, x * 3])[1],
    }
    for label, call in calls.items():
        x = (torch.arange(2 * n * 2, dtype=torch.float64).reshape(2 * n, 2) + r).requires_grad_()
        y = call(x)
        weights = torch.arange(y.numel(), dtype=torch.float64).reshape(y.shape) + 1 + r
        (y * weights).sum().backward()
        out[label] = _plain(x.grad)
    return out


def _splits(r: int, n: int, rows: int) -> list[int]:
    """Rank ``r``'s uneven split of ``rows`` rows over ``n`` ranks."""
    counts = [(r + k) % 3 for k in range(n)]
    counts[-1] += rows - sum(counts)
    return counts


def mistakes() -> dict:
    """A script's mistakes, one after another on the same job: per mistake, the error each
    rank raised and how long it took (``None``: no error). The job goes on after each."""
    import time

    import torch

    import hvdsync.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = torch.ones(3)
    out: dict = {}

    def attempt(label: str, call: Any) -> None:
        start = time.monotonic()
        try:
            call()
            out[label] = None
        except hvd.HorovodInternalError as e:
            out[label] = (str(e), time.monotonic() - start)

    attempt("shape", lambda: hvd.allreduce(torch.ones(3 if r == 0 else 4), name="s"))
    attempt("dtype", lambda: hvd.allgather(torch.ones(2, dtype=torch.float64 if r else
                                                     torch.float32), name="d"))
    attempt("name", lambda: hvd.allreduce(x, name=f"rank{r}"))
    attempt("root", lambda: hvd.broadcast(x, root_rank=r % 2, name="b"))
    attempt("op", lambda: hvd.allreduce(x, name="o", op=hvd.Max if r == 0 else hvd.Sum))
    attempt("one_rank_only", lambda: hvd.allreduce(x, name="only") if r == 0
            else hvd.barrier())
    hvd.synchronize(hvd.allreduce_async(x, name="twice"))
    attempt("reused_after_synchronize", lambda: hvd.synchronize(
        hvd.allreduce_async(x, name="twice")))
    out["job_goes_on"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).item()
    out["expected_sum"] = float(sum(range(n)))
    return out


def refusals() -> dict:
    """Calls Horovod refuses, each on every rank (none that Horovod answers with a stall): per
    call, the classes its exception is an instance of (``None``: no exception), to hold the torch
    engine's to Horovod's; and how long rank 0 took to refuse a name still in flight while its
    peers were still asleep (Horovod refuses it at once, with no collective)."""
    import time

    import torch

    import hvdsync.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = torch.ones(4, 2)
    out: dict = {}
    kinds = {"ValueError": ValueError, "RuntimeError": RuntimeError, "TypeError": TypeError,
             "HorovodInternalError": hvd.HorovodInternalError}

    def attempt(label: str, call: Any) -> None:
        start = time.monotonic()
        try:
            call()
            out[label] = None
        except Exception as e:  # noqa: BLE001 -- what each engine raises is the answer
            out[label] = sorted(k for k, c in kinds.items() if isinstance(e, c))
        out[f"{label}.seconds"] = time.monotonic() - start

    attempt("reducescatter/Adasum", lambda: hvd.reducescatter(x, op=hvd.Adasum, name="r1"))
    attempt("reducescatter/Min", lambda: hvd.reducescatter(x, op=hvd.Min, name="r2"))
    attempt("grouped_reducescatter/Max", lambda: hvd.grouped_reducescatter([x, x], op=hvd.Max,
                                                                          name="r4"))
    attempt("reducescatter_async/Adasum", lambda: hvd.synchronize(
        hvd.reducescatter_async(x, op=hvd.Adasum, name="r3")))
    attempt("allreduce/Adasum", lambda: hvd.allreduce(x, op=hvd.Adasum, name="a1"))
    attempt("allreduce/op99", lambda: hvd.allreduce(x, op=99, name="a2"))
    attempt("grouped_allreduce/op99", lambda: hvd.grouped_allreduce([x, x], op=99, name="a5"))
    attempt("allreduce_async/op99", lambda: hvd.synchronize(
        hvd.allreduce_async(x, op=99, name="a3")))
    attempt("allreduce/bool_sum", lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool),
                                                        op=hvd.Sum, name="a4"))
    attempt("broadcast/root_n", lambda: hvd.broadcast(x, root_rank=n, name="b1"))
    attempt("broadcast/root_-1", lambda: hvd.broadcast(x, root_rank=-1, name="b2"))
    attempt("broadcast_object/root_n", lambda: hvd.broadcast_object(1, root_rank=n))
    attempt("alltoall/splits_length", lambda: hvd.alltoall(
        x, splits=torch.tensor([4], dtype=torch.int32), name="t1"))
    attempt("poll/not_a_handle", lambda: hvd.poll(123456))
    attempt("synchronize/not_a_handle", lambda: hvd.synchronize(123456))
    attempt("mismatch/shape", lambda: hvd.allreduce(torch.ones(3 if r == 0 else 4), name="m1"))
    attempt("mismatch/dtype", lambda: hvd.allgather(
        torch.ones(2, dtype=torch.float64 if r else torch.float32), name="m2"))
    attempt("mismatch/op", lambda: hvd.allreduce(x, name="m3", op=hvd.Max if r == 0 else hvd.Sum))
    attempt("mismatch/root", lambda: hvd.broadcast(x, root_rank=r % 2, name="m4"))
    for kind, start in (("allreduce", lambda: hvd.allreduce_async(x, name="d1")),
                        ("allgather", lambda: hvd.allgather_async(x, name="d2")),
                        ("broadcast", lambda: hvd.broadcast_async(x, root_rank=0, name="d3")),
                        ("reducescatter", lambda: hvd.reducescatter_async(x, name="d4"))):
        if r > 0:
            time.sleep(1.0)  # rank 0 starts first; its peers are elsewhere meanwhile
        first = start()
        if r == 0:
            attempt(f"duplicate/{kind}", start)
        hvd.synchronize(first)
    # (named: Horovod's count of unnamed calls differs between ranks after some refusals)
    out["job_goes_on"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="end").item()
    return out


def reducescatter_wire() -> dict:
    """What a reducescatter hands to c10d: per data collective (the descriptor check aside),
    its kind and the bytes of this rank's input -- one reduce-scatter per dtype, or, as this
    engine once did, an allreduce of everything."""
    import torch

    import hvdsync.torch as hvd
    from hvdsync.torch.c10d import runtime
    hvd.init()
    n, real, seen = hvd.size(), runtime.PROCESS.api, []

    class Counting:
        def __getattr__(self, attr: str) -> Any:
            fn = getattr(real, attr)
            if attr == "all_reduce":
                return lambda t, *a, **k: (seen.append([attr, t.numel() * t.element_size()]),
                                           fn(t, *a, **k))[1]
            if attr == "reduce_scatter_single":
                return lambda out, t, *a, **k: (
                    seen.append([attr, t.numel() * t.element_size()]), fn(out, t, *a, **k))[1]
            return fn

    runtime.PROCESS.api = Counting()
    try:
        even = hvd.reducescatter(torch.ones(4 * n, 3), op=hvd.Sum, name="w1")
        grouped = hvd.grouped_reducescatter([torch.ones(2 * n, 5), torch.ones(n, 2),
                                             torch.ones(n, 2, dtype=torch.float64)], name="w2")
        uneven = hvd.reducescatter(torch.ones(2 * n + 1, 3), name="w3")
    finally:
        runtime.PROCESS.api = real
    return {"seen": seen, "rows": [list(even.shape), [list(g.shape) for g in grouped],
                                   list(uneven.shape)]}


def rank_leaves() -> Any:
    """Every rank but 0 ends its process at once; rank 0's next collective must raise."""
    import time

    import torch

    import hvdsync.torch as hvd
    hvd.init()
    if hvd.rank() != 0:
        return "left"
    time.sleep(1.0)
    start = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2), name="after_they_left")
    except hvd.HorovodInternalError as e:
        return (str(e), time.monotonic() - start)
    return None


def sync_batch_norm() -> dict:
    """``hvd.SyncBatchNorm`` on each rank's shard against torch's BatchNorm on the whole
    global batch in one process: outputs, input and parameter gradients, running statistics."""
    import torch

    import hvdsync.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    gen = torch.Generator().manual_seed(7)
    shards = [torch.randn(3 + k, 4, 5, generator=gen, dtype=torch.float64) * (k + 1) + k
              for k in range(n)]  # uneven batches, different means and scales per rank
    weights = torch.randn(sum(s.shape[0] for s in shards), 4, 5, generator=gen,
                          dtype=torch.float64)
    sync = hvd.SyncBatchNorm(4, momentum=0.3).double()
    whole = torch.nn.BatchNorm1d(4, momentum=0.3).double()
    with torch.no_grad():
        for m in (sync, whole):
            m.weight.copy_(torch.linspace(0.5, 2.0, 4))
            m.bias.copy_(torch.linspace(-1.0, 1.0, 4))
    mine = shards[r].clone().requires_grad_()
    start = sum(s.shape[0] for s in shards[:r])
    y = sync(mine)
    (y * weights[start:start + mine.shape[0]]).sum().backward()
    everything = torch.cat(shards).requires_grad_()
    ref = whole(everything)
    (ref * weights).sum().backward()
    grads = hvd.allreduce(torch.cat([sync.weight.grad, sync.bias.grad]), op=hvd.Sum)
    sync.eval()
    whole.eval()
    return dict(
        output=float((y - ref[start:start + mine.shape[0]]).abs().max()),
        input_grad=float((mine.grad - everything.grad[start:start + mine.shape[0]]).abs().max()),
        param_grads=float((grads - torch.cat([whole.weight.grad, whole.bias.grad])).abs().max()),
        running=float(max((sync.running_mean - whole.running_mean).abs().max(),
                          (sync.running_var - whole.running_var).abs().max())),
        eval_output=float((sync(shards[r]) - whole(shards[r])).abs().max()),
        batches=int(sync.num_batches_tracked))


def run_script(path: str, outputs: str) -> dict:
    """Run the script at ``path`` as ``__main__`` (a user's script launched by the launcher);
    what it saved, read back on this rank."""
    import os
    import runpy

    import torch
    os.environ["SCRIPT_OUTPUTS"] = outputs
    runpy.run_path(path, run_name="__main__")
    rank = int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0")))
    saved = torch.load(os.path.join(outputs, f"rank{rank}.pt"), weights_only=True)
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}


def async_forms() -> dict:
    """The asynchronous and in-place forms, several in flight at once, and the job's facts."""
    import torch

    import hvdsync.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = torch.arange(4 * n, dtype=torch.float32).reshape(2 * n, 2) + r
    out: dict = dict(initialized=hvd.is_initialized(),
                     cross=[hvd.cross_rank(), hvd.cross_size()],
                     environment={v: os.environ.get(v) for v in HOROVOD_ENVIRONMENT})
    handles = {
        "allreduce_async_": hvd.allreduce_async_(x.clone(), name="f.a", op=hvd.Min),
        "allgather_async": hvd.allgather_async(x[:r + 1], name="f.b"),
        "alltoall_async": hvd.alltoall_async(x, name="f.c"),
        "broadcast_async": hvd.broadcast_async(x, root_rank=0, name="f.d"),
        "broadcast_async_": hvd.broadcast_async_(x.clone(), root_rank=n - 1, name="f.e"),
        "grouped_allreduce_async": hvd.grouped_allreduce_async([x, x * 2], name="f.f",
                                                               op=hvd.Product),
        "reducescatter_async": hvd.reducescatter_async(x, name="f.g"),
        "grouped_reducescatter_async": hvd.grouped_reducescatter_async(
            [x, x[:n + 1].clone()], name="f.h", op=hvd.Sum),
    }
    for label, handle in handles.items():
        out[label] = _answer(lambda: hvd.synchronize(handle))
    grouped = [x.clone(), x.clone() * 3]
    hvd.grouped_allreduce_(grouped, name="f.i", op=hvd.Sum)
    out["grouped_allreduce_"] = [_plain(g) for g in grouped]
    return out


def async_without_waiting() -> dict:
    """Rank 0 starts one async call of each kind while its peers sleep (1.5 s): how long the
    starts took there, and every result after ``synchronize`` (a blocking barrier between:
    rank 0 waits there, not at the calls). Then two async calls each rank starts in another
    order than rank 0: their results, or the error each raised."""
    import time

    import torch

    import hvdsync.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = torch.arange(2 * n * 2, dtype=torch.float32).reshape(2 * n, 2) + r
    if r > 0:
        time.sleep(1.5)
    start = time.monotonic()
    handles = {"allreduce": hvd.allreduce_async(x, name="w.a", op=hvd.Sum),
               "allgather": hvd.allgather_async(x[:r + 1], name="w.b"),
               "broadcast": hvd.broadcast_async(x, root_rank=n - 1, name="w.c"),
               "reducescatter": hvd.reducescatter_async(x, name="w.d", op=hvd.Sum),
               "alltoall": hvd.alltoall_async(x, name="w.e")}
    out: dict = {"start_seconds": time.monotonic() - start}
    hvd.barrier()
    out["results"] = {k: _answer(lambda: hvd.synchronize(h)) for k, h in handles.items()}
    names = ["o.x", "o.y"] if r == 0 else ["o.y", "o.x"]
    started = {name: hvd.allreduce_async(torch.full((2,), float(r)), name=name, op=hvd.Sum)
               for name in names}
    for name in ("o.x", "o.y"):
        try:
            out[name] = hvd.synchronize(started[name]).tolist()
        except hvd.HorovodInternalError as e:
            out[name] = str(e)
    out["job_goes_on"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="w.end").item()
    return out


def join_uneven() -> dict:
    """Horovod's uneven data: rank r has r + 1 batches, each an allreduce (average) and a
    grouped allreduce (sum, two dtypes); a rank out of batches calls ``hvd.join()`` and answers
    the others' with zeros. Then rank 0 joins at once while the others try an allgather and
    a broadcast (Horovod refuses both while a rank has joined) and join. Per rank: the results,
    join's answers, what the refused calls raised, and a last allreduce."""
    import torch

    import hvdsync.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out: dict = {"average": [], "sum": []}
    for step in range(r + 1):
        t = torch.arange(3, dtype=torch.float32) + 10 * (r + 1) + step
        out["average"].append(hvd.allreduce(t, name=f"j.avg.{step}").tolist())
        grouped = hvd.grouped_allreduce([t, t.double() * 2], name=f"j.sum.{step}", op=hvd.Sum)
        out["sum"].append([g.tolist() for g in grouped])
    out["last"] = hvd.join()
    if r > 0:
        for label, call in (("allgather", lambda: hvd.allgather(torch.ones(2), name="j.ag")),
                            ("broadcast", lambda: hvd.broadcast(torch.ones(2), 1, name="j.b"))):
            try:
                call()
                out[label] = None
            except RuntimeError as e:  # Horovod's torch.FatalError is one too
                out[label] = isinstance(e, RuntimeError)
    out["last_again"] = hvd.join()
    out["job_goes_on"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="j.end").item()
    return out


def join_with_own_call_in_flight() -> dict:
    """The last rank starts an ``allreduce_async`` and calls ``hvd.join()`` before its peers
    have started theirs (they come 0.5 s later): the call completes with every rank's values
    (Horovod 0.28 would crash the peers: it counts the call ready once the ranks not joined
    have started it), then join returns. Per rank: the sum, and join's answer."""
    import time

    import torch

    import hvdsync.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    mine = torch.tensor([float(r + 1)])
    if r == n - 1:
        handle = hvd.allreduce_async(mine, name="in_flight", op=hvd.Sum)
        last = hvd.join()
        total = hvd.synchronize(handle).item()
    else:
        time.sleep(0.5)
        total = hvd.allreduce(mine, name="in_flight", op=hvd.Sum).item()
        last = hvd.join()
    return {"sum": total, "last": last}


def checks_in_training() -> dict:
    """How many descriptor checks (one small blocking round each) hvdsync's own training steps
    and flush cost on the torch engine (none: the pipeline's order is the same on every rank
    by construction), against a script's own collectives (one each)."""
    import torch

    import hvdsync.torch as hvd
    from hvdsync.torch.c10d import checks as c10d_checks
    from tests.models import MLP, teacher_batches
    hvd.init()
    counted = {"n": 0}
    original = c10d_checks.descriptor

    def counting(desc: dict) -> list:
        counted["n"] += 1
        return original(desc)
    c10d_checks.descriptor = counting
    try:
        torch.manual_seed(0)
        model = MLP()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), clip=1.0,
                                       threshold=dict(threshold=0.5))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        before = counted["n"]
        for x, y in teacher_batches(hvd.rank(), 4):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        opt.flush()
        in_training = counted["n"] - before
        hvd.allreduce(torch.ones(1), name="a script's own")
        return dict(setup=before, training=in_training,
                    script=counted["n"] - before - in_training)
    finally:
        c10d_checks.descriptor = original


def step_while_a_rank_joined() -> Any:
    """Rank 1 runs out of data and calls ``hvd.join()`` while rank 0 steps hvdsync's
    optimizer with ``delay=`` (which cannot go on beside a joined rank: its parameter
    averaging would count the joined rank's); rank 0 must get a clear error, then joins too.
    Per rank: what the step raised, and what ``join`` raised (on torchrun the joined rank
    raises too: the step's collectives were started, and the job cannot go on)."""
    import torch

    import hvdsync.torch as hvd
    from hvdsync.safety.agreement import RanksDisagree
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   delay=dict(staleness=1, average_every=2))
    said = None
    try:
        for _ in range(3 if hvd.rank() == 0 else 1):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
    except RanksDisagree as e:
        said = str(e)
    try:
        hvd.join()
        return said, None
    except hvd.HorovodInternalError as e:  # torchrun: the joined rank's, and then the job's
        return said, str(e)


#: hvdsync's optimizer beside hvd.join() (the techniques that can go on beside a joined rank;
#: sparse= on torch.distributed only: Horovod answers no allgather while a rank has joined)
JOIN_TECHNIQUES = {
    "plain": {}, "clip": dict(clip=dict(max_norm=0.5)),
    "threshold": dict(threshold=dict(threshold=0.3, max_skip=3)),
    "select": dict(select=dict(k=1, max_wait=2)),
    "lowrank": dict(lowrank=dict(rank=1, warmup_steps=1, min_compression=0)),
}


def join_with_optimizer() -> dict:
    """Uneven data under hvdsync's optimizer (momentum, a learning rate stepped per batch):
    rank r has 2 + 2 r batches, then calls ``hvd.join()`` (rank 0 first), then ``flush()``. Per technique and rank: the parameters
    after the join, after the flush, and join's answer; on Horovod also Horovod's own
    ``DistributedOptimizer`` on the same data (the reference)."""
    import torch
    from torch import nn

    import hvdsync.torch as hvd
    from tests.models import MLP, teacher_batches
    hvd.init()
    torch.set_num_threads(1)
    r = hvd.rank()
    batches = teacher_batches(r, 2 + 2 * r)
    cases = dict(JOIN_TECHNIQUES)
    if hvd.backend_name() == "torch":
        cases["sparse"] = dict(sparse=True)
    else:
        import horovod.torch as horovod
        cases["horovod"] = None
    out: dict = {}
    for name, options in cases.items():
        torch.manual_seed(0)
        model = MLP()
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = (horovod.DistributedOptimizer(base, named_parameters=model.named_parameters())
               if options is None else
               hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        **options))
        schedule = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.8)
        for x, y in batches:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            schedule.step()  # per batch: a joined rank's rate stays behind
        last = hvd.join()
        joined = [p.detach().clone() for p in model.parameters()]
        if options is not None:
            opt.flush()
            opt.close()
        out[name] = dict(last=last, joined=[p.tolist() for p in joined],
                         flushed=[p.detach().tolist() for p in model.parameters()])
    return out
