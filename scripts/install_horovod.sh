#!/usr/bin/env bash
# Build (or reuse a cached build of) Horovod 0.28.1 against the torch and TensorFlow that are
# installed in the active Python environment, then install and verify it.
#
# Why this exists: Horovod 0.28.1 is the last release and does not build as-is on torch >= 2.1 /
# TF >= 2.10. Two things are needed (docs/install.md):
#   * C++17: Horovod's CMake forces -std=c++14, the torch/TF headers need C++17;
#   * horovod/tensorflow/xla_mpi_ops.cc includes XLA third-party headers the TF wheel does not
#     ship; it is only used with HOROVOD_ENABLE_XLA_OPS=1, so we compile it as if TF were < 2.6,
#     which makes the file compile to nothing.
# Both are done by a CXX wrapper that rewrites the compiler's arguments.
#
# Usage:  PYTHON=.venv/bin/python scripts/install_horovod.sh
# Env:    HVDSYNC_WHEEL_CACHE  where built wheels are kept (default ~/.cache/hvdsync/wheels)
#         HOROVOD_VERSION      (default 0.28.1)
#         HOROVOD_SDIST        a local Horovod sdist to build (machines without an index)
#         HVDSYNC_FRAMEWORKS   "torch,tensorflow" (default) or "torch"
#         HOROVOD_NCCL_HOME / HOROVOD_NCCL_INCLUDE + HOROVOD_NCCL_LIB, with nvcc on PATH:
#                              build with NCCL (GPU); see README "GPU" for the recipe
#         MAX_JOBS             parallel compile jobs (default: number of cores)
set -euo pipefail

PYTHON=${PYTHON:-python}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
FRAMEWORKS=${HVDSYNC_FRAMEWORKS:-torch,tensorflow}
case ",$FRAMEWORKS," in *,tensorflow,*) with_tf=1 ;; *) with_tf=0 ;; esac
CACHE=${HVDSYNC_WHEEL_CACHE:-$HOME/.cache/hvdsync/wheels}

log() { echo "[install_horovod] $*" >&2; }

verify() {
  WITH_TF=$with_tf TF_CPP_MIN_LOG_LEVEL=2 \
  "$PYTHON" - <<'PY'
import os
import horovod.torch as ht
ht.init()
assert ht.gloo_built(), "Horovod was built without Gloo"
assert ht.size() == 1, ht.size()
if os.environ["WITH_TF"] == "1":
    import horovod.tensorflow as htf
    htf.init()
print(f"[install_horovod] horovod {__import__('horovod').__version__} OK: torch"
      f"{'+tensorflow' if os.environ['WITH_TF'] == '1' else ''}, gloo_built={ht.gloo_built()}, "
      f"nccl_built={bool(ht.nccl_built())}")
PY
}

versions=$("$PYTHON" - <<'PY'
import sys, importlib.metadata as md
def v(name):
    for n in ([name] if not isinstance(name, list) else name):
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            pass
    return "none"
torch = v("torch").replace("+", "_")
tf = v(["tensorflow-cpu", "tensorflow"])
print(f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch}-tf{tf}")
PY
)
cuda_tag=cpu
if command -v nvcc >/dev/null 2>&1 && [ -n "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_LIB:-}" ]; then cuda_tag=nccl; fi
[ $with_tf = 1 ] || cuda_tag="$cuda_tag-torchonly"
key="horovod${HOROVOD_VERSION}-${versions}-${cuda_tag}"
wheel_dir="$CACHE/$key"

# Already installed and matching the key? Nothing to do.
if [ -f "$wheel_dir/installed-ok" ] && "$PYTHON" -c "import horovod, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null \
   && verify >/dev/null 2>&1; then
  log "already installed ($key)"
  exit 0
fi

if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  log "no cached wheel for $key: building Horovod $HOROVOD_VERSION (about 15 minutes on 2 cores)"
  command -v cmake >/dev/null || "$PYTHON" -m pip install -q "cmake<4"
  work=$(mktemp -d "${TMPDIR:-/tmp}/hvd-build.XXXXXX")
  buildlog="$work/build.log"
  if [ -n "${HOROVOD_SDIST:-}" ]; then
    cp "$HOROVOD_SDIST" "$work/"
  else
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION" \
      2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  fi
  cat >"$work/cxx" <<'WRAP'
#!/usr/bin/env bash
# Compiler wrapper for Horovod 0.28.1 on current torch/TF (see install_horovod.sh).
args=()
xla=0
for a in "$@"; do case "$a" in *xla_mpi_ops.cc) xla=1;; esac; done
for a in "$@"; do
  case "$a" in
    -std=c++1[14]|-std=gnu++1[14]) a=-std=gnu++17 ;;
    -DTENSORFLOW_VERSION=*) [ $xla = 1 ] && a=-DTENSORFLOW_VERSION=2005000000 ;;
  esac
  args+=("$a")
done
# Newer GCCs stop pulling these in transitively; Horovod relies on that.
exec ${HVD_REAL_CXX:-g++} -include string -include cstdint -include stdexcept "${args[@]}"
WRAP
  chmod +x "$work/cxx"
  export HVD_REAL_CXX=${CXX:-g++}
  export CXX="$work/cxx"
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1
  if [ $with_tf = 1 ]; then export HOROVOD_WITH_TENSORFLOW=1; else export HOROVOD_WITHOUT_TENSORFLOW=1; fi
  export HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_MXNET=1
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  export MAKEFLAGS="-j${MAX_JOBS}"
  case "$cuda_tag" in nccl*) export HOROVOD_GPU_OPERATIONS=NCCL ;; esac
  mkdir -p "$wheel_dir"
  log "build log: $buildlog"
  start=$(date +%s)
  if ! "$PYTHON" -m pip wheel -v --no-deps --no-build-isolation -w "$work/out" "$work"/horovod-*.tar.gz >"$buildlog" 2>&1; then
    log "BUILD FAILED; last lines of $buildlog:"
    tail -n 40 "$buildlog" >&2
    exit 1
  fi
  mv "$work"/out/horovod-*.whl "$wheel_dir/"
  log "built in $(( $(date +%s) - start ))s -> $wheel_dir"
  rm -rf "$work"  # kept only when the build fails, for its log
fi

"$PYTHON" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
# Horovod's runtime dependencies (its wheel was installed with --no-deps to keep torch/TF as they are).
"$PYTHON" -m pip install -q ${PIP_OFFLINE_ARGS:-} cloudpickle psutil pyyaml packaging cffi
if ! verify; then
  log "Horovod installed from $wheel_dir but failed verification"
  exit 1
fi
touch "$wheel_dir/installed-ok"
