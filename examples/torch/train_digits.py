"""Data-parallel training of an MLP on scikit-learn's bundled digits with hvdsync.

    horovodrun -np 2 -H localhost:2 --gloo python examples/torch/train_digits.py
    horovodrun -np 2 -H localhost:2 --gloo python examples/torch/train_digits.py --threshold 0.6 --max-skip 8
    horovodrun -np 2 -H localhost:2 --gloo python examples/torch/train_digits.py --clip 1.0
    horovodrun -np 2 -H localhost:2 --gloo python examples/torch/train_digits.py --select 1
    horovodrun -np 2 -H localhost:2 --gloo python examples/torch/train_digits.py --lowrank 4
    horovodrun -np 2 -H localhost:2 --gloo python examples/torch/train_digits.py --delay 2 --average-every 8
    horovodrun -np 2 -H localhost:2 --gloo python examples/torch/train_digits.py --delay streaming
    torchrun --nproc-per-node 2 -m examples.torch.train_digits --delay streaming   # no Horovod

The only change from a Horovod script is the import line: ``import hvdsync.torch as hvd``.
Started by ``torchrun`` it runs on torch.distributed instead (docs/backends.md).
Each rank trains on its own shard; rank 0 prints loss and held-out accuracy per epoch and the
wrapper's communication stats at the end.
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from typing import Any, Optional

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import hvdsync.torch as hvd


def train(epochs: int = 8, batch_size: int = 32, lr: float = 0.05, seed: int = 0,
          threshold: Optional[dict] = None, clip: Optional[dict] = None,
          select: Optional[dict] = None, delay: Optional[dict | str] = None,
          compression: str = "none", lowrank: Optional[dict] = None, baseline: bool = False,
          verbose: bool = True, between: Optional[str] = None) -> dict[str, Any]:
    """Train on this rank's shard; return final test accuracy, loss, the stats and the time
    per step. ``baseline=True`` trains without hvdsync instead: Horovod's own optimizer, or
    DDP on the torch backend. ``between="nodes"``: the techniques between nodes only
    (docs/nodes.md)."""
    # (Horovod registers the node's process sets at init; an empty list on one node)
    hvd.init(process_sets=hvd.node_process_sets() if between == "nodes" else None)
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    say = print if verbose and hvd.rank() == 0 else (lambda *a, **k: None)

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    # Each rank trains on its own shard.
    x_train = torch.from_numpy(x_train[hvd.rank()::hvd.size()])
    y_train = torch.from_numpy(y_train[hvd.rank()::hvd.size()])
    x_test, y_test = torch.from_numpy(x_test), torch.from_numpy(y_test)

    model = nn.Sequential(OrderedDict(fc1=nn.Linear(64, 128), relu1=nn.ReLU(),
                                      fc2=nn.Linear(128, 64), relu2=nn.ReLU(),
                                      out=nn.Linear(64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    wire = getattr(hvd.Compression, compression)
    net = model
    if baseline and hvd.backend_name() == "horovod":
        import horovod.torch
        opt = horovod.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                                 compression=wire)
    elif baseline:  # torch.distributed: DDP, with its fp16 hook for compression="fp16"
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        net = nn.parallel.DistributedDataParallel(model)
        if compression == "fp16":
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=wire, threshold=threshold, clip=clip,
                                       select=select, delay=delay, lowrank=lowrank,
                                       between=between)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    say(f"training on {hvd.size()} ranks, {len(x_train)} samples per rank", flush=True)
    # Same number of steps on every rank (shards may differ by one sample).
    steps = int(hvd.allreduce(torch.tensor(len(x_train) // batch_size), op=hvd.Min,
                              name="steps_per_epoch").item())
    seconds = 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        perm = torch.randperm(len(x_train))
        total = 0.0
        start = time.perf_counter()
        for i in range(steps):
            idx = perm[i * batch_size:(i + 1) * batch_size]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        if not baseline:
            opt.flush()  # with --delay: identical replicas before evaluating (else a no-op)
        seconds += time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean()
        loss_avg = hvd.allreduce(torch.tensor(total / steps), name="loss").item()
        acc = hvd.allreduce(acc, name="acc").item()
        say(f"epoch {epoch:2d}  loss {loss_avg:.4f}  test accuracy {acc:.3f}", flush=True)
    say(f"trained in {seconds:.1f}s")
    stats = None
    if not baseline:
        say(opt.stats.summary())
        stats = opt.stats.as_dict()
    return dict(accuracy=acc, loss=loss_avg, stats=stats, seconds=seconds,
                steps=steps * epochs)


PRESETS = ("diloco", "streaming")  # delay= presets (docs/delay.md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by world size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threshold", type=float, default=None,
                    help="send a layer only when its accumulated gradient norm reaches this")
    ap.add_argument("--max-skip", type=int, default=None,
                    help="with --threshold: sync a layer after this many skipped steps")
    ap.add_argument("--clip", type=float, default=None, help="per-layer max gradient norm")
    ap.add_argument("--select", type=float, default=None,
                    help="push only this many layers per step (or a fraction < 1)")
    ap.add_argument("--selector", default="hypernet", choices=["hypernet", "norm", "random"])
    ap.add_argument("--delay", default=None, metavar="STALENESS|diloco|streaming",
                    help="a number: update with the local gradient at once, fold in global "
                         "gradients at most this many steps late; 'diloco' / 'streaming': "
                         "local steps with an outer optimizer (docs/delay.md)")
    ap.add_argument("--average-every", type=int, default=8,
                    help="with --delay: average the parameters every this many steps")
    ap.add_argument("--lowrank", type=int, default=None, metavar="RANK",
                    help="send weight matrices as rank-RANK factors (PowerSGD-style)")
    ap.add_argument("--fp16", action="store_true", help="fp16 compression on the wire")
    ap.add_argument("--between", choices=["nodes"], default=None,
                    help="nodes: the techniques between nodes only, synchronous inside each")
    args = ap.parse_args()
    threshold = (dict(threshold=args.threshold, max_skip=args.max_skip)
                 if args.threshold is not None else None)
    clip = dict(max_norm=args.clip) if args.clip is not None else None
    k = args.select if args.select is None or args.select < 1 else int(args.select)
    select = None if k is None else dict(k=k, selector=args.selector)
    delay = (None if args.delay is None else args.delay if args.delay in PRESETS
             else dict(staleness=int(args.delay), average_every=args.average_every))
    train(args.epochs, args.batch_size, args.lr, args.seed, threshold, clip, select, delay,
          compression="fp16" if args.fp16 else "none",
          lowrank=dict(rank=args.lowrank) if args.lowrank is not None else None,
          between=args.between)


if __name__ == "__main__":
    main()
