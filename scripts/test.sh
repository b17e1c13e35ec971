#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check rayckpt tests jobs benchmarks
# Every tier folder under tests/ runs (unit, multiproc, ray, faults, e2e); `pytest tests/faults` runs one.
.venv/bin/python -m pytest -q "$@"
