"""MkDocs hook: a page line ``<!-- include: PATH -->`` (PATH from the repository root) is
replaced by that file, so the deployment guides kept beside their manifests under ``deploy/``
are pages of the site too, with one source.

A relative link in an included file would resolve against ``docs/``, not against the file's own
folder, and fail ``mkdocs build --strict``; it is written as its text and the repository path
it names instead. Headings and code are left as they are.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_INCLUDE = re.compile(r"^<!-- include: (\S+) -->$", re.MULTILINE)
_RELATIVE_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\((?![a-z]+:|#)([^)\s]+)\)")


def included(path: Path) -> str:
    """The text of ``path`` with its relative links spelled out as repository paths.

    Raises FileNotFoundError when the file is not there (the build then fails, as it should).
    """
    text = path.read_text(encoding="utf-8")
    folder = path.parent.relative_to(ROOT)

    def spell_out(link: re.Match[str]) -> str:
        target = posixpath.normpath((folder / link.group(2)).as_posix())
        return f"{link.group(1)} (`{target}`)"

    return _RELATIVE_LINK.sub(spell_out, text)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs calls this with each page's Markdown before rendering it."""
    return _INCLUDE.sub(lambda m: included(ROOT / m.group(1)), markdown)
