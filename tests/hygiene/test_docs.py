"""The docs: the site builds in strict mode (a broken link, a missing page or an API name the
docstrings no longer have fails it), and every relative link in README.md and docs/ resolves
to a file and, with an anchor, to a heading of it, as a reader on disk or on GitHub follows it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def test_site_builds_in_strict_mode(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # No -q: it drops the warnings, and then strict mode has none to count.
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml")]
    done = subprocess.run(
        [*build, "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    api = (tmp_path / "api" / "ray" / "index.html").read_text(encoding="utf-8")
    assert "save_async" in api and "Checkpointer" in api


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (what mkdocs' toc makes too for the headings used here)."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, re.M)}


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if "://" not in t and not t.startswith("mailto:")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for link in relative_links(page):
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, broken


def test_readme_stays_short():
    assert (ROOT / "README.md").stat().st_size < 15_000


#: The longest line of prose a page may have: longer ones are unreadable in a diff or a terminal.
PROSE_LIMIT = 200
TABLE_ROW = re.compile(r"^\s*\|")
HEADING = re.compile(r"^#{1,6} ")
LINK_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s")
FENCE_LINE = re.compile(r"^\s*(```|~~~)")


def long_prose_lines(text: str, limit: int = PROSE_LIMIT) -> list[int]:
    """The line numbers of ``text``'s prose lines longer than ``limit`` characters. Not prose, so not
    counted: code blocks (between fences), table rows, headings and link-reference definitions."""
    long, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        opened = FENCE_LINE.match(line)
        if fence is not None:
            if opened and opened.group(1) == fence:
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        if TABLE_ROW.match(line) or HEADING.match(line) or LINK_REFERENCE.match(line):
            continue
        if len(line) > limit:
            long.append(number)
    return long


PROSE_PAGES = [*PAGES, ROOT / "benchmarks" / "README.md"]


@pytest.mark.parametrize("page", PROSE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_prose_line_is_too_long(page):
    long = long_prose_lines(page.read_text(encoding="utf-8"))
    assert not long, f"{page.relative_to(ROOT)}: lines {long} are over {PROSE_LIMIT} characters: wrap them"


def test_the_prose_check_sees_a_long_line():
    long = "word " * 50
    assert long_prose_lines(f"short\n{long}\n") == [2]
    assert long_prose_lines(f"- an item\n  {long}\n") == [2]
    # Code, tables, headings and link references may run long.
    assert long_prose_lines(f"```\n{long}\n```\n~~~python\n{long}\n~~~\n") == []
    assert long_prose_lines(f"| a | {long} |\n# {long}\n[ref]: https://example.com/{'x' * 250}\n") == []
    # A fence of the other kind does not close a block; the line after the closing fence counts again.
    assert long_prose_lines(f"```\n~~~\n{long}\n```\n{long}\n") == [5]


def test_architecture_page_is_read_in_one_sitting():
    assert (ROOT / "docs" / "architecture.md").stat().st_size <= 10_240
