"""Cost per leaf: metadata is read once per item and each database is listed once per
operation, however many leaves a step holds (`orbax_files.io_counts` counts them).

`read_specs` reads an item's JSON files and every array's zarr metadata in one batch;
it must return exactly what Orbax's own metadata reader gives (`spec.orbax_specs`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
import writers as W
from conftest import FIXTURES
from etils import epath

from orbax_maxtext_layout import (
    CheckpointManager,
    Target,
    cli,
    convert_step,
    read_specs,
    verify_step,
)
from orbax_maxtext_layout.orbax_io.orbax_files import ItemFiles, io_counts, reads_each_item_once
from orbax_maxtext_layout.orbax_io.spec import orbax_specs
from orbax_maxtext_layout.storage.store import store_for

REPO = Path(__file__).parent.parent
EXAMPLES = REPO / "orbax_maxtext_layout" / "examples"
ITEMS = sorted(m.parent for root in (FIXTURES, EXAMPLES) for m in root.rglob("_METADATA"))
LAYERS = 6


@pytest.mark.parametrize("item", ITEMS, ids=[str(p.relative_to(REPO)) for p in ITEMS])
def test_read_specs_is_orbax_metadata(item):
    """Same leaves, in the same order, with the same shapes, dtypes and key impls, for every
    fixture (zarr2 and zarr3, OCDBT and Pathways-style, typed keys, None gaps)."""
    with io_counts() as counts:
        fast = read_specs(item)
    assert list(fast.items()) == list(orbax_specs(item, store=store_for(item)).items())
    # One batch of zarr metadata reads, one parse of the item's files and no listing: it
    # did not fall back to Orbax's.
    assert sorted(k for k, _ in counts) == ["item files", "zarr metadata"], counts
    assert set(counts.values()) == {1}, counts


def test_read_specs_of_unsorted_metadata_is_in_orbax_order(tmp_path):
    item = tmp_path / "optimizer_state"
    shutil.copytree(FIXTURES / "tunix017/dpo_run/checkpoints/1/optimizer_state", item)
    meta = json.loads((item / "_METADATA").read_text())
    entries = list(meta["tree_metadata"].items())
    meta["tree_metadata"] = dict(entries[::-1])
    (item / "_METADATA").write_text(json.dumps(meta))
    assert list(read_specs(item).items()) == list(orbax_specs(item, store=store_for(item)).items())


def test_read_specs_of_numpy_scalar_and_string_leaves_is_orbax_metadata(tmp_path):
    item = epath.Path(tmp_path / "item")
    h = ocp.PyTreeCheckpointHandler()
    tree = {"a": np.arange(3, dtype=np.int16), "s": "text", "n": 7, "x": 1.5, "e": {}, "z": None}
    h.save(item, args=ocp.args.PyTreeSave(tree))
    h.finalize(item)
    with io_counts() as counts:
        fast = read_specs(item)
    assert list(fast.items()) == list(orbax_specs(item, store=store_for(item)).items())
    assert sorted(fast) == [("a",), ("n",), ("s",), ("x",)]
    assert sorted(k for k, _ in counts) == ["item files", "zarr metadata"], counts


@pytest.fixture(scope="module")
def many_leaves(tmp_path_factory):
    """An unscanned RL step of many tiny leaves, and the full target of its converted form
    (params, nnx_aux, opt_state and step)."""
    root = tmp_path_factory.mktemp("leaves")
    model = W.make_model(scanned=False, adapter=True, num_layers=LAYERS)
    step = Path(W.write_tunix_step(root / "src", 3, model, W.make_optimizer(model, "rl")))
    converted = root / "converted" / "3"
    shutil.copytree(step, converted)
    convert_step(converted, Target.from_nnx(model.base))
    return step, Target.from_checkpoint(converted), converted


def _by_kind(counts, kind: str) -> dict[str, int]:
    return {where: n for (k, where), n in counts.items() if k == kind}


@pytest.mark.parametrize("quick", [False, True])
def test_verify_lists_each_database_once_and_reads_its_metadata_once(many_leaves, tmp_path, quick):
    src, target, _ = many_leaves
    step = tmp_path / "3"
    shutil.copytree(src, step)
    convert_step(step, target)
    with io_counts() as counts:
        result = verify_step(step, quick=quick)
    assert result.ok and result.checked > 10 * LAYERS, result.problems
    listed = _by_kind(counts, "listing")
    items = [str(step / n) for n in ("items", "model_params", "optimizer_state")]
    # Full: each source database and items/ once; quick: items/ only. Never once per leaf.
    assert sorted(listed) == sorted(f"{d}/" for d in (items[:1] if quick else items)), listed
    assert set(listed.values()) == {1}, listed
    metadata = _by_kind(counts, "zarr metadata")
    assert sorted(metadata) == sorted(f"{d}/" for d in items) and set(metadata.values()) == {1}
    parsed = _by_kind(counts, "item files")  # the plan's specs and the readers share one parse
    assert sorted(parsed) == sorted(items), parsed
    assert set(parsed.values()) == {1}, parsed


def test_transparent_restore_plans_from_each_item_once(many_leaves, tmp_path):
    """A partial restore plans twice (the restore, and whether it covers the whole step
    for the migration): from one read of each item's metadata."""
    src, target, _ = many_leaves
    shutil.copytree(src, tmp_path / "run" / "3")
    with CheckpointManager(tmp_path / "run", item_names=("items",)) as mngr:
        args = ocp.args.PyTreeRestore(item=target.items(), partial_restore=True)
        with io_counts() as counts:
            items = mngr.restore(2, args=ocp.args.Composite(items=args))["items"]
    assert sorted(items) == ["nnx_aux", "opt_state", "params", "step"]
    metadata = _by_kind(counts, "zarr metadata")
    want = [f"{tmp_path / 'run' / '3' / n}/" for n in ("model_params", "optimizer_state")]
    assert sorted(metadata) == want and set(metadata.values()) == {1}, metadata
    assert not _by_kind(counts, "listing")
    parsed = _by_kind(counts, "item files")  # planned twice, read by the engine: one parse
    assert sorted(parsed) == [w.rstrip("/") for w in want] and set(parsed.values()) == {1}, parsed


@pytest.mark.parametrize("how", ["convert", "dry_run", "inspect"])
def test_convert_dry_run_and_inspect_read_each_item_once(many_leaves, tmp_path, how):
    """A conversion (which shares the data files and does not verify), its dry run and
    `inspect` with a target (groups, LoRA detection and the plan) read each legacy item's
    metadata once, and list a database at most once (the writer's graft)."""
    src, target, converted = many_leaves
    step = tmp_path / "3"
    shutil.copytree(src, step)
    with io_counts() as counts:
        if how == "inspect":
            with contextlib.redirect_stdout(io.StringIO()) as out:
                rc = cli.main(["inspect", str(tmp_path), "--json", "--target-from", str(converted)])
        else:
            report = convert_step(step, target, dry_run=how == "dry_run")
    if how == "inspect":
        [entry] = json.loads(out.getvalue())
        assert rc == 0 and entry["plan"]["status"] == "dry-run" and entry["lora"] is None, entry
    else:
        assert report.status == ("dry-run" if how == "dry_run" else "converted"), report.notes
    # (inspect also reads the target's items, once, outside tmp_path)
    metadata = {k: n for k, n in _by_kind(counts, "zarr metadata").items() if str(tmp_path) in k}
    want = [f"{step / n}/" for n in ("model_params", "optimizer_state")]
    assert sorted(metadata) == want and set(metadata.values()) == {1}, metadata
    listed = _by_kind(counts, "listing")  # the writer lists each source it grafts, once
    assert set(listed.values()) <= {1} and (how == "convert" or not listed), counts


def test_in_place_conversion_reads_each_item_once(many_leaves, tmp_path):
    """Planning and the verification before the legacy removal share one read of each
    legacy item's metadata; each database is listed at most once."""
    src, target, _ = many_leaves
    step = tmp_path / "3"
    shutil.copytree(src, step)
    with io_counts() as counts:
        report = convert_step(step, target, in_place=True)
    assert report.status == "converted" and not (step / "model_params").exists(), report.notes
    metadata = _by_kind(counts, "zarr metadata")
    items = [str(step / n) for n in ("items", "model_params", "optimizer_state")]
    assert sorted(metadata) == sorted(f"{d}/" for d in items) and set(metadata.values()) == {1}
    assert set(_by_kind(counts, "listing").values()) == {1}, counts
    parsed = _by_kind(counts, "item files")
    assert sorted(parsed) == sorted(items) and set(parsed.values()) == {1}, parsed


def test_an_item_rewritten_within_an_operation_is_read_again(many_leaves, tmp_path):
    """Within `reads_each_item_once` an item's files are parsed once while its _METADATA is
    the same file; an item replaced meanwhile (a new _METADATA) is read afresh, and
    outside any operation nothing is kept."""
    _, _, converted = many_leaves
    item = tmp_path / "items"
    shutil.copytree(converted / "items", item)

    @reads_each_item_once
    def twice_then_replaced() -> tuple:
        first, again = ItemFiles.read(item), ItemFiles.read(item)
        shutil.rmtree(item)
        shutil.copytree(converted / "items", item)
        meta = json.loads((item / "_METADATA").read_text())
        meta["custom"] = "rewritten"
        (item / "_METADATA").write_text(json.dumps(meta))
        return first, again, ItemFiles.read(item)

    with io_counts() as counts:
        first, again, replaced = twice_then_replaced()
    assert again is first and replaced is not first and replaced.meta.get("custom") == "rewritten"
    assert _by_kind(counts, "item files") == {str(item): 2}
    with io_counts() as counts:
        assert ItemFiles.read(item) is not ItemFiles.read(item)
    assert _by_kind(counts, "item files") == {str(item): 2}


@pytest.mark.parametrize(
    "flags",
    [[], ["--keep-step-numbers"], ["--in-place"], ["--remove-legacy"], ["--out", "OUT"]],
    ids=["renumber", "keep-numbers", "in-place", "remove-legacy", "out"],
)
def test_convert_reads_each_steps_metadata_once(many_leaves, tmp_path, flags):
    """A run of three steps: whatever the options, each step's _CHECKPOINT_METADATA is
    read once (its record then follows the step through its renumbering, commit and
    legacy removal), not once per question asked of it."""
    src, _, converted = many_leaves
    root = tmp_path / "run"
    for n in (1, 2, 3):
        shutil.copytree(src, root / str(n))
    flags = [str(tmp_path / "out") if f == "OUT" else f for f in flags]
    with io_counts() as counts, contextlib.redirect_stdout(io.StringIO()) as out:
        rc = cli.main(["convert", str(root), "--target-from", str(converted), "--json", *flags])
    reports = json.loads(out.getvalue())
    assert rc == 0 and [r["status"] for r in reports] == ["converted"] * 3, reports
    reads = _by_kind(counts, "step metadata")
    assert sorted(reads) == sorted(str(root / str(n)) for n in (1, 2, 3)), reads
    assert set(reads.values()) == {1}, reads


_FROZEN_HEAP_CHECK = """
import gc

from orbax_maxtext_layout.base.gcfreeze import frozen_heap

def made() -> list:
    return [[i] for i in range(1000)]  # tracked by the collector

# as the interpreter starts: 3.12 and later keep their immortal objects frozen (3.12.1: 375)
start = gc.get_freeze_count()
assert start < 1000
for _ in range(2):  # as it started, then after a collection put them back
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > start + 1000
        alive = made()
        with frozen_heap():  # nested: no second freeze
            assert gc.get_freeze_count() <= frozen
        assert start < gc.get_freeze_count() <= frozen  # the nested exit did not unfreeze
        del alive
    assert gc.get_freeze_count() == 0  # all returned (immortal ones too: harmless)
    gc.collect()
    assert gc.get_freeze_count() == start  # a collection moved the immortal ones back
gc.freeze()  # the process's own freeze: never undone, never added to
try:
    before = gc.get_freeze_count()
    alive = made()
    with frozen_heap():
        assert gc.get_freeze_count() <= before
    assert 0 < gc.get_freeze_count() <= before  # not undone
    del alive
finally:
    gc.unfreeze()
gc.disable()
try:
    with frozen_heap():
        assert gc.get_freeze_count() == 0
finally:
    gc.enable()
"""


def _python312() -> str | None:
    """A Python 3.12 (MaxText's), where the interpreter starts with objects frozen."""
    if sys.version_info >= (3, 12):
        return sys.executable
    env = {**os.environ, "PYENV_VERSION": "3.12.1"}
    for exe in ("python3.12", shutil.which("python3.12") or ""):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [exe, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
            )
            if out.stdout.strip() == "True":
                return exe
    return None


@pytest.mark.parametrize("python", ["this", "3.12"])
def test_frozen_heap_returns_what_it_froze_and_leaves_a_process_freeze_alone(python):
    """In a fresh interpreter (the test process may hold a freeze of its own), this one and
    a 3.12 (MaxText's), which starts with 375 immortal objects frozen: there `frozen_heap`
    freezes as on 3.11. Counts are compared with room for frozen objects freed meanwhile
    (a freed object leaves the permanent generation), but not for the 1,000 objects made in
    between. The 3.12 child loads ``gcfreeze`` alone (standard library only)."""
    exe, env, flags = sys.executable, dict(os.environ), []
    code = _FROZEN_HEAP_CHECK
    if python == "3.12":
        exe = _python312()
        if exe is None:
            pytest.skip("no Python 3.12 here")
        env["PYENV_VERSION"] = "3.12.1"
        path = REPO / "orbax_maxtext_layout" / "base" / "gcfreeze.py"
        code = code.replace(
            "from orbax_maxtext_layout.base.gcfreeze import frozen_heap",
            "import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('gcfreeze', {str(path)!r})\n"
            "mod = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(mod)\n"
            "frozen_heap = mod.frozen_heap",
        )
        flags = ["-I"]  # no site-packages: the interpreter's own start
    res = subprocess.run(
        [exe, *flags, "-c", code], capture_output=True, text=True, cwd=REPO, env=env
    )
    assert res.returncode == 0, res.stderr[-3000:]
