#!/usr/bin/env bash
# Create .venv and install rayckpt with its test tools. Idempotent: re-runs install
# only when pyproject.toml changed. torch==2.13.0 (the CPU build) goes in first so
# the package's torch>=2.6 range is already met and no CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.rayckpt-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
