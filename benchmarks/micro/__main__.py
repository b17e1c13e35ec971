"""``python -m benchmarks.micro COMMAND``: focused runs of one piece of rayckpt each."""

from benchmarks.common.cli import run_group

raise SystemExit(run_group("micro"))
