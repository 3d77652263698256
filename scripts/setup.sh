#!/usr/bin/env bash
# Set up a fresh machine for hvdsync: a virtualenv in .venv with the pinned stack
# (requirements.txt), Horovod 0.28.1 built against it (cached, see install_horovod.sh), and
# hvdsync installed in editable mode. Safe to re-run: finished steps are skipped quickly.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
log() { echo "[setup] $*" >&2; }

if [ ! -x .venv/bin/python ]; then
  py=$(command -v python3.11 || command -v python3)
  log "creating .venv with $($py --version)"
  "$py" -m venv .venv
fi
# pip's "Location ... is ignored" lines come from this machine's global pip config; hide them.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
log "installing the pinned stack (requirements.txt)"
quiet .venv/bin/python -m pip install -q -r requirements.txt
if ! .venv/bin/python -m pip show -q hvdsync >/dev/null 2>&1; then
  log "installing hvdsync (editable)"
  # setuptools' editable-install notices are noise here; show the log only on failure.
  .venv/bin/python -m pip install -q --no-deps -e . >.venv/hvdsync-install.log 2>&1 \
    || { cat .venv/hvdsync-install.log >&2; exit 1; }
fi
PYTHON=.venv/bin/python scripts/install_horovod.sh
log "ready in $(( $(date +%s) - start ))s"
