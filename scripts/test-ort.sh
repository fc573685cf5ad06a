#!/usr/bin/env bash
# Runs the ONNX Runtime GenAI adapter's tests from .venv-ort (make it first: scripts/setup-ort.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-ort/bin/python ] || { echo "test-ort: .venv-ort is missing; run scripts/setup-ort.sh (make setup-ort)" >&2; exit 1; }
export HF_HUB_OFFLINE=1            # the converter and transformers must never reach a hub
export TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}   # the CI machine has 2 cores
# pyproject.toml already adds -q; a second -q would drop the "N passed" closing line CI reads.
exec .venv-ort/bin/python -m pytest engine_tests/ort -p no:cacheprovider "$@"
