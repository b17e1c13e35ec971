"""mkdocs hooks (mkdocs.yml): bring README.md (as the home page), LICENSE, benchmarks/README.md and the
benchmark results (benchmarks/results/, pages outside the nav) into the site, and rewrite every relative
link to its file's place in the site, so the Markdown's links stay right where it is read on disk
(README's ``docs/guide.md``, a page's ``../benchmarks/results/...``) and resolve in the site too. A link
to a file that is in neither place is left as written, for mkdocs' strict build to report."""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File, InclusionLevel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "benchmarks/results"
# repository path -> site path: the home page, then the benchmark files at their repository paths
EXTRA = {
    "README.md": "index.md",
    "LICENSE": "LICENSE",
    "benchmarks/README.md": "benchmarks/README.md",
    **{
        f"{RESULTS}/{name}": f"{RESULTS}/{name}"
        for name in sorted(os.listdir(os.path.join(ROOT, RESULTS)))
        if name.endswith((".md", ".json", ".png"))
    },
}
LINK = re.compile(r"(\]\()([^)\s]+)(\))")


def on_files(files, config):
    for repo_path, site_path in EXTRA.items():
        # The benchmark pages are reached from docs/benchmarks.md, not from the nav.
        inclusion = InclusionLevel.UNDEFINED if repo_path == "README.md" else InclusionLevel.NOT_IN_NAV
        path = os.path.join(ROOT, repo_path)
        files.append(File.generated(config, site_path, abs_src_path=path, inclusion=inclusion))
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
