#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check rayckpt tests jobs benchmarks
# Every tier folder under tests/ runs (unit, multiproc, ray, faults, recovery, s3, e2e, gpu: skipped without CUDA);
# `pytest tests/faults` runs one.
# One line per test file as it runs (its tests as dots, then [done/total]), and the 15 slowest
# tests at the end: per-file progress without a line per test.
.venv/bin/python -m pytest -o console_output_style=count --durations=15 "$@"
