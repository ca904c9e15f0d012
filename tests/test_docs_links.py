"""Every relative link in README.md and docs/*.md resolves: the file exists inside the
repository, and a ``#anchor`` names a heading of the target page (GitHub's slug).

External links (any ``scheme:``, e.g. http, https, mailto) are not checked. Links inside
fenced code blocks and inline code spans are not links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line.lstrip())
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (link targets dropped), lower case, every
    character but letters, digits, ``_``, ``-`` and spaces removed, spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated slug gets ``-1``, ``-2``, ... as on GitHub."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _prose_lines(page.read_text()):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in the page's prose."""
    out = []
    for n, line in _prose_lines(page.read_text()):
        if m := _REF_DEF.match(line):
            out.append((n, m.group(1)))
            continue
        prose = _CODE_SPAN.sub("code", line)
        out += [(n, m.group(1)) for m in _INLINE_LINK.finditer(prose)]
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of ``page`` that does not resolve, with the reason."""
    problems = []
    for n, target in links(page):
        where = f"{page.relative_to(root).as_posix()}:{n}: {target}"
        if _SCHEME.match(target):
            continue  # external
        path, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path)).resolve() if path else page.resolve()
        if not target:
            problems.append(f"{where}: empty link")
        elif not dest.is_relative_to(root.resolve()):
            problems.append(f"{where}: leads outside the repository")
        elif not dest.exists():
            problems.append(f"{where}: no such file")
        elif anchor:
            if dest.suffix != ".md" or not dest.is_file():
                problems.append(f"{where}: an anchor into a file that is not a markdown page")
            elif anchor not in anchors(dest):
                problems.append(f"{where}: no heading with the anchor #{anchor} in {dest.name}")
    return problems


def test_slug_is_githubs():
    assert slug("How `convert` writes") == "how-convert-writes"
    assert slug("Object stores (`gs://`)") == "object-stores-gs"
    assert slug("MaxText 0.2.5: the runner") == "maxtext-025-the-runner"
    assert slug("The v1 `training.Checkpointer`") == "the-v1-trainingcheckpointer"
    assert slug("Quick start (fresh machine)") == "quick-start-fresh-machine"
    assert slug("merge-lora") == "merge-lora"
    assert slug("See [the API](api.md) now") == "see-the-api-now"


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B page\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# A\n\n## Local `part`\n\n"
        "[ok](docs/b.md) [ok](docs/b.md#b-page) [ok](docs/b.md#twice-1) [ok](#local-part)\n"
        "[ext](https://example.com/x.md#nowhere) [mail](mailto:a@b.c) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n"
        "[bad file](docs/c.md) [bad anchor](docs/b.md#nowhere) [bad local](#nowhere)\n"
        "![bad image](img.png) [outside](../x.md)\n"
        "[ref]: docs/missing.md\n"
    )
    problems = broken_links(page, root=tmp_path)
    got = [p.split(": ", 1)[1] for p in problems]
    assert got == [
        "docs/c.md: no such file",
        "docs/b.md#nowhere: no heading with the anchor #nowhere in b.md",
        "#nowhere: no heading with the anchor #nowhere in README.md",
        "img.png: no such file",
        "../x.md: leads outside the repository",
        "docs/missing.md: no such file",
    ], problems


def test_every_docs_page_is_checked():
    assert {p.name for p in PAGES} >= {"README.md", "cli.md", "api.md", "reliability.md"}
    assert links(ROOT / "README.md"), "the README links to its docs pages"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page):
    assert not broken_links(page), "\n".join(broken_links(page))
