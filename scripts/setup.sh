#!/usr/bin/env bash
# Create .venv and install rayckpt with its test tools, every package at the version
# pinned in requirements/lock.txt (regenerate it with scripts/lock.sh). Idempotent:
# re-runs install only when pyproject.toml, the lock or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
lock=requirements/lock.txt
# The interpreter must be one pyproject.toml's requires-python admits (the lock is resolved for those):
# refused in one line otherwise, before anything is made.
need=$(sed -n 's/^requires-python = "\(.*\)"$/\1/p' pyproject.toml)
found=$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2> /dev/null || true)
lowest=$(sed -n 's/.*>=\([0-9.]*\).*/\1/p' <<< "$need")
below=$(sed -n 's/.*<\([0-9.]*\).*/\1/p' <<< "$need")
older() { [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -1)" = "$1" ]; }
if [ -z "$found" ] || older "$found" "$lowest" || ! older "$found" "$below"; then
  echo "error: $PYTHON is Python ${found:-(none: it does not run)}; rayckpt needs Python $need (set PYTHON=...)" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.rayckpt-setup
want=$(cat pyproject.toml "$lock" scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip=(.venv/bin/python -m pip install -q)
  "${pip[@]}" -c "$lock" pip
  # torch==2.13.0 (the CPU build, from /opt/wheels) goes in first so that no CUDA build
  # is pulled; -c holds its own dependencies to the lock's versions.
  "${pip[@]}" -c "$lock" "torch==2.13.0"
  # Everything else at its pinned version with --no-deps: pip's resolver has nothing to
  # search (resolving .[test] backtracked through botocore/boto3 ranges for minutes).
  "${pip[@]}" --no-deps -r "$lock"
  # The package itself; the lock's setuptools builds it, so no isolated build env to fill.
  "${pip[@]}" --no-deps --no-build-isolation -e .
  # --no-deps trusts the lock: fail here, not in a test, if it misses a dependency.
  .venv/bin/python -m pip check
  echo "$want" > "$stamp"
fi
