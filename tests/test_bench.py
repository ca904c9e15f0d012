"""The bench cannot rot quietly (issue 59): every ``bench/*.py`` is in the smoke run's table
(bench/smoke.py, run by .ci/run), no bench script reaches into the package but through
bench/_internal.py, and every internal that file names still exists. Nothing is run here:
the smoke run runs the scripts."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PUBLIC = {"orbax_maxtext_layout", "orbax_maxtext_layout.training", "orbax_maxtext_layout.maxtext"}


@pytest.fixture(scope="module")
def bench_modules():
    """bench/smoke.py and bench/_internal.py, imported from bench/ (standard library at their
    tops; _internal imports the package only when asked)."""
    sys.path.insert(0, str(BENCH))
    try:
        import _internal
        import smoke

        yield smoke, _internal
    finally:
        sys.path.remove(str(BENCH))


def _package_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import of the package in ``path`` (any depth)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("orbax_maxtext"):
            out.append((node.lineno, node.module or "", [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("orbax_")]
    return out


def test_every_bench_file_is_in_the_smoke_table(bench_modules):
    smoke, _ = bench_modules
    files = sorted(p.name for p in BENCH.glob("*.py"))
    assert sorted(smoke.SCRIPTS) == files, "add the new file to bench/smoke.py's SCRIPTS"
    for name, entry in smoke.SCRIPTS.items():
        if isinstance(entry, smoke.Script):
            assert entry.venv in ("core", "maxtext"), name
            entry.argv.format(t="T", shared="S")  # only the two placeholders


def test_bench_reaches_internals_only_through_one_module():
    offenders = [
        f"bench/{p.name}:{line}: {module}"
        for p in sorted(BENCH.glob("*.py"))
        if p.name != "_internal.py"
        for line, module, _names in _package_imports(p)
        if module not in PUBLIC
    ]
    assert not offenders, f"import these through bench/_internal.py: {offenders}"


def test_internal_surface_is_listed_and_exists(bench_modules):
    """Every import in bench/_internal.py is in its SURFACE, and every SURFACE name exists in
    this package: a rename fails here, naming what moved."""
    _, internal = bench_modules
    for _line, module, names in _package_imports(BENCH / "_internal.py"):
        listed = set(internal.SURFACE.get(module, ()))
        # a name is listed, or is a module listed itself (``from pkg.room import module``)
        missing = [n for n in names if n not in listed and f"{module}.{n}" not in internal.SURFACE]
        assert not missing, (module, missing)
    assert internal.check() == []
