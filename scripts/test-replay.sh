#!/usr/bin/env bash
# Replays ropekv's corpus of shipped engine bugs (engine_tests/replay) from .venv. Each release gets its
# own venv under $ROPEKV_REPLAY_VENVS (default: ropekv's cache folder, ~/.cache/ropekv/replay), built
# from pip's cache on first use and reused after; mlx-lm's need Debian's OpenBLAS (scripts/setup-mlx.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "test-replay: .venv is missing; run: make setup" >&2; exit 2; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-2}
if [ $# -eq 0 ] || [ "${1#-}" != "$1" ]; then set -- engine_tests/replay "$@"; fi
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
