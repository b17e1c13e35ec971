#!/usr/bin/env bash
# Set up (if needed) and run the main job: a GPT-style LM trained with FSDP2 on Ray
# Train (local Ray, 4 CPU workers), checkpointed by rayckpt. Extra args go to
# jobs/train.py; without --run-name each call starts a new run (gpt-<time>).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=("$@")
if [[ " $* " != *" --run-name "* ]]; then
  args+=(--run-name "gpt-$(date +%Y%m%d-%H%M%S)")
fi
exec .venv/bin/python jobs/train.py "${args[@]}"
