"""The user documentation is self-contained: relative links resolve, and nothing cites team-internal notes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", path.read_text(), flags=re.MULTILINE)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(doc):
    for target, anchor in LINK.findall(doc.read_text()):
        if "://" in target:
            continue
        path = (doc.parent / target).resolve()
        assert path.exists(), f"{doc.name}: broken link {target}"
        if anchor and path.suffix == ".md":
            assert anchor[1:] in _anchors(path), f"{doc.name}: no heading for {target}{anchor}"


def test_no_reference_to_team_internal_notes():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    texts = [f for f in files if f.endswith((".py", ".yaml", ".md", ".toml", "Makefile"))
             and not f.startswith("benchmarks/results/") and f != "tests/test_docs.py"]
    hits = [f for f in texts if "DESIGN" in (ROOT / f).read_text(encoding="utf-8", errors="replace")]
    assert not hits, f"files citing the internal design notes: {hits}"
    for doc in (ROOT / "docs").glob("*.md"):
        assert "../shared" not in doc.read_text(), doc.name
