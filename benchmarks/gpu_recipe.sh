#!/usr/bin/env bash
# Build Horovod 0.28.1 with NCCL against this machine's CUDA torch (torch only, no TF) from
# carried files, then run the 1-GPU overhead benchmark. For a GPU machine without network:
#   WHEELS=<dir with horovod-0.28.1.tar.gz, cffi and pycparser wheels> bash benchmarks/gpu_recipe.sh [OUT]
# NCCL comes from the nvidia-nccl wheel that CUDA builds of torch install.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl}
OUTDIR=${1:-benchmarks/results}
PY=${PYTHON:-python3}
"$PY" -m pip install -q --no-index --no-deps "$WHEELS"/pycparser-*.whl "$WHEELS"/cffi-*.whl
NCCL=$("$PY" -c "import nvidia.nccl as n; print(list(n.__path__)[0])")
# Horovod's CMake looks for libnccl.so; the wheel ships libnccl.so.2 only.
[ -e "$NCCL/lib/libnccl.so" ] || ln -s libnccl.so.2 "$NCCL/lib/libnccl.so"
export HOROVOD_NCCL_INCLUDE="$NCCL/include" HOROVOD_NCCL_LIB="$NCCL/lib" HOROVOD_NCCL_LINK=SHARED
export HVDSYNC_FRAMEWORKS=torch PIP_OFFLINE_ARGS=--no-index
export HOROVOD_SDIST=$(ls "$WHEELS"/horovod-*.tar.gz)
export HVDSYNC_WHEEL_CACHE=${HVDSYNC_WHEEL_CACHE:-/tmp/hvdsync-wheels}
start=$(date +%s)
PYTHON="$PY" bash scripts/install_horovod.sh
echo "[gpu_recipe] Horovod with NCCL ready in $(( $(date +%s) - start ))s"
PYTHONPATH="$PWD" "$PY" -m benchmarks.bench_gpu_overhead --out "$OUTDIR"
