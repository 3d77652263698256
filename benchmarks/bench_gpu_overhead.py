"""Step-time overhead on one GPU (1 rank): the bare optimizer vs Horovod's
DistributedOptimizer vs hvdsync's, on a 12-layer 2048-wide MLP, batch 256 (the setting in
which Horovod's own wrapper measured 1.028x the bare step on an H100, docs/benchmarks.md).

    python -m benchmarks.bench_gpu_overhead [--rounds 7 --steps 30] [--out DIR]

Methods are interleaved round by round (each round times ``--steps`` steps of every method,
CUDA-synchronized), and the median per-step time over rounds is reported. On one rank both
wrappers normally skip work: Horovod registers no gradient hooks at all (it is the bare
optimizer), hvdsync keeps its hooks (layers, stats, techniques) but sends nothing (a
reduction over one rank is the identity). So two more rows force the full path on both --
Horovod's hooks (``HOROVOD_ELASTIC=1`` at construction) and hvdsync's grouped allreduces,
each through Horovod's NCCL path with one rank: "hvdsync, full path" vs "horovod, full path"
is the machinery overhead that multi-GPU users pay. The recipe for
building Horovod with NCCL is in README ("GPU").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.common import shows_progress
from hvdsync.testing import progress


@shows_progress
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default=None, help="directory for the results (default: "
                    "benchmarks/results)")
    args = ap.parse_args(argv)

    import horovod.torch as horovod
    import torch
    from torch import nn

    import hvdsync.torch as hvd
    hvd.init()
    assert torch.cuda.is_available(), "needs a GPU"
    torch.cuda.set_device(hvd.local_rank())
    dev = torch.device("cuda")

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        layers = []
        for _ in range(args.depth - 1):
            layers += [nn.Linear(args.width, args.width), nn.ReLU()]
        layers.append(nn.Linear(args.width, 10))
        return nn.Sequential(*layers).to(dev)

    def make(kind: str):
        model = mlp()
        base = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        named = model.named_parameters()
        if kind == "bare":
            return model, base
        if kind == "horovod":
            return model, horovod.DistributedOptimizer(base, named_parameters=named)
        if kind == "hvdsync":
            return model, hvd.DistributedOptimizer(base, named_parameters=named)
        if kind == "horovod, full path":
            os.environ["HOROVOD_ELASTIC"] = "1"  # makes Horovod register its hooks on 1 rank
            try:
                return model, horovod.DistributedOptimizer(base, named_parameters=named)
            finally:
                del os.environ["HOROVOD_ELASTIC"]
        if kind in ("hvdsync, full path", "hvdsync clip, full path"):
            clip = dict(max_norm=1e6) if "clip" in kind else None
            opt = hvd.DistributedOptimizer(base, named_parameters=named, clip=clip)
            opt._comm.force_collectives = True  # send through Horovod/NCCL even on 1 rank
            return model, opt
        raise ValueError(kind)

    kinds = ["bare", "horovod", "hvdsync", "horovod, full path", "hvdsync, full path",
             "hvdsync clip, full path"]
    setups = {k: make(k) for k in kinds}
    x = torch.randn(args.batch, args.width, device=dev)
    y = torch.randint(0, 10, (args.batch,), device=dev)

    def run(kind: str, steps: int) -> float:
        model, opt = setups[kind]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    for k in kinds:  # warm-up
        run(k, 10)
    per = {k: [] for k in kinds}
    for r in range(args.rounds):
        for i, k in enumerate(kinds):
            progress.step(r * len(kinds) + i, args.rounds * len(kinds),
                          f"round {r + 1}/{args.rounds}, {k}")
            per[k].append(run(k, args.steps))
    med = {k: statistics.median(v) for k, v in per.items()}
    ref = med["horovod, full path"]
    rows = [f"| {k} | {med[k] * 1e3:.3f} | {med[k] / med['bare']:.3f} | "
            f"{med[k] / med['horovod']:.3f} | {med[k] / ref:.3f} |" for k in kinds]
    table = "\n".join(["| method | ms/step (median) | vs bare | vs horovod | "
                       "vs horovod, full path |", "|---|---|---|---|---|", *rows])
    gpu = torch.cuda.get_device_name()
    info = dict(gpu=gpu, torch=torch.__version__, horovod=horovod.__version__
                if hasattr(horovod, "__version__") else __import__("horovod").__version__,
                nccl_built=bool(horovod.nccl_built()), model=f"{args.depth}x{args.width} MLP",
                batch=args.batch, rounds=args.rounds, steps=args.steps,
                ms_per_step={k: v * 1e3 for k, v in med.items()},
                all_rounds_ms={k: [t * 1e3 for t in v] for k, v in per.items()})
    print(f"{gpu}, torch {torch.__version__}, NCCL built: {info['nccl_built']}\n{table}")
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_overhead.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "gpu_overhead.md").write_text(
        f"{table}\n\n{gpu}, torch {torch.__version__}, Horovod {info['horovod']} with NCCL "
        f"({info['nccl_built']}), 1 rank; {args.depth}x{args.width} MLP, batch {args.batch}, "
        f"momentum SGD; median of {args.rounds} interleaved rounds of {args.steps} steps. "
        f"Made by `python -m benchmarks.bench_gpu_overhead` on {time.strftime('%Y-%m-%d')}.\n")


if __name__ == "__main__":
    main()
