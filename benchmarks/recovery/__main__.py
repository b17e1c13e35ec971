"""``python -m benchmarks.recovery COMMAND``: recovery under Ray Train and the memory tier's cost."""

from benchmarks.common.cli import run_group

if __name__ == "__main__":
    raise SystemExit(run_group("recovery"))
