"""The benchmark tree: one entry point per group, result files named by the convention and each
linked from docs/benchmarks.md, no run-by-run files and no benchmark log at the repository root."""

from __future__ import annotations

import json
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


#: Every ``python -m benchmarks.<group> ... --help`` the tests check.
HELP_CALLS = (
    [[g, "--help"] for g in GROUPS]
    + [["suite", "--storage", "s3", "--help"]]
    + [
        [group, command, "--help"]
        for group, command in [
            ("recovery", "restart"),
            ("recovery", "memory-cost"),
            ("overlap", "stall"),
            ("overlap", "step"),
            ("hosts", "cut"),
            ("hosts", "restore"),
        ]
    ]
)
#: Runs each call as ``python -m`` does (``runpy``, ``sys.argv`` set), in one process: torch and Ray are
#: imported once, not once per call. Prints one JSON line: per call, its exit code and its output.
HELP_RUNNER = """
import contextlib, io, json, runpy, sys
results = []
for args in json.loads(sys.argv[1]):
    out = io.StringIO()
    sys.argv = [f"benchmarks/{args[0]}", *args[1:]]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_module(f"benchmarks.{args[0]}", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException as exc:
            code, _ = 1, out.write(f"{type(exc).__name__}: {exc}")
    results.append([code, out.getvalue()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[int, str]]:
    """Each of ``HELP_CALLS`` (by its arguments joined): its exit code and its output."""
    done = subprocess.run(
        [sys.executable, "-c", HELP_RUNNER, json.dumps(HELP_CALLS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    return {" ".join(args): (code, out) for args, (code, out) in zip(HELP_CALLS, results)}


@pytest.mark.parametrize("args", [" ".join(a) for a in HELP_CALLS])
def test_entry_point_parses_help(helps, args):
    code, out = helps[args]
    assert code == 0, out
    assert "usage:" in out, out


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
