"""The benchmark tree: one entry point per group, result files named by the convention and each
linked from docs/benchmarks.md, no run-by-run files and no benchmark log at the repository root."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
GROUPS = ["suite", "scale", "recovery", "gpu", "phases", "micro", "overlap", "hosts", "incremental"]
#: <benchmark>_<hardware>_<yyyymmdd>.<ext>
NAME = re.compile(r"^[a-z0-9_]+_[a-z0-9]+_\d{8}\.(md|json|png)$")
#: Files in results/ that are not one run's result.
NOT_RESULTS = {"README.md"}
#: A name that records one run among several: BEFORE/AFTER, RUN2, PARTS1.
RUN_BY_RUN = re.compile(r"BEFORE|AFTER|RUN\d|PARTS\d", re.I)


@pytest.mark.parametrize("args", [[g, "--help"] for g in GROUPS] + [["suite", "--storage", "s3", "--help"]], ids=str)
def test_group_entry_point_parses_help(args):
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{args[0]}", *args[1:]],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "usage:" in done.stdout


@pytest.mark.parametrize(
    ("group", "command"),
    [
        ("recovery", "restart"),
        ("recovery", "memory-cost"),
        ("overlap", "stall"),
        ("overlap", "step"),
        ("hosts", "cut"),
        ("hosts", "restore"),
    ],
)
def test_sub_commands_parse_help(group, command):
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{group}", command, "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr


def test_each_group_is_a_package_with_a_main():
    for group in GROUPS:
        assert (BENCH / group / "__init__.py").is_file(), group
        assert (BENCH / group / "__main__.py").is_file(), group


def result_files() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.is_file() and p.name not in NOT_RESULTS)


def test_result_names_follow_the_convention():
    files = result_files()
    assert files
    assert [p.name for p in files if not NAME.match(p.name)] == []


def test_every_result_file_is_linked_from_the_docs():
    docs = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(\.\./benchmarks/results/([^)#\s]+)", docs))
    assert [p.name for p in result_files() if p.name not in linked] == []


def test_result_markdown_names_its_command_and_machine():
    for path in result_files():
        if path.suffix != ".md":
            continue
        head = path.read_text(encoding="utf-8")[:3000]
        assert "python" in head and "-m benchmarks." in head, path.name
        assert "CPUs" in head, path.name


def test_no_run_by_run_files_under_benchmarks():
    names = [p.relative_to(BENCH).as_posix() for p in BENCH.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert [n for n in names if RUN_BY_RUN.search(Path(n).name)] == []


def test_no_benchmark_log_at_the_root():
    assert sorted(p.name for p in ROOT.glob("BENCHMARKS*")) == []
