"""benchmarks/ stays small: one harness and one set of system adapters, not a copy per benchmark."""

from __future__ import annotations

from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
#: The most lines of Python benchmarks/ may hold.
LIMIT = 5_000
#: Where benchmarks/ stands today: it may shrink, never grow past it.
CEILING = 4_997


def python_lines() -> int:
    return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in BENCH.rglob("*.py"))


def test_benchmarks_do_not_grow():
    assert python_lines() <= CEILING


def test_benchmarks_stay_under_the_limit():
    assert python_lines() <= LIMIT
