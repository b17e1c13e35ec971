"""``python -m benchmarks.observe COMMAND``: what an operator watches, timed."""

from __future__ import annotations

from benchmarks.common.cli import run_command

COMMANDS = {
    "status": (
        "benchmarks.observe.status",
        "`rayckpt status` against `ray status`, each a fresh process asking one local cluster",
    ),
}


def main(argv: list[str] | None = None) -> int:
    return run_command("python -m benchmarks.observe", __doc__.split("\n")[0].split(": ", 1)[1], COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
