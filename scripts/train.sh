#!/usr/bin/env bash
# Set up (if needed) and run the main job: a GPT-style LM trained with FSDP2 on Ray
# Train (local Ray, 4 CPU workers), checkpointed by rayckpt. Extra args go to
# jobs/train.py. Without --run-name each call starts a new run (gpt-<time>), after
# removing the older runs named that way beyond the RAYCKPT_KEEP_RUNS (default 3,
# 0: keep all) most recent ones, the new one included, from a local storage path;
# each run keeps its last 3 checkpoints (~1 GB at the default model size).
set -euo pipefail
cd "$(dirname "$0")/.."
args=("$@")
if [[ " $* " != *" --run-name "* && " $* " != *" --run-name="* ]]; then
  keep=${RAYCKPT_KEEP_RUNS:-3}
  if [[ ! "$keep" =~ ^[0-9]+$ ]]; then
    echo "scripts/train.sh: RAYCKPT_KEEP_RUNS must be a whole number (0 keeps every run), got '$keep'" >&2
    exit 2
  fi
  storage=./checkpoints
  for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
      --storage-path) storage=${args[i + 1]:-$storage} ;;
      --storage-path=*) storage=${args[i]#--storage-path=} ;;
    esac
  done
  if [[ "$storage" != *://* && "$keep" != 0 ]]; then
    bash scripts/prune_runs.sh "$storage" "$((keep - 1))"  # room for the new run
  fi
  args+=(--run-name "gpt-$(date +%Y%m%d-%H%M%S)")
fi
bash scripts/setup.sh
exec .venv/bin/python jobs/train.py "${args[@]}"
