#!/usr/bin/env bash
# Create .venv and install rayckpt with its test tools, every package at the version
# pinned in requirements/lock.txt (regenerate it with scripts/lock.sh). Idempotent:
# re-runs install only when pyproject.toml, the lock or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
lock=requirements/lock.txt
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
