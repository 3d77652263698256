#!/usr/bin/env bash
# Set everything up (if needed) and run the demo: the torch digits example on 2 Horovod
# ranks (Gloo), printing loss and accuracy per epoch and hvdsync's stats.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TF_CPP_MIN_LOG_LEVEL=2
exec .venv/bin/horovodrun -np 2 -H localhost:2 --gloo \
  .venv/bin/python examples/torch/train_digits.py "$@"
