"""The package's shape: no import cycles (lazy imports included), public names only in the
README, the docs pages and the tests, and the few private Orbax names we rely on pinned."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import orbax.checkpoint as ocp

import orbax_maxtext_layout as oml

PKG = Path(oml.__file__).parent
ROOT = PKG.parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts) or "__init__"


def _imports(path: Path, mods: set[str]) -> set[str]:
    """Package modules (dotted, relative to the package) ``path`` imports anywhere (module
    level, functions, TYPE_CHECKING); a folder's name counts as its ``__init__``."""
    me = _module_name(path)
    here = [] if me == "__init__" else me.split(".")
    base = here if path.name == "__init__.py" else here[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                mod = [*base[: len(base) - node.level + 1], *(node.module or "").split(".")]
            elif (node.module or "").split(".")[0] == "orbax_maxtext_layout":
                mod = node.module.split(".")[1:]
            else:
                continue
            mod = [m for m in mod if m]
            named = {".".join([*mod, a.name]) for a in node.names} & mods  # modules imported
            out |= named or ({".".join(mod) or "__init__"} & mods)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("orbax_maxtext_layout."):
                    out |= {a.name.split(".", 1)[1]} & mods
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py") if "examples" not in p.parts}
    mods = set(files)
    return {m: {d for d in _imports(p, mods) if d != m} for m, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_between_package_modules():
    graph = _graph()
    want = {"plan.step_plan", "plan.moves", "execute.write", "execute.verify", "execute.restore"}
    assert want <= set(graph)
    assert "plan.moves" in graph["plan.step_plan"]  # relative imports are read
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    # Only the package's own __init__ may import the package as a whole.
    assert not [m for m, deps in graph.items() if "__init__" in deps and m != "__init__"]


def test_readme_tests_and_bench_use_public_names_only():
    private = re.compile(r"\b(orbax_maxtext_layout|oml|o)\._[a-z]")
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").glob("*.py")]
    files += [p for p in (ROOT / "tests").rglob("*.py") if "fixtures" not in p.parts]
    offenders = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not offenders, offenders
    assert not [
        p.name
        for p in PKG.glob("_*.py")
        if p.name not in ("__init__.py", "__main__.py", "_version.py")
    ]


def test_training_uses_the_manager_through_its_interface_only():
    """training.Checkpointer reaches our v0 manager's legacy steps through
    `CheckpointManager.legacy_steps`, never through the manager's private members."""
    src = (PKG / "training.py").read_text()
    assert not re.findall(r"_manager\._[a-z]\w*", src)
    assert "_manager.legacy_steps" in src


def test_private_orbax_api_we_rely_on_is_still_there():
    """No public equivalent exists in orbax-checkpoint 0.12.8 for these; when Orbax changes
    them this fails first, naming what to port."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as tu

    # orbax_files.open_kvstore(merge=True): a root database that references grafted sub-databases.
    assert tu.OcdbtWriteMode.MERGE is not None
    assert "ocdbt_write_options" in inspect.signature(tu.build_kvstore_tspec).parameters
    tu.OcdbtKvStoreWriteOptions(mode=tu.OcdbtWriteMode.MERGE)
    # spec.read_specs parses each sharding as Orbax's metadata reader does (same failures).
    from orbax.checkpoint._src.metadata import sharding

    single = '{"sharding_type": "SingleDeviceSharding", "device_str": "cpu:0"}'
    assert sharding.from_serialized_string(single) is not None
    # manager.CheckpointManager overrides these (no public hook for moving a legacy step
    # out of a save's way, or for finalize-time migration).
    for name, params in {
        "_load_checkpoint_infos": ["skip_metadata_read"],
        "_get_read_step_directory": ["step", "root_dir"],
        "_get_write_step_directory": ["step", "root_dir"],
        "_get_old_steps_to_remove": [],
        "_finalize": ["step", "steps_to_remove"],
        "_get_save_directory": ["step", "directory"],
    }.items():
        method = getattr(ocp.CheckpointManager, name)
        got = [p for p in inspect.signature(method).parameters if p != "self"]
        assert got[: len(params)] == params, (name, got)
    # The public replacements we use instead of private ones.
    assert callable(ocp.serialization.ts_utils.get_ts_context)
    assert ocp.PyTreeCheckpointHandler.typestr().endswith("PyTreeCheckpointHandler")
