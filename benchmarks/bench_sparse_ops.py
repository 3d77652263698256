"""Ops a ``sparse=`` step dispatches (each a kernel launch on a GPU), rank 0 of a real 2-rank
job (Horovod over Gloo), per route, by the code that dispatched them:

    python -m benchmarks.bench_sparse_ops out.json [--compare before.json]

An ``nn.EmbeddingBag(1000, 16, sparse=True)`` and a linear head, a batch of 32 x 8 ids; the
ops of 5 steps after 3 warm-up steps, averaged (``benchmarks.bench_fixed_cost.op_counter``).
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import shows_progress
from hvdsync.testing import progress, run_ranks

CASES = [("one round, gather", dict(sparse=True)),
         ("counts first, gather", dict(sparse=dict(one_round=False))),
         ("one round, dense route", dict(sparse=dict(dense_ratio=0)))]
WARMUP, STEPS = 3, 5


def body(cases: list) -> dict:
    import torch

    import hvdsync.torch as hvd
    from benchmarks.bench_fixed_cost import op_counter
    hvd.init()
    out = {}
    for i, (name, keywords) in enumerate(cases):
        progress.step(i, len(cases), name)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.EmbeddingBag(1000, 16, mode="sum", sparse=True),
                                    torch.nn.Linear(16, 4))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), **keywords)
        g = torch.Generator().manual_seed(hvd.rank())

        def step() -> None:
            x = torch.randint(0, 1000, (32, 8), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), torch.randint(0, 4, (32,), generator=g)
                                              ).backward()
            opt.step()
        for _ in range(WARMUP):
            step()
        counter = op_counter(callers=True)()
        with counter:
            for _ in range(STEPS):
                step()
        out[name] = dict(ops=counter.ops / STEPS,
                         by={k: v / STEPS for k, v in counter.by_caller.most_common()})
    return out


@shows_progress
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--compare", help="an earlier run's file: a table of both")
    args = ap.parse_args()
    result = run_ranks(body, np=2, args=(CASES,), timeout=300)[0]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    before = json.load(open(args.compare)) if args.compare else {}
    print("| route | ops a step before | ops a step after |\n|---|---:|---:|")
    for name, r in result.items():
        was = before.get(name, {}).get("ops")
        print(f"| {name} | {'-' if was is None else f'{was:g}'} | {r['ops']:g} |")


if __name__ == "__main__":
    main()
