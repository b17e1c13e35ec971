#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite. Extra args go to pytest (and then it runs only those).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/prometheus.sh || echo "prometheus: could not be unpacked: the dashboard's test is skipped" >&2
export PATH="$PWD/.venv/prometheus/usr/bin:$PATH"
.venv/bin/ruff check rayckpt testbed tests jobs benchmarks
# One line per test file as it runs (its tests as dots, then [done/total]), and the 15 slowest
# tests at the end: per-file progress without a line per test.
pytest=(.venv/bin/python -m pytest -o console_output_style=count --durations=15)
if [ "$#" -gt 0 ]; then
    exec "${pytest[@]}" "$@"
fi
# The whole suite: every tier folder under tests/ (hygiene, unit, multiproc, ray, faults, recovery, s3, e2e, gpu:
# skipped without CUDA); `pytest tests/faults` runs one. The two one-process tiers (hygiene: the repository itself;
# unit) run beside the others, which begin with the fault tier: its processes leave part of a core idle, which the
# one-process tiers fill. Their output follows the others'.
beside=(tests/hygiene tests/unit)
tiers=(tests/faults)
for dir in tests/*/; do
    dir=${dir%/}
    case " ${beside[*]} tests/faults " in *" $dir "*) continue ;; esac
    if compgen -G "$dir/test_*.py" > /dev/null; then
        tiers+=("$dir")
    fi
done
beside_log=$(mktemp)
"${pytest[@]}" -p no:cacheprovider "${beside[@]}" > "$beside_log" 2>&1 &
beside_pid=$!
trap 'kill "$beside_pid" 2> /dev/null || true; rm -f "$beside_log"' EXIT
status=0
"${pytest[@]}" "${tiers[@]}" || status=$?
beside_status=0
wait "$beside_pid" || beside_status=$?
echo "===== ${beside[*]} (ran beside the tiers above) ====="
cat "$beside_log"
if [ "$status" -ne 0 ] || [ "$beside_status" -ne 0 ]; then
    echo "FAILED: the tiers above exited $status, ${beside[*]} $beside_status" >&2
    exit 1
fi
