"""The command lines of the benchmark groups: one ``python -m benchmarks.<group>`` each, a group
with several measurements naming one as a sub-command. A sub-command's module is imported only
when it runs, so ``--help`` stays quick."""

from __future__ import annotations

import argparse
import importlib
import sys

#: Where a run writes by default: under ``bench_out/`` (ignored by git). A run the docs cite is
#: copied to ``benchmarks/results/`` by hand (benchmarks/README.md).
OUT = "bench_out"


def run_command(prog: str, description: str, commands: dict[str, tuple[str, str]], argv: list[str] | None) -> int:
    """Parse ``COMMAND [ARGS...]`` and run ``commands[COMMAND]``'s module's ``main(ARGS)``."""
    width = max(len(name) for name in commands)
    epilog = "commands:\n" + "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in commands.items())
    epilog += f"\n\n{prog} COMMAND --help shows a command's options."
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=list(commands), metavar="COMMAND", help=", ".join(commands))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's options")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    module = importlib.import_module(commands[args.command][0])
    return module.main(args.args) or 0
