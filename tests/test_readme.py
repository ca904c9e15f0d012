"""The Python examples of the README and of every page under docs/ run as written.

Each ```python block runs on its own, in a fresh namespace: a block never depends on an
earlier one, so each can be copied alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


BLOCKS = [
    (_name(page), i, code)
    for page in PAGES
    for i, code in enumerate(FENCE.findall(page.read_text()))
]


def test_readme_has_python_examples():
    assert [b for b in BLOCKS if b[0] == "README.md"]


def test_docs_pages_have_python_examples():
    """The examples moved out of the README still run here (guards the block finder)."""
    names = {b[0] for b in BLOCKS}
    assert {"docs/api.md", "docs/maxtext-loop.md", "docs/scan.md", "docs/lora.md"} <= names


@pytest.mark.parametrize(
    ("page", "i", "code"), BLOCKS, ids=[f"{page}-block{i}" for page, i, _ in BLOCKS]
)
def test_python_block_runs(page, i, code):
    exec(compile(code, f"{page}[python block {i}]", "exec"), {"__name__": "__readme__"})
