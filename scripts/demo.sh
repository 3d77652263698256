#!/usr/bin/env bash
# Set everything up (if needed) and run the demo: the same short digits training on 2 ranks
# (Gloo), the baseline and hvdsync with each technique, side by side (bytes sent per step,
# layers skipped, time per step, accuracy). Extra arguments go to examples/torch/compare.py.
#
#   bash scripts/demo.sh                 Horovod (horovodrun), baseline: Horovod's optimizer
#   bash scripts/demo.sh --torch-only    torch.distributed (torchrun), no Horovod to build,
#                                        baseline: DDP (docs/backends.md)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--torch-only" ]; then
  shift
  bash scripts/setup.sh --torch-only
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # (torchrun's default, said in a warning)
  exec .venv/bin/torchrun --standalone --nproc-per-node 2 -m examples.torch.compare "$@"
fi
bash scripts/setup.sh
source scripts/quiet_tf.sh
exec .venv/bin/horovodrun -np 2 -H localhost:2 --gloo \
  .venv/bin/python -m examples.torch.compare "$@"
