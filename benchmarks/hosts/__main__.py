"""``python -m benchmarks.hosts COMMAND``: the memory tier and recovery on Ray nodes that are hosts of their own."""

from __future__ import annotations

from benchmarks.common.cli import run_command

COMMANDS = {
    "replicas": (
        "benchmarks.hosts.replicas",
        "a replica from one host to another: over the writers' link against through Ray's object store",
    ),
    "cut": (
        "benchmarks.hosts.cut",
        "an elastic job's host cut off: the time to the restored group, Ray's default health checks and tuned ones",
    ),
    "restore": (
        "benchmarks.hosts.restore",
        "a state held by three hosts' memory tier against one on the S3 host: the time its ranks take to load it",
    ),
}


def main(argv: list[str] | None = None) -> int:
    return run_command("python -m benchmarks.hosts", __doc__.split("\n")[0].split(": ", 1)[1], COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
