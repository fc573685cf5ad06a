#!/usr/bin/env bash
# Runs the CTranslate2 adapter's tests from .venv-ct2 (make it first: scripts/setup-ct2.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-ct2/bin/python ] || { echo "test-ct2: .venv-ct2 is missing; run scripts/setup-ct2.sh (make setup-ct2)" >&2; exit 1; }
export HF_HUB_OFFLINE=1            # the converter and transformers must never reach a hub
export TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}   # the CI machine has 2 cores
# pyproject.toml already adds -q; a second -q would drop the "N passed" closing line CI reads.
exec .venv-ct2/bin/python -m pytest engine_tests/ct2 -p no:cacheprovider "$@"
