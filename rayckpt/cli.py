"""The ``rayckpt`` command: look into, verify, plan, convert and clean up checkpoints without a cluster.

Thin: parses arguments, calls ``rayckpt.tools`` / ``rayckpt.convert`` and prints
what they return, as text or (``--json``) as JSON whose fields are those of the
returned dataclasses (``docs/CLI.md``). Errors are one line on stderr:

- exit 0: success (``verify``: every check passed);
- exit 1: the checkpoint is corrupt, ``verify`` found problems, or a conversion failed;
- exit 2: bad arguments, a missing path, a path that is not a checkpoint, an unknown key.

Any other exception (a bug) is one line too, exit 1; ``--debug`` prints the
traceback of any error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, TextIO

from . import __version__, tools
from .errors import CheckpointNotFoundError, RayckptError
from .tools import verification

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad command-line arguments (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


class ProgressBar:
    """A one-line progress bar on stderr, drawn only when that stream is a terminal."""

    def __init__(self, label: str, stream: TextIO | None = None, min_interval: float = 0.1) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.min_interval = min_interval
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < self.min_interval:
            return
        self._last = now
        frac = done / total if total else 1.0
        filled = int(frac * 30)
        bar = "#" * filled + "." * (30 - filled)
        self.stream.write(f"\r{self.label} [{bar}] {frac:4.0%} {human_bytes(done)} / {human_bytes(total)}")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(i)?)?B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``5GB`` (10**9), ``500MiB`` (2**20), ``1024`` (bytes)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    number, prefix, binary = float(match.group(1)), (match.group(2) or "").upper(), match.group(3)
    power = " KMGT".index(prefix) if prefix else 0
    value = int(number * (1024 if binary else 1000) ** power)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _jsonable(obj: Any) -> Any:
    """Dataclasses as dicts; non-finite floats as the strings "nan", "inf", "-inf" (strict JSON)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    return obj


def _print_json(obj: Any) -> None:
    print(json.dumps(_jsonable(obj), indent=2, allow_nan=False))


def _when(created: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) if created else "-"
    except (OverflowError, OSError, ValueError):  # a time no calendar shows (a damaged manifest)
        return f"{created:g} s"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _short(value: Any, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------
# Commands


def _cmd_ls(args: argparse.Namespace) -> int:
    entries = tools.ls(args.storage_path, run=args.run)
    if args.json:
        _print_json(list(entries))
        return EXIT_OK
    if not entries:
        print(f"no checkpoints under {args.storage_path}")
        return EXIT_OK
    rows = [["RUN", "STEP", "STATUS", "CREATED", "RANKS", "SIZE", "PATH"]]
    for e in entries:
        step = "-" if e.step is None else str(e.step)
        ranks = str(e.world_size) if e.world_size else "-"
        rows.append([e.run, step, e.status, _when(e.created), ranks, human_bytes(e.bytes), e.path])
    print(_table(rows))
    return EXIT_OK


def _cmd_inspect(args: argparse.Namespace) -> int:
    if args.tensor is not None:
        s = tools.tensor_summary(args.checkpoint, args.tensor)
        if args.json:
            _print_json(s)
            return EXIT_OK
        stats = (
            [("min", s.min), ("max", s.max), ("mean", s.mean), ("norm", s.norm)] if s.numel else [("values", "empty")]
        )
        rows = [["key", s.key], ["dtype", s.dtype], ["shape", f"{list(s.shape)} ({s.numel} elements)"]]
        rows += [[name, f"{v:.6g}" if isinstance(v, float) else str(v)] for name, v in stats]
        first = ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in s.first)
        rows.append(["first", f"[{first}{', ...' if s.numel > len(s.first) else ''}]"])
        print(_table(rows))
        return EXIT_OK
    info = tools.inspect(args.checkpoint)
    if args.json:
        _print_json(info)
        return EXIT_OK
    payload = sum(t.nbytes for t in info.tensors)
    print(
        _table(
            [
                ["checkpoint", info.path],
                ["saved", f"{_when(info.created)} by {_count(info.world_size, 'rank')}, save {info.save_id}"],
                ["format", f"rayckpt v{info.version}, {info.checksum} per {human_bytes(info.block_size)} block"],
                [
                    "size",
                    f"{_count(len(info.tensors), 'tensor')} ({human_bytes(payload)}), "
                    f"{_count(len(info.values), 'value')}, {_count(len(info.files), 'file')} "
                    f"({human_bytes(info.total_bytes)})",
                ],
                ["metadata", json.dumps(info.user_metadata)],
            ]
        )
    )
    if info.tensors:
        print()
        rows = [["KEY", "DTYPE", "SHAPE", "CHUNKS", "SIZE"]]
        rows += [[t.key, t.dtype, str(list(t.shape)), str(t.num_chunks), human_bytes(t.nbytes)] for t in info.tensors]
        print(_table(rows))
    if info.values:
        print()
        print(_table([["VALUE", ""]] + [[v.key, _short(v.decoded)] for v in info.values]))
    print()
    rows = [["FILE", "RANK", "SIZE"]] + [[f.path, str(f.rank), human_bytes(f.size)] for f in info.files]
    print(_table(rows))
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    bar = ProgressBar("verifying")
    try:
        report = verification.verify(args.checkpoint, on_progress=bar)
    finally:
        bar.close()
    if args.json:
        _print_json(report)
    else:
        counts = (
            f"{_count(report.files_checked, 'file')}, {_count(report.chunks_checked, 'chunk')}, "
            f"{human_bytes(report.bytes_checked)} read"
        )
        for p in report.problems:
            print(f"{p.kind:<9} {p.message}")
        if report.ok:
            print(f"ok: {report.path}: {counts}; every checksum matches, chunks tile every tensor exactly once")
        else:
            print(f"FAILED: {report.path}: {_count(len(report.problems), 'problem')}; {counts}")
    return EXIT_OK if report.ok else EXIT_FAILED


def _cmd_plan(args: argparse.Namespace) -> int:
    p = tools.plan(args.checkpoint, args.world_size)
    if args.json:
        _print_json(p)
        return EXIT_OK
    print(
        f"reshard plan: {p.path}, saved by {_count(p.saved_world_size, 'rank')}, "
        f"loaded by {_count(p.world_size, 'rank')} (dim-0 sharding)"
    )
    rows = [["RANK", "NEEDED", "READ", "READS", "FILES"]]
    for r in p.ranks:
        rows.append(
            [str(r.rank), human_bytes(r.bytes_needed), human_bytes(r.bytes_read), str(r.reads), str(len(r.files))]
        )
    print(_table(rows))
    print(
        f"total: needed {human_bytes(p.bytes_needed)}, read {human_bytes(p.bytes_read)}; "
        f"read amplification {p.read_amplification:.3f}; balance {p.balance:.3f} (mean/max bytes per rank)"
    )
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    from .tools.convert.core import convert

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
        _print_json(info)
        return EXIT_OK
    tensors = f"{_count(info.tensors, 'tensor')} ({human_bytes(info.bytes)})"
    values = _count(info.values, "value")
    if info.format == "safetensors" and info.direction == "to" and info.values:
        values = f"{values} left out (safetensors holds tensors only)"
    what = f"{tensors}, {values}, {_count(len(info.files), 'file')}"
    if info.direction == "to":
        print(f"wrote {info.format} {info.dst}: {what}")
    else:
        print(f"imported {info.format} {info.src} as rayckpt checkpoint {info.dst}: {what}")
    return EXIT_OK


def _cmd_gc(args: argparse.Namespace) -> int:
    from .tools.gc import gc

    report = gc(args.path, dry_run=args.dry_run)
    if args.json:
        _print_json({**_jsonable(report), "bytes_removed": report.bytes_removed})
        return EXIT_OK
    verb = "would remove" if report.dry_run else "removed"
    dirs = f"{report.directories} checkpoint director{'y' if report.directories == 1 else 'ies'}"
    print(
        f"{verb} {_count(len(report.removed), 'file')} ({human_bytes(report.bytes_removed)}) under {report.path} "
        f"({dirs} looked at)"
    )
    for f in report.removed:
        print(f"  {f.path}  {human_bytes(f.bytes)}  {f.why}")
    if report.live_saves:
        print(f"kept the files of {_count(len(report.live_saves), 'save')} in flight: {', '.join(report.live_saves)}")
    for why in report.skipped:
        print(f"skipped {why}")
    return EXIT_OK


def _parser() -> _Parser:
    parser = _Parser(
        prog="rayckpt",
        description="Look into, verify, plan and convert rayckpt checkpoints (no cluster needed).",
        epilog="Exit status: 0 ok, 1 corrupt checkpoint / verify problems / failed conversion / internal error, "
        "2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"rayckpt {__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("ls", help="list the checkpoints under a storage path")
    p.add_argument("storage_path", metavar="STORAGE_PATH", help="<storage_path>/<run>/rayckpt-step-N, as Ray Train")
    p.add_argument("--run", metavar="NAME", help="only the run NAME")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("inspect", help="keys, dtypes, shapes, chunks and files of a checkpoint")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URI")
    p.add_argument("--tensor", metavar="KEY", help="assemble tensor KEY from its shards and summarize it")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", help="read every byte and check checksums, coverage and files")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URI")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("plan", help="what loading into M ranks reads, per rank (no workers run)")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or URI")
    p.add_argument("--world-size", "-n", metavar="M", type=_positive_int, required=True, help="ranks that load")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("convert", help="to or from torch.save, DCP and safetensors")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST", help="must not exist yet (an empty directory is fine)")
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=("torch", "dcp", "safetensors"), help="export the rayckpt checkpoint SRC")
    way.add_argument("--from", dest="from_", choices=("torch", "dcp", "safetensors"), help="import SRC")
    p.add_argument("--prefix", default="", help="export: keep keys under it, stripped; import: prepend it")
    p.add_argument(
        "--max-shard-size", type=parse_size, default="5GB", metavar="SIZE", help="safetensors file size (5GB)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("gc", help="remove shard files no manifest names and no live save owns")
    p.add_argument("path", metavar="PATH", help="a checkpoint directory, or a run directory of them")
    p.add_argument("--dry-run", action="store_true", help="remove nothing; print what would be removed")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_gc)
    for p in sub.choices.values():  # also after the command: `rayckpt verify CKPT --debug`
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
        caught, error, status = exc, exc, EXIT_USAGE
    except FileNotFoundError as exc:
        caught, error, status = exc, f"{exc.filename or exc}: no such file or directory", EXIT_USAGE
    except (RayckptError, OSError) as exc:
        caught, error, status = exc, exc, EXIT_FAILED
    except Exception as exc:  # noqa: BLE001 - a bug: still one line, the traceback with --debug
        caught, status = exc, EXIT_FAILED
        error = f"internal error ({type(exc).__name__}: {exc}); run again with --debug for the traceback"
    if "--debug" in argv:
        traceback.print_exception(caught, file=sys.stderr)
    print(f"rayckpt: error: {_one_line(error)}", file=sys.stderr)
    return status
