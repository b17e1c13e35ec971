"""``python -m benchmarks.micro COMMAND``: focused runs of one piece of rayckpt each."""

from __future__ import annotations

from benchmarks.common.cli import run_command

COMMANDS = {
    "plan": ("benchmarks.micro.plan", "load planning at scale, no I/O: bulk planner, one rank, per-rank planner"),
}


def main(argv: list[str] | None = None) -> int:
    return run_command("python -m benchmarks.micro", __doc__.split("\n")[0].split(": ", 1)[1], COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
