"""``python -m benchmarks.recovery COMMAND``: recovery under Ray Train and the memory tier's cost."""

from __future__ import annotations

from benchmarks.common.cli import run_command

COMMANDS = {
    "restart": (
        "benchmarks.recovery.restart",
        "a worker SIGKILLed or a node removed: each phase from the kill to the first step after the restore",
    ),
    "memory-cost": (
        "benchmarks.recovery.memory_cost",
        "a memory checkpoint every step against no checkpoint and a bare copy; a restore from each tier",
    ),
}


def main(argv: list[str] | None = None) -> int:
    return run_command("python -m benchmarks.recovery", __doc__.split("\n")[0].split(": ", 1)[1], COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
