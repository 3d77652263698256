#!/usr/bin/env bash
# Set everything up (if needed) and run the test suite: real multi-rank jobs (Gloo, 2 and 3
# ranks) on Horovod (horovodrun) and on torch.distributed (torchrun). Extra arguments go to
# pytest; the 30 slowest tests are listed at the end (where the suite's time goes).
#
# HVDSYNC_TEST_WORKERS=N runs the files on N pytest-xdist workers, each file on one worker
# (its module-scoped rank jobs run once). Default 0: one file after another -- on 2 cores two
# workers were slower (1058 s against 957 s, 2045 against 1516 s of CPU: ranks that
# busy-wait for peers descheduled by the other file's ranks; docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/quiet_tf.sh
exec .venv/bin/python -m pytest --durations=30 -n "${HVDSYNC_TEST_WORKERS:-0}" --dist loadfile "$@"
