"""mkdocs hooks (mkdocs.yml): bring README.md and the benchmark results from the repository
root into the site, and rewrite every relative link to its file's place in the site, so the
Markdown's links stay right where it is read on disk (README's ``docs/guide.md``, a page's
``../BENCHMARKS.md``) and resolve in the site too. A link to a file that is in neither place is
left as written, for mkdocs' strict build to report."""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# repository path -> site path
EXTRA = {
    "README.md": "index.md",
    "BENCHMARKS.md": "BENCHMARKS.md",
    "BENCHMARKS-4GB.md": "BENCHMARKS-4GB.md",
    "benchmarks/bench_scale_issue15.png": "benchmarks/bench_scale_issue15.png",
    "benchmarks/bench_scale_issue15_after.png": "benchmarks/bench_scale_issue15_after.png",
}
LINK = re.compile(r"(\]\()([^)\s]+)(\))")


def on_files(files, config):
    for repo_path, site_path in EXTRA.items():
        files.append(File.generated(config, site_path, abs_src_path=os.path.join(ROOT, repo_path)))
    return files


def site_path(repo_path: str, docs_dir: str) -> str | None:
    """Where the file at ``repo_path`` (relative to the repository) is in the site, if it is."""
    if repo_path in EXTRA:
        return EXTRA[repo_path]
    docs = os.path.relpath(docs_dir, ROOT)
    if repo_path.startswith(docs + "/"):
        return repo_path[len(docs) + 1 :]
    return None


def on_page_markdown(markdown, page, config, files):
    src = os.path.relpath(page.file.abs_src_path, ROOT)
    here = os.path.dirname(page.file.src_uri)

    def rewrite(m: re.Match) -> str:
        target, _, anchor = m.group(2).partition("#")
        if not target or "://" in target or target.startswith(("/", "mailto:")):
            return m.group(0)
        found = site_path(os.path.normpath(os.path.join(os.path.dirname(src), target)), config["docs_dir"])
        if found is None:
            return m.group(0)
        new = os.path.relpath(found, here or ".") + (f"#{anchor}" if anchor else "")
        return m.group(1) + new + m.group(3)

    return LINK.sub(rewrite, markdown)
