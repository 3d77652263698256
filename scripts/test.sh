#!/usr/bin/env bash
# Set everything up (if needed) and run the test suite: real multi-rank jobs (Gloo, 2 and 3
# ranks) on Horovod (horovodrun) and on torch.distributed (torchrun). Extra arguments go to
# pytest; the 30 slowest tests are listed at the end (where the suite's time goes).
#
# Test files run on HVDSYNC_TEST_WORKERS pytest-xdist workers (default 2; 0: in this process,
# one file after another), each file on one worker (its module-scoped rank jobs run once).
# A rank job spends much of its time waiting -- launches, rendezvous, watchdog and timeout
# tests that wait by design, ranks in lockstep -- so two at once keep 2 cores busy
# (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/quiet_tf.sh
exec .venv/bin/python -m pytest --durations=30 -n "${HVDSYNC_TEST_WORKERS:-2}" --dist loadfile "$@"
