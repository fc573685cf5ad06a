#!/usr/bin/env bash
# Runs the mlx-lm adapter's tests from .venv-mlx (make it first: scripts/setup-mlx.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-mlx/bin/python ] || { echo "test-mlx: .venv-mlx is missing; run scripts/setup-mlx.sh" >&2; exit 1; }
export HF_HUB_OFFLINE=1            # mlx-lm / transformers must never reach a hub
export TOKENIZERS_PARALLELISM=false
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-2}   # the CI machine has 2 cores
exec .venv-mlx/bin/python -m pytest engine_tests/mlx -p no:cacheprovider "$@"  # -q comes from pyproject addopts
