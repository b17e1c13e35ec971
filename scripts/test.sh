#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check rayckpt tests jobs benchmarks
# Tiers (pyproject's testpaths = tests): unit, multiproc, ray, e2e, faults (fault injection).
.venv/bin/python -m pytest -q "$@"
