"""How the ``rayckpt`` command shows things (sizes, tables, times, JSON, a progress bar) and reads them (sizes,
counts; ``UsageError``: a bad argument, exit 2).

Standard library only, so ``rayckpt --help`` starts in a blink. The progress bar
is hand-written rather than tqdm's: it is some thirty lines, and tqdm is not a
dependency of rayckpt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from typing import Any, TextIO

from ..redaction import redact_text


class UsageError(Exception):
    """Bad command-line arguments (exit 2)."""


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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def jsonable(obj: Any) -> Any:
    """Dataclasses as dicts; non-finite floats as the strings "nan", "inf", "-inf" (strict JSON);
    strings with a location's secrets redacted (``s3://KEY:***@...``)."""
    if isinstance(obj, str):
        return redact_text(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    return obj


def print_json(obj: Any) -> None:
    print(json.dumps(jsonable(obj), indent=2, allow_nan=False))


def when(created: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) if created else "-"
    except (OverflowError, OSError, ValueError):  # a time no calendar shows (a damaged manifest)
        return f"{created:g} s"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def short(value: Any, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
