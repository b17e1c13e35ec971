"""``python -m benchmarks.hosts COMMAND``: the memory tier and recovery on Ray nodes that are hosts of their own."""

from benchmarks.common.cli import run_group

raise SystemExit(run_group("hosts"))
