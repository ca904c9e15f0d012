"""Paths and file systems: symlinks (aliases, loops, steps and items pointing outside),
step names that are not numbers, leftover temporary directories and lock files, read-only
sources, and what ``--remove-legacy`` may delete."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import rel_support as S

from orbax_maxtext_layout import (
    Layout,
    ReadOnlyStepError,
    Target,
    convert_step,
    detect_layout,
)

NATIVE = str(S.MAXTEXT_NATIVE)
LOCK = ".orbax-maxtext-layout.lock"

BUG_IDEMPOTENT = (
    "BUG: rerunning 'convert --in-place' or '--remove-legacy' over steps it already "
    "finished fails: convert_step's 'already has items/' branch calls _remove_legacy, "
    "whose verify_step -> plan_step -> read_specs(model_params) raises CheckpointReadError "
    "'model_params: no _METADATA' once the legacy items are gone (exit 1 for every such "
    "step; the same for a symlinked alias of a converted step). It should report them "
    "'skipped'."
)
BUG_EMPTY_LOCK = (
    "BUG: lock.step_lock treats a lock file it cannot parse (empty, as a kill between "
    "os.open(O_CREAT|O_EXCL) and json.dump leaves it, or garbage) as held by a live "
    "owner: the step is reported 'locked' by 'pid None on None' on every run, exit 0, and "
    "is never converted. The lock content should be written atomically (e.g. write a "
    "temp file, then os.link it to the lock name), and an unparsable lock treated as "
    "stale (or after a timeout)."
)
BUG_SYMLINKED_ITEM = (
    "BUG: --remove-legacy/--in-place on a step whose model_params is a symlink: items/ is "
    "committed first, then _remove_legacy's rmtree raises OSError 'Cannot call rmtree on "
    "a symbolic link'; the step is reported failed (exit 1) although converted, and every "
    "rerun fails the same way. Should refuse before writing, or remove only the link "
    "(never the data outside the step) and finish."
)


@pytest.fixture(scope="module")
def target() -> Target:
    return Target.from_checkpoint(S.MAXTEXT_NATIVE)


def put_step(root: Path, rel: str, fixture: str = S.RL) -> Path:
    shutil.copytree(S.FIXTURES / fixture, root / rel, symlinks=True)
    S.chmod_tree(root / rel)
    return root / rel


def convert(*args, **kw) -> S.Result:
    return S.zygote().cli("convert", *args, "--target-from", NATIVE, **kw)


def reports(res: S.Result) -> dict[str, str]:
    return {r["step_dir"]: r["status"] for r in json.loads(res.stdout)}


# -- symlinks ---------------------------------------------------------------------------
def test_symlinked_alias_of_a_step_is_converted_once(target, tmp_path):
    root = tmp_path / "run"
    real = put_step(root, "actor/2")
    os.symlink("2", root / "actor" / "3")  # an alias inside the root
    want = S.oracle(real, target)
    legacy = S.legacy_digest(real)
    res = convert(root, "--json")
    assert res.rc == 0, res.stderr
    got = reports(res)
    assert sorted(got.values()) == ["converted", "skipped"], got
    assert S.stock_restore(real / "items") == want and S.legacy_digest(real) == legacy
    assert (root / "actor" / "3").is_symlink()
    S.count("bad_inputs")


def test_symlink_loops_and_dangling_links_are_ignored(target, tmp_path):
    root = tmp_path / "run"
    good = put_step(root, "actor/2")
    os.symlink("7", root / "actor" / "7")  # a loop to itself
    os.symlink("9", root / "actor" / "8")  # a loop of two
    os.symlink("8", root / "actor" / "9")
    os.symlink("nowhere", root / "actor" / "10")  # dangling
    os.symlink(".", good / "model_params" / "loop")  # a loop inside an item
    os.symlink("loop2", good / "model_params" / "loop2")  # a file-like loop inside an item
    res = convert(root, "--json")
    assert not res.traceback and res.rc in (0, 1), res.stderr
    if res.rc == 0:  # the stray links are not part of the Orbax item: converted exactly
        assert reports(res) == {str(good): "converted"}
        (good / "model_params" / "loop2").unlink()
        (good / "model_params" / "loop").unlink()
        assert S.stock_restore(good / "items") == S.oracle(good, target)
    else:  # or refused, naming the link, with nothing written
        assert "loop2" in res.stderr and not (good / "items").exists(), res.stderr
    assert {p.name for p in (root / "actor").iterdir()} == {"2", "7", "8", "9", "10"}
    S.count("bad_inputs", 5)


def test_step_symlinked_from_outside_the_root(target, tmp_path):
    """``<root>/actor/5 -> <elsewhere>/5``: reported and skipped by default; converted where it
    lives with --follow-symlinks. Either way nothing else outside the root is touched."""
    root, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    put_step(root, "actor/2")
    outside = put_step(elsewhere, "5")
    put_step(elsewhere, "6")  # a neighbour outside the root
    (elsewhere / "notes.txt").write_text("keep me")
    os.symlink(outside, root / "actor" / "5")
    neighbours = S.digest(elsewhere, exclude=("5",))
    before = S.digest(elsewhere)
    want = S.oracle(outside, target)
    res = convert(root, "--remove-legacy", "--json")
    assert res.rc == 0 and not res.traceback, res.stderr
    assert reports(res)[str(root / "actor" / "5")] == "skipped"
    assert "--follow-symlinks" in res.stdout
    assert S.digest(elsewhere) == before  # nothing outside the root touched
    res = convert(root, "--remove-legacy", "--follow-symlinks", "--json")
    assert res.rc == 0 and not res.traceback, res.stderr
    assert S.digest(elsewhere, exclude=("5",)) == neighbours
    assert (root / "actor" / "5").is_symlink()
    assert S.stock_restore(outside / "items") == want
    assert not S.legacy_digest(outside)
    S.count("bad_inputs")


@pytest.mark.parametrize("mode", ["--remove-legacy", "--in-place"])
def test_legacy_removal_never_deletes_through_a_symlinked_item(mode, tmp_path):
    root, ext = tmp_path / "run", tmp_path / "external"
    step = put_step(root, "1")
    data = put_step(ext, "1")
    shutil.rmtree(step / "model_params")
    os.symlink(data / "model_params", step / "model_params")
    outside = S.digest(ext)
    res = convert(root, mode)
    assert not res.traceback, res.stderr
    assert S.digest(ext) == outside, "data outside the step was modified or deleted"
    S.count("bad_inputs")


@pytest.mark.parametrize("mode", ["--remove-legacy", "--in-place"])
def test_symlinked_legacy_item_is_refused_up_front_or_finished(mode, target, tmp_path):
    root, ext = tmp_path / "run", tmp_path / "external"
    step = put_step(root, "1")
    data = put_step(ext, "1")
    shutil.rmtree(step / "model_params")
    os.symlink(data / "model_params", step / "model_params")
    first, again = convert(root, mode), convert(root, mode)
    if first.rc == 0:  # finished: converted, the link (only) gone, and a rerun is clean
        assert detect_layout(step) is Layout.MAXTEXT and not (step / "model_params").exists()
        assert again.rc == 0, again.stderr
    else:  # refused before anything was written
        assert not (step / "items").exists(), first.stderr
        assert "model_params" in first.stderr


# -- names ------------------------------------------------------------------------------
NOT_STEPS = ["latest", "actor/best", "critic/final", "10a", "1.5", "-3", " 7", "7 ", "1e3"]


def test_entries_that_are_not_step_numbers_are_left_alone(target, tmp_path):
    root = tmp_path / "run"
    step = put_step(root, "actor/4")
    for rel in NOT_STEPS:
        put_step(root, rel)
    (root / "actor" / "5").write_text("a file with a step's name")
    others = S.digest(root, exclude=("actor/4",))
    res = convert(root, "--json")
    assert res.rc == 0, res.stderr
    assert reports(res) == {str(step): "converted"}
    assert S.digest(root, exclude=("actor/4",)) == others
    # Given explicitly, a directory with any name is a step (the optimizer holds its number).
    res = convert(root / "latest", "--json")
    assert res.rc == 0 and reports(res) == {str(root / "latest"): "converted"}, res.stderr
    S.count("bad_inputs", len(NOT_STEPS) + 1)


# -- leftovers --------------------------------------------------------------------------
def test_leftover_temporary_directories(target, tmp_path):
    root = tmp_path / "run"
    a, b, c = (put_step(root, f"actor/{n}") for n in (1, 2, 3))
    trainer_tmp = put_step(root, "actor/5.orbax-checkpoint-tmp-1700000000")  # Orbax's own
    (a / "items.orbax-checkpoint-tmp-deadbeef").mkdir()  # ours, from a killed run
    (a / "items.orbax-checkpoint-tmp-deadbeef" / "manifest.ocdbt").write_text("partial")
    (b / "items.orbax-checkpoint-tmp-0a0a0a0a").write_text("a stray file")
    shutil.copytree(c / "model_params", c / "model_params.orbax-checkpoint-tmp-9")
    untouched = S.digest(trainer_tmp)
    res = convert(root, "--json")
    assert res.rc == 0, res.stderr
    assert set(reports(res).values()) == {"converted"} and len(reports(res)) == 3
    assert S.digest(trainer_tmp) == untouched
    assert not [x for x in a.iterdir() if "tmp" in x.name] and not [
        x for x in b.iterdir() if "tmp" in x.name
    ]
    assert (c / "model_params.orbax-checkpoint-tmp-9").is_dir()  # not ours: left alone
    for s in (a, b, c):
        assert S.stock_restore(s / "items") == S.oracle(s, target)
    S.count("bad_inputs", 4)


def test_live_lock_protects_the_step_and_its_temporary_directory(tmp_path):
    root = tmp_path / "run"
    step = put_step(root, "1")
    (step / "items.orbax-checkpoint-tmp-live").mkdir()
    (step / LOCK).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    before = S.digest(step)
    res = convert(root, "--json")
    assert res.rc == 0 and reports(res) == {str(step): "locked"}, res.stdout
    assert S.digest(step) == before
    S.count("bad_inputs")


def test_lock_of_a_dead_process_is_broken(target, tmp_path):
    root = tmp_path / "run"
    step = put_step(root, "1")
    (step / LOCK).write_text(json.dumps({"pid": 2**22 + 7, "host": socket.gethostname()}))
    res = convert(root, "--json")
    assert res.rc == 0 and reports(res) == {str(step): "converted"}, res.stdout
    assert not (step / LOCK).exists()
    S.count("bad_inputs")


@pytest.mark.parametrize("content", ["", "{garbage"], ids=["empty", "garbage"])
def test_unreadable_lock_file_does_not_block_the_step_forever(content, tmp_path):
    root = tmp_path / "run"
    step = put_step(root, "1")
    (step / LOCK).write_text(content)
    res = convert(root, "--json")
    converted = res.rc == 0 and reports(res) == {str(step): "converted"}
    assert converted or (res.rc == 1 and LOCK in res.stderr), (res.rc, res.stdout[-300:])


# -- read-only sources ------------------------------------------------------------------
@pytest.fixture
def read_only_run(tmp_path):
    src = tmp_path / "src"
    put_step(src, "actor/2")
    put_step(src, "actor/3")
    view = tmp_path / "ro"
    with S.read_only_view(src, view) as ok:
        if not ok:
            pytest.skip("cannot mount a read-only bind mount here (root bypasses chmod)")
        assert not os.access(view / "actor" / "2", os.W_OK) or _cannot_write(view)
        yield view, src


def _cannot_write(d: Path) -> bool:
    try:
        (d / "probe").write_text("x")
    except OSError:
        return True
    return False


@pytest.mark.parametrize("mode", [[], ["--in-place"], ["--remove-legacy"]], ids=str)
def test_read_only_source_in_place_modes_are_refused(mode, read_only_run, target):
    view, src = read_only_run
    before = S.digest(src)
    res = convert(view, *mode)
    assert res.rc == 1 and not res.traceback, res.stderr
    for n in (2, 3):
        assert f"{view / 'actor' / str(n)}: ReadOnlyStepError" in res.stderr, res.stderr
    assert "--out" in res.stderr or "out=" in res.stderr
    assert S.digest(src) == before
    with pytest.raises(ReadOnlyStepError):
        convert_step(view / "actor" / "2", target, in_place=True)
    assert S.digest(src) == before
    S.count("faults")


def test_read_only_source_converts_to_a_separate_destination(read_only_run, target, tmp_path):
    view, src = read_only_run
    before = S.digest(src)
    out = tmp_path / "converted"
    res = convert(view, "--out", out, "--json")
    assert res.rc == 0, res.stderr
    assert set(reports(res).values()) == {"converted"}
    for n in (2, 3):
        step, dest = view / "actor" / str(n), out / "actor" / str(n)
        assert S.stock_restore(dest / "items") == S.oracle(step, target)
        meta = json.loads((dest / "_CHECKPOINT_METADATA").read_text())
        assert meta["custom_metadata"]["role"] == "actor"  # the source's step metadata, kept
        assert meta["custom_metadata"]["orbax_maxtext_layout"]["source"] == str(step)
        assert not list(dest.glob("model_params*")) and not S.leftovers(dest)
    assert S.digest(src) == before
    again = convert(view, "--out", out, "--json")
    assert again.rc == 0 and set(reports(again).values()) == {"skipped"}
    # the API, one step to an explicit destination step directory
    report = convert_step(view / "actor" / "2", target, out=tmp_path / "one" / "2")
    assert report.status == "converted" and (tmp_path / "one" / "2" / "items").is_dir()
    assert S.digest(src) == before
    S.count("faults")


# -- what --remove-legacy may delete ----------------------------------------------------
def test_remove_legacy_keeps_legacy_items_that_do_not_verify(tmp_path):
    root = tmp_path / "run"
    step = put_step(root, "1")
    assert convert(root, "--copy").rc == 0  # a copy: items/ has its own data files
    db = step / "items" / "ocdbt.src_model_params"
    values = S.ocdbt_values(db)
    S.flip(db / max(values, key=lambda f: (db / f).stat().st_size))  # items/ now disagrees
    legacy = S.legacy_digest(step)
    res = convert(root, "--remove-legacy", "--json")
    assert not res.traceback, res.stderr
    assert S.legacy_digest(step) == legacy, "legacy items deleted although items/ differs"
    (report,) = json.loads(res.stdout)
    assert any("verification failed" in n for n in report["notes"]), report
    S.count("faults")


def test_remove_legacy_deletes_only_the_converted_steps_legacy_items(target, tmp_path):
    root = tmp_path / "run"
    a = put_step(root, "actor/2")
    b = put_step(root, "actor/3")
    (a / "iter").mkdir()
    (a / "iter" / "state.json").write_text("{}")  # another item of the step
    (a / "notes.txt").write_text("keep")
    os.link(a / "model_params" / "_METADATA", root / "hardlink-to-legacy-metadata")
    keep = S.digest(root, exclude=("actor/2/model_params", "actor/2/optimizer_state"))
    keep = {k: v for k, v in keep.items() if not k.startswith("actor/2/items")}
    want = S.oracle(a, target)
    res = convert(root, "--remove-legacy", "--steps", "2")
    assert res.rc == 0, res.stderr
    after = S.digest(root, exclude=("actor/2/items", "actor/2/_CHECKPOINT_METADATA"))
    keep.pop("actor/2/_CHECKPOINT_METADATA")
    assert after == keep
    assert not S.legacy_digest(a) and S.stock_restore(a / "items") == want
    assert detect_layout(b) is Layout.TUNIX
    S.count("faults")


@pytest.mark.parametrize("mode", ["--in-place", "--remove-legacy"])
def test_rerunning_a_finished_removing_conversion_skips(mode, tmp_path):
    root = tmp_path / "run"
    put_step(root, "actor/2")
    put_step(root, "actor/3")
    assert convert(root, mode).rc == 0
    again = convert(root, mode, "--json")
    assert again.rc == 0, again.stderr[-600:]
    assert set(reports(again).values()) == {"skipped"}
