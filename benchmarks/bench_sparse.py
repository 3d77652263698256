"""Sparse gradient exchange: hvdsync's grouped allgather vs Horovod's sparse path vs
``sparse_as_dense``, side by side in one job per world size.

    .venv/bin/python -m benchmarks.bench_sparse [--np 2 4] [--rows 1000000] [--dim 64]
                                                [--densities 0.001 0.01 0.1] [--reps 21]
                                                [--exponent 1.0]

The gradient is what ``nn.Embedding(rows, dim, sparse=True)`` produces for a batch of
Zipf-distributed ids (exponent 1 by default; popular ids scattered over the table; different
ids on each rank): one row per lookup, uncoalesced. The number of lookups is chosen so that
each rank touches the given fraction of the table ("density"). Each method wraps
``SGD(lr=0)``; per repetition, for each method in turn (rotating order), every rank gets the
same fresh gradient, the ranks meet at a barrier, and ``synchronize()`` (the exchange, up to
a gradient the optimizer can apply) and ``step()`` are timed. A repetition's time is the
slowest rank's; the table shows the median (over ``--reps``, or ``--dense-reps`` for the two
always-dense methods, which take seconds). "hvdsync" is the default one-round protocol,
"counts first" the two-round one (``one_round=False``).
Bytes are what one rank hands to collectives (for hvdsync including its counts collective).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from benchmarks.common import markdown_table, report, shows_progress
from hvdsync.testing import run_ranks
from hvdsync.testing import progress

METHODS = ("horovod sparse", "horovod sparse_as_dense", "hvdsync", "hvdsync counts first",
           "hvdsync gather only", "hvdsync dense only")
# Seconds per exchange instead of milliseconds: fewer repetitions keep the run short.
DENSE_METHODS = ("horovod sparse_as_dense", "hvdsync dense only")


def lookups_for(unique: float, probs: np.ndarray) -> int:
    """Lookups whose expected number of distinct ids is ``unique`` (bisection)."""
    log_miss = np.log1p(-probs)
    lo, hi = 1, 10**9
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if -np.expm1(mid * log_miss).sum() < unique:
            lo = mid
        else:
            hi = mid
    return hi


def exchange_body(rows: int, dim: int, densities: list[float], reps: int, dense_reps: int,
                  exponent: float) -> dict:
    import horovod.torch as horovod_hvd
    import torch

    import hvdsync.torch as hvd
    from hvdsync.torch.comm import payload_bytes

    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    weights = 1.0 / np.arange(1, rows + 1) ** exponent
    probs = weights / weights.sum()
    scatter = np.random.default_rng(1234).permutation(rows)
    param = torch.nn.Parameter(torch.zeros(rows, dim))

    def wrap(method: str):
        base = torch.optim.SGD([param], lr=0.0)
        named = [("embedding.weight", param)]
        if method.startswith("horovod"):
            return horovod_hvd.DistributedOptimizer(
                base, named_parameters=named, sparse_as_dense=method.endswith("as_dense"))
        config = {"hvdsync": dict(), "hvdsync counts first": dict(one_round=False),
                  "hvdsync gather only": dict(dense_ratio=math.inf),
                  "hvdsync dense only": dict(dense_ratio=0.0)}[method]
        return hvd.DistributedOptimizer(base, named_parameters=named, sparse=config)

    out = {}
    for density in densities:
        lookups = lookups_for(density * rows, probs)
        rng = np.random.default_rng([7, rank, int(density * 1e6)])
        ids = torch.from_numpy(scatter[rng.choice(rows, size=lookups, p=probs)])
        grad = torch.sparse_coo_tensor(ids[None], torch.randn(lookups, dim), (rows, dim))
        unique = int(grad.coalesce()._nnz())
        opts = {method: wrap(method) for method in METHODS}
        times = {method: ([], []) for method in METHODS}
        for rep in range(reps + 1):  # the first is a warm-up
            progress.step(rep, reps + 1, f"density {density:g}, rep {rep}")
            # Methods interleaved, in a rotating order: drift hits them all alike.
            for method in METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]:
                if method in DENSE_METHODS and rep > dense_reps:
                    continue
                opt = opts[method]
                param.grad = grad.clone()
                hvd.barrier()
                t0 = time.perf_counter()
                opt.synchronize()
                t1 = time.perf_counter()
                with opt.skip_synchronize():
                    opt.step()
                t2 = time.perf_counter()
                if rep:
                    times[method][0].append(t1 - t0)
                    times[method][1].append(t2 - t1)
        per_method = {}
        for method, opt in opts.items():
            if method.startswith("horovod"):
                nbytes = (rows * dim * 4 if method.endswith("as_dense")
                          else payload_bytes(grad))
                route = "dense" if method.endswith("as_dense") else "allgather x2"
            else:
                last = opt.stats.last.as_dict()
                nbytes = last["bytes_sent"]
                route = next(k[7:] for k in ("sparse_gather", "sparse_dense", "sparse_none")
                             if last.get(k))
            per_method[method] = dict(sync=times[method][0], step=times[method][1],
                                      bytes=nbytes, route=route)
        del opts
        out[str(density)] = dict(lookups=lookups, unique=unique, methods=per_method)
    return out


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--dense-reps", type=int, default=5,
                    help="repetitions of the two always-dense methods")
    ap.add_argument("--exponent", type=float, default=1.0, help="Zipf exponent of the ids")
    args = ap.parse_args(argv)

    rows, data = [], {}
    for np_ in args.np:
        progress.cell(f"{np_} ranks")
        per_rank = run_ranks(exchange_body, np=np_,
                             args=(args.rows, args.dim, args.densities, args.reps,
                                   args.dense_reps, args.exponent), timeout=3000)
        for density in args.densities:
            key = str(density)
            ranks = [r[key] for r in per_rank]
            times = {}
            for method in METHODS:
                # per repetition the slowest rank; then the median over repetitions
                n = len(ranks[0]["methods"][method]["sync"])
                sync = statistics.median(max(r["methods"][method]["sync"][i] for r in ranks)
                                         for i in range(n))
                step = statistics.median(max(r["methods"][method]["step"][i] for r in ranks)
                                         for i in range(n))
                times[method] = (sync, step)
            hvd_sparse = times["horovod sparse"][0] + times["horovod sparse"][1]
            hvd_dense = times["horovod sparse_as_dense"][0] + times["horovod sparse_as_dense"][1]
            best = min(hvd_sparse, hvd_dense)
            for method in METHODS:
                m = ranks[0]["methods"][method]
                sync, step = times[method]
                rows.append([np_, f"{density:g}", method, m["route"],
                             round(m["bytes"] / 2**20, 2), round(sync * 1e3, 1),
                             round((sync + step) * 1e3, 1), hvd_sparse / (sync + step),
                             best / (sync + step)])
            data[f"np{np_}_density{key}"] = dict(
                lookups_per_rank=[r["lookups"] for r in ranks],
                unique_rows_per_rank=[r["unique"] for r in ranks],
                methods={m: dict(route=ranks[0]["methods"][m]["route"],
                                 bytes_rank0=ranks[0]["methods"][m]["bytes"],
                                 sync_s=[r["methods"][m]["sync"] for r in ranks],
                                 step_s=[r["methods"][m]["step"] for r in ranks])
                         for m in METHODS})
    table = markdown_table(
        ["ranks", "density", "method", "route", "MiB/rank", "exchange ms",
         "exchange+step ms", "speedup vs Horovod sparse", "speedup vs best Horovod"], rows)
    report(f"sparse_exchange_zipf{args.exponent:g}",
           f"sparse exchange, {args.rows}x{args.dim} float32 table, Zipf ids (exponent "
           f"{args.exponent:g}), median of {args.reps} reps ({args.dense_reps} for always-dense)",
           table,
           {"args": vars(args), "results": data}, "benchmarks.bench_sparse", argv)


if __name__ == "__main__":
    main()
