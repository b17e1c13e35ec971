#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check rayckpt tests jobs benchmarks
# pytest runs every tier folder under tests/ (pyproject testpaths): unit, multiproc, faults, ray, e2e.
.venv/bin/python -m pytest -q "$@"
