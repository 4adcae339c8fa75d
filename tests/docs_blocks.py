"""Fenced code blocks of the documentation pages, for the tests that run them as written.

The docs are Markdown under ``docs/`` (plus the repository's ``README.md``). A test reads a page,
optionally narrows it to one heading's section, and takes its fenced blocks of one language;
each block knows the ``<!-- ... -->`` marker on the line before its fence (``not-run: <reason>``
or ``run-by: <test file>``), so that ``tests/user/test_docs_snippets.py`` can check that every
``python`` block is either executed or says why not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not-run|run-by)\s*:\s*(?P<text>.*?)\s*-->\s*$")
_HEADING = re.compile(r"^(?P<hashes>#{1,6})\s+(?P<title>.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its page (relative to the repository), first line number, language,
    code, and the marker on the line before its fence (kind ``not-run``/``run-by`` and text)."""

    page: str
    line: int
    language: str
    code: str
    marker: str | None = None
    marker_text: str = ""

    @property
    def first_line(self) -> str:
        """The block's first non-empty line: how a test names a block it prepares for."""
        return next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def page_text(page: str) -> str:
    """The Markdown of ``page``: a path under ``docs/`` (``"mismatch.md"``) or ``"README.md"``."""
    path = ROOT / page if page == "README.md" else DOCS / page
    return path.read_text(encoding="utf-8")


def pages() -> list[str]:
    """Every documentation page: ``README.md`` and the Markdown files under ``docs/``, sorted."""
    return ["README.md", *sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))]


def section(text: str, title: str) -> str:
    """The part of ``text`` under the heading ``title`` (any level, outside code blocks) up to
    the next heading of the same or a higher level; the heading line included."""
    lines = text.splitlines(keepends=True)
    start = level = None
    fence: str | None = None
    for i, line in enumerate(lines):
        fenced = _FENCE.match(line.rstrip("\n"))
        if fenced:
            mark = fenced.group("fence")
            if fence is None:
                fence = mark
            elif mark.startswith(fence) and not fenced.group("info").strip():
                fence = None
            continue
        heading = None if fence else _HEADING.match(line.rstrip("\n"))
        if heading is None:
            continue
        depth = len(heading.group("hashes"))
        if start is None and heading.group("title") == title:
            start, level = i, depth
        elif start is not None and level is not None and depth <= level:
            return "".join(lines[start:i])
    if start is None:
        raise KeyError(f"no heading {title!r}")
    return "".join(lines[start:])


def blocks(text: str, language: str | None = None, page: str = "") -> list[Block]:
    """The fenced blocks of ``text`` (of ``language`` when given), in order, with markers."""
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        fence, info = opened.group("fence"), opened.group("info").strip()
        lang = info.split()[0] if info else ""
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if closing and closing.group("fence").startswith(fence) and not closing.group("info").strip():
                break
            body.append(lines[j])
            j += 1
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        if language is None or lang == language:
            found.append(Block(page, i + 1, lang, "\n".join(body) + "\n",
                               marker.group("kind") if marker else None,
                               marker.group("text") if marker else ""))
        i = j + 1
    return found


def page_blocks(page: str, language: str | None = None, heading: str | None = None) -> list[Block]:
    """The blocks of one page (of ``language``; under ``heading`` when given)."""
    text = page_text(page)
    if heading is not None:
        part = section(text, heading)
        offset = text.index(part)
        found = blocks(part, language, page)
        lines_before = text[:offset].count("\n")
        return [Block(b.page, b.line + lines_before, b.language, b.code, b.marker, b.marker_text) for b in found]
    return blocks(text, language, page)


def first_block(page: str, language: str, heading: str | None = None) -> str:
    """The code of the first ``language`` block of ``page`` (under ``heading`` when given)."""
    found = page_blocks(page, language, heading)
    assert found, f"{page}{' § ' + heading if heading else ''} has no {language} block"
    return found[0].code
