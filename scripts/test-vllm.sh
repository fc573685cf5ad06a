#!/usr/bin/env bash
# Runs the vLLM adapter's tests from .venv-vllm (made by scripts/setup-vllm.sh), in-process vLLM on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-vllm/bin/python ]; then
  echo "test-vllm: .venv-vllm is missing; run: make setup-vllm" >&2
  exit 2
fi
# In-process engine core, so hooks and patches reach the model (vLLM would otherwise spawn a worker).
export VLLM_ENABLE_V1_MULTIPROCESSING=0
# With in-process vLLM, an unset thread count makes decode ~15x slower on these machines.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# KV cache size in GiB: the check needs a few thousand token slots of a 135M model.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Arguments select tests (files, -k ...); none: the whole vLLM suite.
if [ $# -eq 0 ] || [ "${1#-}" != "$1" ]; then set -- engine_tests/vllm "$@"; fi
# pyproject.toml already adds -q; a second -q would drop the "N passed" closing line CI reads.
exec .venv-vllm/bin/python -m pytest -p no:cacheprovider "$@"
