"""MkDocs hook: repository files shown as pages, one copy each.

The README is the site's home page (its links into ``docs/`` made relative to
the site); BENCHMARKS.md (with its chart), which ``make bench`` writes, and
CHANGELOG.md are pages as they are.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
# site path -> repository file
_FROM_REPO = {
    "benchmarks.md": "BENCHMARKS.md",
    "changelog.md": "CHANGELOG.md",
    "benchmarks/charts/provider_view.png": "benchmarks/charts/provider_view.png",
}
# README links as the site sees them: docs/x.md -> x.md, the repository's
# Markdown files -> their pages, the examples' READMEs stay in the repository.
_README_LINKS = [
    (re.compile(r"\]\(docs/"), "]("),
    (re.compile(r"\]\(BENCHMARKS\.md\)"), "](benchmarks.md)"),
    (re.compile(r"\]\(CHANGELOG\.md\)"), "](changelog.md)"),
    (re.compile(r"\[its README\]\((examples/[^)]+)\)"), r"its README, `\1`"),
]


def home_page() -> str:
    """The README with its links rewritten for the site."""
    text = (ROOT / "README.md").read_text("utf-8")
    for pattern, replacement in _README_LINKS:
        text = pattern.sub(replacement, text)
    return text


def on_files(files: Files, config: Any, **_: Any) -> Files:
    """Add the home page and the repository files under their site paths."""
    files.append(File.generated(config, "index.md", content=home_page()))
    for uri, source in _FROM_REPO.items():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / source)))
    return files
