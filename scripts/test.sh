#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite. Extra args go to pytest (and then it runs only those).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check rayckpt tests jobs benchmarks
# One line per test file as it runs (its tests as dots, then [done/total]), and the 15 slowest
# tests at the end: per-file progress without a line per test.
pytest=(.venv/bin/python -m pytest -o console_output_style=count --durations=15)
if [ "$#" -gt 0 ]; then
    exec "${pytest[@]}" "$@"
fi
# The whole suite: every tier folder under tests/ (unit, multiproc, ray, faults, recovery, s3, e2e, gpu: skipped
# without CUDA); `pytest tests/faults` runs one. The unit tier (one process, about one core busy) runs beside the
# others, which begin with the fault tier (its processes keep about 1.2 of the 2 cores busy): together they take
# about 106 s where one after the other took 153 s. Its output follows theirs.
tiers=(tests/faults)
for dir in tests/*/; do
    dir=${dir%/}
    if [ "$dir" != tests/unit ] && [ "$dir" != tests/faults ] && compgen -G "$dir/test_*.py" > /dev/null; then
        tiers+=("$dir")
    fi
done
unit_log=$(mktemp)
"${pytest[@]}" -p no:cacheprovider tests/unit > "$unit_log" 2>&1 &
unit_pid=$!
trap 'kill "$unit_pid" 2> /dev/null || true; rm -f "$unit_log"' EXIT
status=0
"${pytest[@]}" "${tiers[@]}" || status=$?
unit_status=0
wait "$unit_pid" || unit_status=$?
echo "===== tests/unit (ran beside the tiers above) ====="
cat "$unit_log"
if [ "$status" -ne 0 ] || [ "$unit_status" -ne 0 ]; then
    echo "FAILED: the tiers above exited $status, tests/unit $unit_status" >&2
    exit 1
fi
