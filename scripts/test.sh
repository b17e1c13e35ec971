#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check rayckpt tests jobs benchmarks
# pytest collects every tier under tests/: unit, multiproc, ray, faults (fault injection), e2e
.venv/bin/python -m pytest -q "$@"
