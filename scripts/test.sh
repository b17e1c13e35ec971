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
# skipped without CUDA); `pytest tests/faults` runs one. The tiers mostly wait (Ray start-ups, Ray Train's
# restarts, jobs on the hosts tests' nodes), so they run as three pytest processes side by side, each with its
# own local Ray, Ray heads and clusters (free ports, temp dirs, namespaces and host names of their own): the
# fault and e2e tiers; the other tiers; the two one-process tiers (hygiene: the repository itself; unit), niced:
# they only compute, while a Ray node that starts slowly may outlast Ray's own start-up timeouts.
# The first prints as it runs; each other's output follows it, one after the other.
streams=("tests/faults tests/e2e" "" "tests/hygiene tests/unit")
for dir in tests/*/; do
    dir=${dir%/}
    case " ${streams[0]} ${streams[2]} " in *" $dir "*) continue ;; esac
    if compgen -G "$dir/test_*.py" > /dev/null; then
        streams[1]+="${streams[1]:+ }$dir"
    fi
done
logs=() pids=() names=()
trap 'for pid in "${pids[@]}"; do kill "$pid" 2> /dev/null || true; done; rm -f "${logs[@]}"' EXIT
for i in 1 2; do
    stream=${streams[$i]}
    [ -n "$stream" ] || continue
    log=$(mktemp)
    niceness=$((i == 2 ? 10 : 0))
    # shellcheck disable=SC2086 # a stream is its folders, split on spaces
    nice -n "$niceness" "${pytest[@]}" -p no:cacheprovider $stream > "$log" 2>&1 &
    logs+=("$log") pids+=($!) names+=("$stream")
done
failed=()
status=0
# shellcheck disable=SC2086
"${pytest[@]}" ${streams[0]} || status=$?
if [ "$status" -ne 0 ]; then
    failed+=("${streams[0]} (exit $status)")
fi
for i in "${!pids[@]}"; do
    status=0
    wait "${pids[$i]}" || status=$?
    echo "===== ${names[$i]} (ran beside the tiers above) ====="
    cat "${logs[$i]}"
    if [ "$status" -ne 0 ]; then
        failed+=("${names[$i]} (exit $status)")
    fi
done
if [ "${#failed[@]}" -gt 0 ]; then
    printf 'FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
