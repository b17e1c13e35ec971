"""``python -m benchmarks.micro COMMAND``: focused runs of one piece of rayckpt each."""

from benchmarks.common.cli import run_group

if __name__ == "__main__":
    raise SystemExit(run_group("micro"))
