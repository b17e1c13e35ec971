"""``python -m benchmarks.hosts COMMAND``: the memory tier and recovery on Ray nodes that are hosts of their own."""

from benchmarks.common.cli import run_group

if __name__ == "__main__":
    raise SystemExit(run_group("hosts"))
