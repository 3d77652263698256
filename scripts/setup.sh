#!/usr/bin/env bash
# Set up a fresh machine for hvdsync: a virtualenv in .venv with the pinned stack
# (requirements.txt), Horovod 0.28.1 built against it (cached, see install_horovod.sh), and
# hvdsync installed in editable mode. Safe to re-run: finished steps are skipped quickly.
#
#   --torch-only   torch without Horovod or TensorFlow (requirements-torch.txt), nothing to
#                  compile: hvdsync.torch on torch.distributed, launched by torchrun
#                  (docs/install.md). A later run without the flag adds the rest.
set -euo pipefail
torch_only=0
if [ "${1:-}" = "--torch-only" ]; then torch_only=1; fi
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
if [ "$torch_only" = 1 ]; then
  log "installing the torch-only stack (requirements-torch.txt)"
  quiet .venv/bin/python -m pip install -q -r requirements-torch.txt
else
  log "installing the pinned stack (requirements.txt)"
  quiet .venv/bin/python -m pip install -q -r requirements.txt
fi
if ! .venv/bin/python -m pip show -q hvdsync >/dev/null 2>&1; then
  log "installing hvdsync (editable)"
  # setuptools' editable-install notices are noise here; show the log only on failure.
  .venv/bin/python -m pip install -q --no-deps -e . >.venv/hvdsync-install.log 2>&1 \
    || { cat .venv/hvdsync-install.log >&2; exit 1; }
fi
if [ "$torch_only" = 0 ]; then
  PYTHON=.venv/bin/python scripts/install_horovod.sh
fi
log "ready in $(( $(date +%s) - start ))s"
