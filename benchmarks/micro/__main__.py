"""``python -m benchmarks.micro COMMAND``: focused runs of one piece of rayckpt each."""

from __future__ import annotations

from benchmarks.common.cli import run_command

COMMANDS = {
    "engine": ("benchmarks.micro.engine", "in-process save and load against DCP, page cache evicted; --profile"),
    "ray-save": ("benchmarks.micro.ray_save", "the Ray save path alone: staging buffer, object store, DCP, in process"),
    "plan": ("benchmarks.micro.plan", "load planning at scale, no I/O: bulk planner, one rank, per-rank planner"),
    "root-plan": ("benchmarks.micro.root_plan", "a load's planning without Ray: rank 0's plan, the slices, one rank"),
    "save-plan": ("benchmarks.micro.save_plan", "save planning: time and the bytes each rank sends and receives"),
    "validate": ("benchmarks.micro.validate", "manifest validation, create and read at scale"),
}


def main(argv: list[str] | None = None) -> int:
    return run_command("python -m benchmarks.micro", __doc__.split("\n")[0].split(": ", 1)[1], COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
