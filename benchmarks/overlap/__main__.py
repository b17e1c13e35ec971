"""``python -m benchmarks.overlap COMMAND``: saves beside training, the save call's stall and the step time."""

from benchmarks.common.cli import run_group

raise SystemExit(run_group("overlap"))
