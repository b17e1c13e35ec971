"""``python -m benchmarks.observe COMMAND``: what an operator watches, timed."""

from benchmarks.common.cli import run_group

raise SystemExit(run_group("observe"))
