"""The ``rayckpt`` command: look into, verify, plan, convert and clean up checkpoints without a cluster; export
the Grafana dashboard and Prometheus alert rules of rayckpt's metrics (``cli.dashboard``); ``status``: a running
cluster's checkpoints (``cli.status``).

Thin: parses arguments, calls ``rayckpt.tools`` / ``rayckpt.convert`` and prints
what they return, as text or (``--json``) as JSON whose fields are those of the
returned dataclasses (``docs/CLI.md``). Errors are one line on stderr:

- exit 0: success (``verify``: every check passed);
- exit 1: the checkpoint is corrupt, ``verify`` found problems, a conversion failed, ``rm`` was
  refused (a save in flight) or declined, or a file could not be written;
- exit 2: bad arguments, a missing path, a path that is not a checkpoint, an unknown key.

Any other exception (a bug) is one line too, exit 1; ``--debug`` prints the
traceback of any error.

Start-up stays short: ``rayckpt.tools`` is imported by the command that runs,
and only ``inspect --tensor`` and ``convert`` import torch; only ``status`` imports Ray.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence

from .. import __version__
from ..errors import CheckpointNotFoundError, RayckptError
from ..redaction import redact, redact_text
from . import dashboard, status
from .text import (
    ProgressBar,
    UsageError,
    count,
    human_bytes,
    jsonable,
    parse_size,
    positive_int,
    print_json,
    short,
    table,
    when,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


# ---------------------------------------------------------------------------
# Commands


def _cmd_ls(args: argparse.Namespace) -> int:
    from .. import tools

    entries = tools.ls(args.storage_path, run=args.run)
    if args.json:
        print_json(list(entries))
        return EXIT_OK
    if not entries:
        print(f"no checkpoints under {redact(args.storage_path)}")
        return EXIT_OK
    rows = [["RUN", "STEP", "STATUS", "CREATED", "RANKS", "SIZE", "PATH"]]
    for e in entries:
        step = "-" if e.step is None else str(e.step)
        ranks = str(e.world_size) if e.world_size else "-"
        rows.append([e.run, step, e.status, when(e.created), ranks, human_bytes(e.bytes), redact(e.path)])
    print(table(rows))
    return EXIT_OK


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .. import tools

    if args.tensor is not None:
        s = tools.tensor_summary(args.checkpoint, args.tensor)
        if args.json:
            print_json(s)
            return EXIT_OK
        stats = (
            [("min", s.min), ("max", s.max), ("mean", s.mean), ("norm", s.norm)] if s.numel else [("values", "empty")]
        )
        rows = [["key", s.key], ["dtype", s.dtype], ["shape", f"{list(s.shape)} ({s.numel} elements)"]]
        rows += [[name, f"{v:.6g}" if isinstance(v, float) else str(v)] for name, v in stats]
        first = ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in s.first)
        rows.append(["first", f"[{first}{', ...' if s.numel > len(s.first) else ''}]"])
        print(table(rows))
        return EXIT_OK
    info = tools.inspect(args.checkpoint)
    if args.json:
        print_json(info)
        return EXIT_OK
    payload = sum(t.nbytes for t in info.tensors)
    print(
        table(
            [
                ["checkpoint", info.path],
                ["saved", f"{when(info.created)} by {count(info.world_size, 'rank')}, save {info.save_id}"],
                ["format", f"rayckpt v{info.version}, {info.checksum} per {human_bytes(info.block_size)} block"],
                [
                    "size",
                    f"{count(len(info.tensors), 'tensor')} ({human_bytes(payload)}), "
                    f"{count(len(info.values), 'value')}, {count(len(info.files), 'file')} "
                    f"({human_bytes(info.total_bytes)})",
                ],
                ["metadata", json.dumps(info.user_metadata)],
            ]
            + (
                [
                    [
                        "shared",
                        f"{human_bytes(info.bytes_shared)} from earlier saves, "
                        f"{human_bytes(info.bytes_written)} written",
                    ]
                ]
                if info.bytes_shared
                else []
            )
        )
    )
    if info.tensors:
        print()
        rows = [["KEY", "DTYPE", "SHAPE", "CHUNKS", "SIZE"]]
        rows += [[t.key, t.dtype, str(list(t.shape)), str(t.num_chunks), human_bytes(t.nbytes)] for t in info.tensors]
        print(table(rows))
    if info.values:
        print()
        print(table([["VALUE", ""]] + [[v.key, short(v.decoded)] for v in info.values]))
    print()
    rows = [["FILE", "RANK", "SIZE"]] + [[f.path, str(f.rank), human_bytes(f.size)] for f in info.files]
    print(table(rows))
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from .. import tools

    bar = ProgressBar("verifying")
    try:
        report = tools.verify(args.checkpoint, on_progress=bar)
    finally:
        bar.close()
    if args.json:
        print_json(report)
    else:
        counts = (
            f"{count(report.files_checked, 'file')}, {count(report.chunks_checked, 'chunk')}, "
            f"{human_bytes(report.bytes_checked)} read"
        )
        for p in report.problems:
            print(f"{p.kind:<9} {p.message}")
        if report.ok:
            print(f"ok: {report.path}: {counts}; every checksum matches, chunks tile every tensor exactly once")
        else:
            print(f"FAILED: {report.path}: {count(len(report.problems), 'problem')}; {counts}")
    return EXIT_OK if report.ok else EXIT_FAILED


def _cmd_plan(args: argparse.Namespace) -> int:
    from .. import tools

    p = tools.plan(args.checkpoint, args.world_size)
    if args.json:
        print_json(p)
        return EXIT_OK
    print(
        f"reshard plan: {p.path}, saved by {count(p.saved_world_size, 'rank')}, "
        f"loaded by {count(p.world_size, 'rank')} (dim-0 sharding)"
    )
    rows = [["RANK", "NEEDED", "READ", "READS", "FILES"]]
    for r in p.ranks:
        rows.append(
            [str(r.rank), human_bytes(r.bytes_needed), human_bytes(r.bytes_read), str(r.reads), str(len(r.files))]
        )
    print(table(rows))
    print(
        f"total: needed {human_bytes(p.bytes_needed)}, read {human_bytes(p.bytes_read)}; "
        f"read amplification {p.read_amplification:.3f}; balance {p.balance:.3f} (mean/max bytes per rank)"
    )
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    from ..tools.convert.core import convert

    fmt = args.to or args.from_
    bar = ProgressBar(f"converting ({'to' if args.to else 'from'} {fmt})")
    try:
        info = convert(
            args.src,
            args.dst,
            to=args.to,
            from_=args.from_,
            prefix=args.prefix,
            max_shard_bytes=args.max_shard_size,
            on_progress=bar,
        )
    finally:
        bar.close()
    if args.json:
        print_json(info)
        return EXIT_OK
    tensors = f"{count(info.tensors, 'tensor')} ({human_bytes(info.bytes)})"
    values = count(info.values, "value")
    if info.format == "safetensors" and info.direction == "to" and info.values:
        values = f"{values} left out (safetensors holds tensors only)"
    what = f"{tensors}, {values}, {count(len(info.files), 'file')}"
    if info.direction == "to":
        print(f"wrote {info.format} {redact(info.dst)}: {what}")
    else:
        print(f"imported {info.format} {redact(info.src)} as rayckpt checkpoint {redact(info.dst)}: {what}")
    return EXIT_OK


def _cmd_gc(args: argparse.Namespace) -> int:
    from .. import tools

    report = tools.gc(args.path, dry_run=args.dry_run)
    if args.json:
        print_json({**jsonable(report), "bytes_removed": report.bytes_removed})
        return EXIT_OK
    verb = "would remove" if report.dry_run else "removed"
    dirs = f"{report.directories} checkpoint director{'y' if report.directories == 1 else 'ies'}"
    print(
        f"{verb} {count(len(report.removed), 'file')} ({human_bytes(report.bytes_removed)}) under {report.path} "
        f"({dirs} looked at)"
    )
    for f in report.removed:
        print(f"  {f.path}  {human_bytes(f.bytes)}  {f.why}")
    if report.live_saves:
        print(f"kept the files of {count(len(report.live_saves), 'save')} in flight: {', '.join(report.live_saves)}")
    for why in report.skipped:
        print(f"skipped {why}")
    return EXIT_OK


def _cmd_rm(args: argparse.Namespace) -> int:
    from .. import tools

    if not args.yes:
        plan = tools.remove(args.checkpoint, dry_run=True)
        if not sys.stdin.isatty():
            raise UsageError(f"not removing {plan.path}: no terminal to confirm on; pass --yes to remove it")
        sys.stderr.write(
            f"remove checkpoint {plan.path} (save {plan.save_id}, {count(len(plan.files), 'file')}, "
            f"{human_bytes(plan.bytes)})? [y/N] "
        )
        sys.stderr.flush()
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            print("rayckpt: nothing removed", file=sys.stderr)
            return EXIT_FAILED
    report = tools.remove(args.checkpoint)
    if args.json:
        print_json(report)
    else:
        print(
            f"removed {report.path}: save {report.save_id}, {count(len(report.files), 'file')} "
            f"({human_bytes(report.bytes)})"
        )
        if report.store.removed:
            freed = sum(size for _, size in report.store.removed)
            gone = count(len(report.store.removed), "shared file")
            print(f"removed {gone} no checkpoint names now ({human_bytes(freed)})")
    return EXIT_OK


class _HelpFormatter(argparse.HelpFormatter):
    """Appends an option's default to its help when it has one worth showing (not None, False or "")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or not action.option_strings or default is None or default is False:
            return text
        if default == "" or default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def _convert_arguments(p: _Parser) -> None:
    """``rayckpt convert``'s arguments."""
    p.add_argument("src", metavar="SRC", help="a rayckpt checkpoint (--to) or the file/directory to import (--from)")
    p.add_argument("dst", metavar="DST", help="must not exist yet (an empty directory is fine)")
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=("torch", "dcp", "safetensors"), help="export the rayckpt checkpoint SRC")
    way.add_argument("--from", dest="from_", choices=("torch", "dcp", "safetensors"), help="import SRC")
    p.add_argument(
        "--prefix", default="", help="export: keep only keys under it, stripped; import: prepend it (none: all keys)"
    )
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        default="5GB",
        metavar="SIZE",
        help="largest safetensors file written by --to safetensors",
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def _parser() -> _Parser:
    parser = _Parser(
        prog="rayckpt",
        description="Look into, verify, plan, convert and remove rayckpt checkpoints (no cluster needed); "
        "see a running cluster's (status).",
        epilog="Exit status: 0 ok, 1 corrupt checkpoint / verify problems / failed conversion / rm refused or "
        "declined / file not written / no cluster or no rayckpt on it (status) / internal error, 2 usage error. "
        "`rayckpt COMMAND --help` describes a command.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rayckpt {__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, help="what to do")

    def command(name: str, summary: str) -> _Parser:
        return sub.add_parser(
            name, help=summary, description=summary[0].upper() + summary[1:] + ".", formatter_class=_HelpFormatter
        )

    p = command("ls", "list the checkpoints under a storage path")
    p.add_argument("storage_path", metavar="STORAGE_PATH", help="<storage_path>/<run>/rayckpt-step-N, as Ray Train")
    p.add_argument("--run", metavar="NAME", help="only the run NAME")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_ls)

    p = command("inspect", "show the keys, dtypes, shapes, chunks and files of a checkpoint")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URI")
    p.add_argument("--tensor", metavar="KEY", help="assemble tensor KEY from its shards and summarize it")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_inspect)

    p = command("verify", "read every byte and check checksums, coverage and files")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URI")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_verify)

    p = command("plan", "show what loading into M ranks reads, per rank (no workers run)")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URI")
    p.add_argument("--world-size", "-n", metavar="M", type=positive_int, required=True, help="ranks that load")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_plan)

    p = command("convert", "convert a checkpoint to or from torch.save, DCP and safetensors")
    _convert_arguments(p)
    p.set_defaults(func=_cmd_convert)

    p = command("gc", "remove shard files no manifest names and no live save owns")
    p.add_argument("path", metavar="PATH", help="a checkpoint directory, or a run directory of them")
    p.add_argument("--dry-run", action="store_true", help="remove nothing; print what would be removed")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_gc)

    p = command("rm", "remove a committed checkpoint directory (never one a save is writing)")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URI")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask; needed when stdin is not a terminal")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_rm)

    p = command("status", "show a running cluster's checkpoints: newest per tier, in flight, failures, restores")
    status.add_arguments(p)
    p.set_defaults(func=status.cmd_status)

    p = command("dashboard", "the Grafana dashboard and Prometheus alert rules of rayckpt's metrics")
    actions = dashboard.add_actions(p, _HelpFormatter)
    for p in [*sub.choices.values(), *actions]:  # also after it: `rayckpt verify CKPT --debug`
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _one_line(message: object) -> str:
    """A multi-line message on one line: "a:\n  b\n  c" becomes "a: b; c"."""
    out = ""
    for line in (line.strip() for line in str(message).strip().splitlines()):
        if line:
            out += ("" if not out else " " if out.endswith(":") else "; ") + line
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``rayckpt`` command; return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    caught: BaseException
    try:
        args = _parser().parse_args(argv)
        return args.func(args)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    except KeyboardInterrupt:
        print("rayckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except (UsageError, CheckpointNotFoundError, ValueError) as exc:
        caught, error, code = exc, exc, EXIT_USAGE
    except FileNotFoundError as exc:
        caught, error, code = exc, f"{exc.filename or exc}: no such file or directory", EXIT_USAGE
    except (RayckptError, OSError) as exc:
        caught, error, code = exc, exc, EXIT_FAILED
    except Exception as exc:  # noqa: BLE001 - a bug: still one line, the traceback with --debug
        caught, code = exc, EXIT_FAILED
        error = f"internal error ({type(exc).__name__}: {exc}); run again with --debug for the traceback"
    if "--debug" in argv:
        traceback.print_exception(caught, file=sys.stderr)
    print(f"rayckpt: error: {redact_text(_one_line(error))}", file=sys.stderr)
    return code
