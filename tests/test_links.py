"""Every relative link in README.md and docs/*.md resolves: the file exists, and an ``#anchor``
is a heading of the target page as GitHub names it.

GitHub's anchor of a heading: its text as rendered (code spans and emphasis marks dropped, a
link replaced by its text), lower-cased, every character that is not a letter, digit, ``_``,
``-`` or space removed, each space turned into ``-``; a name already taken on the page gets
``-1``, ``-2``, ... Links inside code (fenced blocks, code spans) are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", flags=re.DOTALL)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a fenced line reads as empty)."""
    lines: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
            lines.append("")
        else:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    text = CODE_SPAN.sub(lambda match: match.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link reads as its text
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)  # emphasis marks
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def heading_anchors(text: str) -> list[str]:
    """The anchors of a page's headings, in order, duplicates numbered as GitHub numbers them."""
    anchors: list[str] = []
    seen: set[str] = set()
    for line in prose_lines(text):
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        anchor, n = base, 0
        while anchor in seen:
            n += 1
            anchor = f"{base}-{n}"
        seen.add(anchor)
        anchors.append(anchor)
    return anchors


def relative_links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of each link to a path of this repository (no scheme)."""
    found: list[tuple[int, str]] = []
    for number, line in enumerate(prose_lines(text), start=1):
        line = CODE_SPAN.sub("", line)
        for target in INLINE_LINK.findall(line):
            if not SCHEME.match(target) and not target.startswith("//"):
                found.append((number, target))
    return found


def broken_links(page: Path) -> list[str]:
    """Why each relative link of ``page`` does not resolve, as ``page:line: target: reason``."""
    problems: list[str] = []
    for number, target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        where = f"{page.name}:{number}: {target}"
        if not resolved.exists():
            problems.append(f"{where}: no such file")
        elif anchor:
            if resolved.is_dir() or resolved.suffix != ".md":
                problems.append(f"{where}: an anchor into something that is not a page")
            elif anchor not in heading_anchors(resolved.read_text()):
                problems.append(f"{where}: no heading with that anchor in {resolved.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_docs_link_to_each_other() -> None:
    """The check has links to check: the README reaches every guide."""
    linked = {
        (ROOT / target.partition("#")[0]).resolve()
        for _, target in relative_links(PAGES[0].read_text())
    }
    assert set(PAGES[1:]) <= linked, sorted(p.name for p in set(PAGES[1:]) - linked)


def test_anchors_are_named_as_github_names_them() -> None:
    text = "\n".join(
        [
            "# Intel GPUs (`scanners.intel_gpu`)",
            "## Start-up and readiness (`Type=notify`)",
            "## Start -> first list",
            "## Peak memory, 10,000 GPUs",
            "### `devplug scan`",
            "## Notes",
            "## Notes",
            "## A [linked](x.md) **bold** heading ##",
            "```",
            "# not a heading",
            "```",
        ]
    )
    assert heading_anchors(text) == [
        "intel-gpus-scannersintel_gpu",
        "start-up-and-readiness-typenotify",
        "start---first-list",
        "peak-memory-10000-gpus",
        "devplug-scan",
        "notes",
        "notes-1",
        "a-linked-bold-heading",
    ]


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    """The check fails on each kind of broken link, and passes the good ones beside them."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Set up `it`\n\ntext\n")
    page = tmp_path / "README.md"
    page.write_text(
        "\n".join(
            [
                "# Page",
                "[good](docs/guide.md) [good anchor](docs/guide.md#set-up-it) [here](#page)",
                "[web](https://example.com/x#y) `[code](nowhere.md)`",
                "```",
                "[fenced](nowhere.md)",
                "```",
                "[gone](docs/missing.md)",
                "[bad anchor](docs/guide.md#setup)",
                "[bad own anchor](#nothing)",
                "[dir anchor](docs#x)",
            ]
        )
    )
    assert broken_links(page) == [
        "README.md:7: docs/missing.md: no such file",
        "README.md:8: docs/guide.md#setup: no heading with that anchor in guide.md",
        "README.md:9: #nothing: no heading with that anchor in README.md",
        "README.md:10: docs#x: an anchor into something that is not a page",
    ]
