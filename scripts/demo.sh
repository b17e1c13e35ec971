#!/usr/bin/env bash
# Set up (if needed) and run the main job. Extra args go to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python jobs/demo.py "$@"
