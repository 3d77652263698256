"""The same short training run, plain and with hvdsync's techniques, side by side.

    horovodrun -np 2 -H localhost:2 --gloo python examples/torch/compare.py [--epochs 4]
    torchrun --nproc-per-node 2 -m examples.torch.compare     # torch.distributed, no Horovod

Every configuration trains the digits MLP of ``train_digits.py`` from the same start, on the
same shards, one after the other in this one job. Rank 0 prints, per configuration, what
each rank sent per step (and as a fraction of what Horovod sends), the share of layer sends
skipped, the time per step and the held-out accuracy at the end.

On one machine the ranks talk over loopback, so the time column shows what each method
costs in computation, not what it saves on a slow network: for that, see
``bash scripts/bench.sh --quick`` (an emulated 100 Mbit/s link) and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os

from examples.torch.train_digits import train

CONFIGS = [
    ("{baseline} (baseline)", dict(baseline=True)),
    ("hvdsync, nothing on", {}),
    ("fp16 compression", dict(compression="fp16")),
    ("clip max_norm=1", dict(clip=dict(max_norm=1.0))),
    ("threshold 0.6, max_skip 8", dict(threshold=dict(threshold=0.6, max_skip=8))),
    ("select 1 of 3 layers", dict(select=dict(k=1, max_wait=4))),
    ("lowrank rank 4", dict(lowrank=dict(rank=4))),
    ("delay s=2 K=8 + fp16", dict(delay=dict(staleness=2, average_every=8),
                                  compression="fp16")),
    ("local steps, delay=\"streaming\"", dict(delay="streaming")),
]
#: the same MLP trained by Keras' ``fit`` (examples/keras/train_digits.py) on Keras'
#: torch backend: hvdsync.keras on this job's engine, no TensorFlow needed
KERAS_ROW = ("Keras fit, torch backend, \"streaming\"", dict(delay="streaming"))


def main() -> None:
    import hvdsync.torch as hvd
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    hvd.init()
    rows = []
    for name, options in CONFIGS:
        r = train(epochs=args.epochs, seed=args.seed, verbose=False, **options)
        baseline = "horovod" if hvd.backend_name() == "horovod" else "DDP"
        rows.append((name.format(baseline=baseline), r))
    os.environ["KERAS_BACKEND"] = "torch"  # (before Keras is imported)
    from examples.keras.train_digits import train as keras_train
    rows.append((KERAS_ROW[0], keras_train(epochs=args.epochs, seed=args.seed, verbose=False,
                                           **KERAS_ROW[1])))
    if hvd.rank() != 0:
        return
    dense = next(r["stats"]["total"] for _, r in rows if r["stats"] is not None)
    per_step_dense = dense["bytes_dense"] / max(dense["step"], 1)
    engine = {"horovod": "Horovod", "torch": "torch.distributed"}[hvd.backend_name()]
    print(f"\ndigits MLP, {hvd.size()} ranks on {engine}, {args.epochs} epochs, loopback "
          "(time = computation cost here, not network savings)\n")
    header = ("method", "KiB/step sent", "vs baseline", "layers skipped", "ms/step",
              "test accuracy")
    lines = [header]
    for name, r in rows:
        total = r["stats"]["total"] if r["stats"] is not None else None
        if total is None:  # the baseline sends every gradient, as hvdsync's dense count says
            sent, skipped, dense = per_step_dense, 0.0, per_step_dense
        else:
            sent = total["bytes_sent"] / max(total["step"], 1)
            dense = total["bytes_dense"] / max(total["step"], 1)  # (the Keras row's model)
            layers = total["layers_sent"] + total["layers_skipped"]
            skipped = total["layers_skipped"] / layers if layers else 0.0
        lines.append((name, f"{sent / 1024:.1f}", f"{sent / dense:.2f}",
                      f"{100 * skipped:.0f} %", f"{1000 * r['seconds'] / r['steps']:.2f}",
                      f"{100 * r['accuracy']:.1f} %"))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    for i, row in enumerate(lines):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                        for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("\nNext: which technique for your model and network -- the README's table, and "
          "python -m hvdsync.tools.advise (docs/at-scale.md); each technique: docs/<name>.md")


if __name__ == "__main__":
    main()
