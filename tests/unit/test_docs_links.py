"""The README's relative links name files and headings that exist (``mkdocs build --strict``
checks the links inside ``docs/``; the README is outside the site)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _relative_links(markdown: str) -> list[str]:
    return [t for t in _LINK.findall(_FENCE.sub("", markdown)) if not re.match(r"[a-z]+:", t)]


def _anchors(page: Path) -> set[str]:
    """The ids Python-Markdown's toc extension gives the page's headings (code spans unwrapped)."""
    from markdown.extensions.toc import slugify

    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slugify(h.replace("`", ""), "-") for h in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def test_the_readme_links_into_the_docs() -> None:
    links = _relative_links((ROOT / "README.md").read_text(encoding="utf-8"))
    assert any(t.startswith("docs/") for t in links), "the README no longer points into docs/"


@pytest.mark.parametrize("target", _relative_links((ROOT / "README.md").read_text(encoding="utf-8")))
def test_every_relative_link_of_the_readme_resolves(target: str) -> None:
    path, _, anchor = target.partition("#")
    page = ROOT / path if path else ROOT / "README.md"
    assert page.exists(), f"README.md links to {path}, which is not there"
    if anchor and page.suffix == ".md":
        assert anchor in _anchors(page), f"{path} has no heading whose id is {anchor!r}"


def test_the_anchor_ids_follow_the_toc_extension() -> None:
    """A broken slug rule would pass every link above vacuously; pin it on a heading with code."""
    page = ROOT / "docs" / "architecture.md"
    assert "split-reads-read-policy-split-beyond-the-paper" in _anchors(page)
