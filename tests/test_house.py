"""The house by concern (docs/design.md): each folder of the package sits on one floor, and
imports run one way, down. Read from the source's import statements; nothing is run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "orbax_maxtext_layout"
DESIGN = PACKAGE.parent / "docs" / "design.md"

# Floor of each folder, lowest first. A module may import its own folder and any lower
# floor, never a folder on its own floor or above.
FLOORS = {
    "base": 0,
    "storage": 1,
    "orbax_io": 2,
    "model": 3,
    "plan": 4,
    "execute": 5,
    "lora": 6,
    "hf": 7,
    "integration": 8,
}
GROUND = {"errors", "_version"}  # top-level modules every floor may import
ROOF = {"__init__", "__main__", "cli", "training", "maxtext", "paths"}  # the faces, on top
ROOF_FLOOR = 9
MAX_TOP = 8  # modules at the top of the package
MAX_IN_FOLDER = 12


def _room(module: str) -> str:
    """The folder (or top-level module) a dotted module name inside the package lives in."""
    return module.split(".")[0]


def _floor(room: str) -> int:
    if room in GROUND:
        return -1
    if room in ROOF:
        return ROOF_FLOOR
    return FLOORS[room]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        if rel.parts[0] == "examples":
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts) or "__init__"] = path
    return out


def imports_of(module: str, path: Path) -> set[str]:
    """The package's own modules (dotted, relative to the package) that ``module`` imports,
    at any depth in the file (lazy imports inside functions count too)."""
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if module != "__init__" else []
    base = here if is_pkg else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = [*anchor, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == PACKAGE.name:
                target = node.module.split(".")[1:]
            else:
                continue
            names = [a.name for a in node.names]
            sub = [".".join([*target, n]) for n in names]
            found.update(s for s in sub if s in MODULES) or found.add(".".join(target))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == PACKAGE.name and "." in a.name:
                    found.add(a.name.split(".", 1)[1])
    return {f or "__init__" for f in found}


MODULES = _modules()


def _edges() -> list[tuple[str, str]]:
    return [(m, t) for m, p in MODULES.items() for t in imports_of(m, p) if t != m]


def upward_or_mutual(edges: list[tuple[str, str]]) -> list[str]:
    """Every import that goes up a floor or sideways between two folders, and every pair of
    rooms that import each other, as readable lines (empty when the house stands)."""
    bad = []
    rooms = set()
    for m, t in edges:
        a, b = _room(m), _room(t)
        if a == b:
            continue
        rooms.add((a, b))
        if a in ROOF and b in ROOF:
            continue  # the faces may use each other; a cycle among them is caught below
        if _floor(b) >= _floor(a) and a not in GROUND:
            bad.append(f"{m} (floor {_floor(a)}) imports {t} (floor {_floor(b)})")
        elif a in GROUND:
            bad.append(f"{m} is on the ground floor and imports {t}")
    bad += [f"{a} and {b} import each other" for a, b in sorted(rooms) if a < b and (b, a) in rooms]
    return bad


def test_every_folder_has_a_floor_and_says_what_it_owns() -> None:
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")} - {"examples", "cli"}
    assert folders == set(FLOORS)
    for folder in [*FLOORS, "cli"]:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc and "imports" in doc.lower(), f"{folder}/__init__.py must say what it may import"


def test_imports_run_one_way_down_the_floors() -> None:
    assert upward_or_mutual(_edges()) == []


def test_the_check_sees_an_import_upward_and_a_pair_importing_each_other() -> None:
    # the same check on edges with one import added upward: it must name it
    assert upward_or_mutual([("storage.store", "plan.moves")]) == [
        "storage.store (floor 1) imports plan.moves (floor 4)"
    ]
    assert "hf and integration import each other" in upward_or_mutual(
        [("hf.export_hf", "integration.handler"), ("integration.handler", "hf.export_hf")]
    )
    assert upward_or_mutual([("hf.export_hf", "integration.handler")]) == [
        "hf.export_hf (floor 7) imports integration.handler (floor 8)"
    ]
    assert upward_or_mutual([("errors", "storage.store")]) == [
        "errors is on the ground floor and imports storage.store"
    ]


def test_the_import_reader_sees_relative_absolute_and_lazy_imports() -> None:
    path = PACKAGE / "execute" / "convert.py"
    found = imports_of("execute.convert", path)
    assert {"execute.restore", "plan.step_plan", "storage.store", "errors"} <= found


def test_rooms_stay_small() -> None:
    top = [p for p in PACKAGE.glob("*.py")]
    assert len(top) <= MAX_TOP, sorted(p.name for p in top)
    for folder in [*FLOORS, "cli"]:
        inside = [p for p in (PACKAGE / folder).glob("*.py") if p.name != "__init__.py"]
        assert len(inside) <= MAX_IN_FOLDER, (folder, sorted(p.name for p in inside))


def test_design_md_writes_down_the_same_order() -> None:
    text = DESIGN.read_text()
    order = re.search(r"Import order: `([^`]+)`", text)
    assert order, "docs/design.md must state the import order as: Import order: `...`"
    written = [f.strip() for f in order.group(1).split("<-")]
    floors = sorted({*FLOORS.values()})
    expected = [" | ".join(sorted(r for r, f in FLOORS.items() if f == fl)) for fl in floors]
    assert written == ["errors", *expected, "cli"], written


@pytest.mark.parametrize("room", sorted(FLOORS))
def test_each_folder_is_named_in_the_map_of_the_house(room: str) -> None:
    assert f"`{room}/`" in DESIGN.read_text()


# The op classes themselves (and the interface they share) are the only modules that name an
# op; every other module asks a move's op (issue 59: callers never branch on which op it is).
OP_CLASSES = {"plan.moves", "plan.ops", "lora.merge_op"}


def test_no_module_but_the_op_classes_names_an_op() -> None:
    named = {
        m: re.findall(r"\bOp\.[A-Z_]+\b", p.read_text())
        for m, p in MODULES.items()
        if m not in OP_CLASSES
    }
    assert {m: n for m, n in named.items() if n} == {}
