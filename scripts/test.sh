#!/usr/bin/env bash
# Set everything up (if needed) and run the test suite: real multi-rank jobs (Gloo, 2 and 3
# ranks) on Horovod (horovodrun) and on torch.distributed (torchrun). Extra arguments go to
# pytest; the 30 slowest tests are listed at the end (where the suite's time goes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/quiet_tf.sh
exec .venv/bin/python -m pytest --durations=30 "$@"
