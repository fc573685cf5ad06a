#!/usr/bin/env bash
# Runs the llama.cpp adapter's tests from .venv-llamacpp (made by scripts/setup-llamacpp.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-llamacpp/bin/python ]; then
  echo "test-llamacpp: .venv-llamacpp is missing; run scripts/setup-llamacpp.sh (make setup-llamacpp)" >&2
  exit 1
fi
# No hub, ever; the converted default model lives in the user cache (XDG_CACHE_HOME) like ropekv's own.
export HF_HUB_OFFLINE=1
# Two cores on CI: llama.cpp's threads and torch's threads must not fight each other.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec .venv-llamacpp/bin/python -m pytest engine_tests/llamacpp -q -p no:cacheprovider "$@"
