"""``python -m benchmarks.overlap COMMAND``: saves beside training, the save call's stall and the step time."""

from __future__ import annotations

from benchmarks.common.cli import run_command

COMMANDS = {
    "stall": (
        "benchmarks.overlap.stall",
        "the time the save call blocks: a bare copy, DCP async_save, rayckpt with and without overlap; 1 and 4 ranks",
    ),
    "step": (
        "benchmarks.overlap.step",
        "a training loop's step time with a save every step and every 10: none, copy, DCP, the memory tier",
    ),
}


def main(argv: list[str] | None = None) -> int:
    return run_command("python -m benchmarks.overlap", __doc__.split("\n")[0].split(": ", 1)[1], COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
