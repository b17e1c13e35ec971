"""The command lines of the benchmark groups: one ``python -m benchmarks.<group>`` each, a group
with several measurements naming one as a sub-command. A sub-command's module is imported only
when it runs, so ``--help`` stays quick."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable

#: Where a run writes by default: under ``bench_out/`` (ignored by git). A run the docs cite is
#: copied to ``benchmarks/results/`` by hand (benchmarks/README.md).
OUT = "bench_out"

#: Each group with sub-commands, and its sub-commands: ``benchmarks.<group>.<command>`` (``-`` as ``_``) each.
GROUPS = {"hosts": ("cut", "restore"), "micro": ("plan",), "observe": ("status",)}
GROUPS |= {"overlap": ("stall", "step"), "recovery": ("restart", "memory-cost")}


def first_line(module: str) -> str:
    """The first sentence of ``module``'s docstring, read without importing it (``--help`` stays quick)."""
    spec = importlib.util.find_spec(module)
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return " ".join(doc.split()).split(". ")[0].split(": ")[0]


def run_group(group: str, argv: list[str] | None = None) -> int:
    """Parse ``COMMAND [ARGS...]`` for ``python -m benchmarks.<group>`` and run its module's ``main(ARGS)``."""
    prog = f"python -m benchmarks.{group}"
    commands = {name: f"benchmarks.{group}.{name.replace('-', '_')}" for name in GROUPS[group]}
    width = max(len(name) for name in commands)
    epilog = "commands:\n" + "\n".join(f"  {name:<{width}}  {first_line(m)}" for name, m in commands.items())
    epilog += f"\n\n{prog} COMMAND --help shows a command's options."
    description = first_line(f"benchmarks.{group}")
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, formatter_class=formatter)
    parser.add_argument("command", choices=list(commands), metavar="COMMAND", help=", ".join(commands))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's options")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return importlib.import_module(commands[args.command]).main(args.args) or 0


def parser(doc: str | None, out: str, *, markdown: bool = False, ray_logs: bool = False) -> argparse.ArgumentParser:
    """A benchmark's options: ``doc`` (its module's docstring) as the description, ``--out`` (default
    ``bench_out/<out>``), and where asked ``--markdown`` and ``--ray-logs``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=f"{OUT}/{out}", help="directory for the report's .json and .md")
    if markdown:
        p.add_argument("--markdown", default=None, help="also write the Markdown here")
    if ray_logs:
        p.add_argument("--ray-logs", action="store_true", help="forward the workers' output to this terminal")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p``'s options from ``argv``, ``--out`` made an absolute path (workers run elsewhere) and created."""
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    return args


def listed(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """An option's type: comma-separated names, each one of ``choices``."""
    known = tuple(choices)

    def names(text: str) -> list[str]:
        found = [s.strip() for s in text.split(",") if s.strip()]
        if not found or any(s not in known for s in found):
            raise argparse.ArgumentTypeError(f"{text!r}: expected some of {', '.join(known)}, comma-separated")
        return found

    return names
