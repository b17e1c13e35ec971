"""``python -m benchmarks.overlap COMMAND``: saves beside training, the save call's stall and the step time."""

from benchmarks.common.cli import run_group

if __name__ == "__main__":
    raise SystemExit(run_group("overlap"))
