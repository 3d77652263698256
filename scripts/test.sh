#!/usr/bin/env bash
# Set everything up (if needed) and run the test suite: real multi-rank Horovod jobs
# (Gloo, 2 and 3 ranks). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/quiet_tf.sh
exec .venv/bin/python -m pytest "$@"
