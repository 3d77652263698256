#!/usr/bin/env bash
# Set everything up (if needed) and run the demo: the same short digits training on 2 Horovod
# ranks (Gloo), plain Horovod and hvdsync with each technique, side by side (bytes sent per
# step, layers skipped, time per step, accuracy). Extra arguments go to examples/torch/compare.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/quiet_tf.sh
exec .venv/bin/horovodrun -np 2 -H localhost:2 --gloo \
  .venv/bin/python -m examples.torch.compare "$@"
