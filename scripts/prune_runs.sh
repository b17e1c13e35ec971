#!/usr/bin/env bash
# Usage: prune_runs.sh DIR KEEP
# Remove all but the KEEP most recently used runs that scripts/train.sh named itself:
# the gpt-YYYYmmdd-HHMMSS directories of DIR, newest modification time first (a run
# that saved or resumed lately counts as recent). Runs given another name and
# anything else in DIR are left alone.
set -euo pipefail
dir=$1
keep=$2
if [[ ! "$keep" =~ ^[0-9]+$ ]]; then
  echo "prune_runs.sh: KEEP must be a whole number, got '$keep'" >&2
  exit 2
fi
[[ -d "$dir" ]] || exit 0
named=()
for run in "$dir"/gpt-*; do
  if [[ -d "$run" && "${run##*/}" =~ ^gpt-[0-9]{8}-[0-9]{6}$ ]]; then
    named+=("$run")
  fi
done
((${#named[@]} > keep)) || exit 0
mtime() { stat -c %Y -- "$1" 2>/dev/null || stat -f %m -- "$1"; }  # GNU, else BSD stat
seen=0
# Newest first; runs used in the same second by name (their start time), newest first.
for run in "${named[@]}"; do
  printf '%s\t%s\n' "$(mtime "$run")" "$run"
done | sort -t "$(printf '\t')" -k1,1nr -k2,2r | cut -f2- | while IFS= read -r run; do
  seen=$((seen + 1))
  if ((seen > keep)); then
    echo "scripts/train.sh: removing old run $run (keeping the most recent ones; RAYCKPT_KEEP_RUNS=0 keeps all)" >&2
    rm -rf -- "$run"
  fi
done
