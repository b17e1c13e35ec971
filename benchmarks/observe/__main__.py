"""``python -m benchmarks.observe COMMAND``: what an operator watches, timed."""

from benchmarks.common.cli import run_group

if __name__ == "__main__":
    raise SystemExit(run_group("observe"))
