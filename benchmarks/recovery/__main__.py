"""``python -m benchmarks.recovery COMMAND``: recovery under Ray Train and the memory tier's cost."""

from benchmarks.common.cli import run_group

raise SystemExit(run_group("recovery"))
