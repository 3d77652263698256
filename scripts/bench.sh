#!/usr/bin/env bash
# Set everything up (if needed) and run the standard benchmark set: hvdsync's techniques vs
# plain Horovod, Horovod fp16 and DDP+PowerSGD on an emulated slow network (each rank in its
# own network namespace; needs root, else only --nets loopback runs). `--quick`: < 10 minutes.
# Results and plots land in benchmarks/results/. Extra arguments go to bench_suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pip install --quiet -r requirements-bench.txt
source scripts/quiet_tf.sh
exec .venv/bin/python -m benchmarks.bench_suite "$@"
