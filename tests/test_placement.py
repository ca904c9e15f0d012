"""The default `convert` shares the legacy items' data files (reflink, else hard link, else a
copy of that one file, counted with its reason); ``--copy`` writes private copies. Real Orbax
checkpoints on real file systems: no file-system call is mocked."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MAXTEXT_NATIVE, RL_ACTOR_STEPS, copy_fixture, raw, restore_flat, tree_digest
from etils import epath
from forked_cli import run_cli

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.execute import legacy_removal
from orbax_maxtext_layout.storage import placement
from orbax_maxtext_layout.storage.store import store_for

RL = RL_ACTOR_STEPS["tunix017_rl"]
ROOT = Path(__file__).parent.parent
LEGACY = ("model_params", "optimizer_state")
CHILD = "ocdbt.src_"


@pytest.fixture(scope="module")
def target() -> oml.Target:
    return oml.Target.from_checkpoint(MAXTEXT_NATIVE)


def _legacy(step: Path) -> dict[str, dict[str, str]]:
    return {n: tree_digest(step / n) for n in LEGACY}


def _pairs(step: Path, items: Path) -> list[tuple[Path, Path]]:
    """(file in a cloned database of ``items``, the legacy file it was cloned from)."""
    out = []
    for name in LEGACY:
        child = items / f"{CHILD}{name}"
        out += [(f, step / name / f.relative_to(child)) for f in child.rglob("*") if f.is_file()]
    assert out
    return out


def _source_bytes(step: Path) -> int:
    return sum(f.stat().st_size for n in LEGACY for f in (step / n).rglob("*") if f.is_file())


def _same_values(a: Path, b: Path) -> bool:
    x, y = restore_flat(a), restore_flat(b)
    return set(x) == set(y) and all(raw(x[p]).tobytes() == raw(y[p]).tobytes() for p in x)


def test_default_shares_every_data_file_and_leaves_the_legacy_items_identical(target, tmp_path):
    step = copy_fixture(RL, tmp_path / "run")
    before = _legacy(step)
    # First into a separate destination (the source step is only read), then in place.
    out = tmp_path / "out" / "2"
    first = oml.convert_step(step, target, out=out)
    assert _legacy(step) == before
    report = oml.convert_step(step, target)
    assert _legacy(step) == before
    for r, items in ((first, out / "items"), (report, step / "items")):
        files = r.data_files
        pairs = _pairs(step, items)
        assert files["mode"] == "share" and files["copy"]["files"] == 0, files
        shared = files["reflink"]["files"] + files["hardlink"]["files"]
        assert shared == len(pairs)
        assert files["reflink"]["bytes"] + files["hardlink"]["bytes"] == _source_bytes(step)
        if files["hardlink"]["files"]:  # ext4, tmpfs: the same inode under both names
            for new, old in pairs:
                assert new.stat().st_ino == old.stat().st_ino
        # Only B-tree nodes and Orbax metadata were written: no array byte.
        assert 0 < r.bytes_written < _source_bytes(step) // 2
        assert "data files: " in str(r) and "copied" not in str(r).split("data files: ")[1]
    if report.data_files["hardlink"]["files"]:  # legacy, items/, out/items/: one inode
        assert all(old.stat().st_nlink == 3 for _, old in _pairs(step, step / "items"))
    assert oml.verify_step(step).ok and _same_values(out / "items", step / "items")
    prov = oml.converted_provenance(step)
    assert prov["data_files"] == report.data_files
    assert prov["arrays_written"] == {"chunks_copied": 0, "computed": {"cast": 1}}
    assert legacy_removal.removal_check(step, store=store_for(step)) == (
        True,
        "every data file is shared with the legacy items",
    )


def test_copy_writes_private_copies(target, tmp_path):
    step = copy_fixture(RL, tmp_path / "run")
    before = _legacy(step)
    report = oml.convert_step(step, target, copy=True)
    assert _legacy(step) == before
    pairs = _pairs(step, step / "items")
    for new, old in pairs:
        assert new.stat().st_nlink == old.stat().st_nlink == 1
        assert new.stat().st_ino != old.stat().st_ino and new.read_bytes() == old.read_bytes()
    files = report.data_files
    assert files["mode"] == "copy" and files["copy"]["files"] == len(pairs)
    assert files["copy"]["why"] == {placement.ASKED: len(pairs)}
    assert files["reflink"]["files"] == files["hardlink"]["files"] == 0
    assert report.bytes_written >= _source_bytes(step)  # every data byte, plus the B-tree
    assert oml.verify_step(step).ok
    assert (
        legacy_removal.removal_check(step, store=store_for(step))[0] is False
    )  # copied bytes are compared value by value
    with pytest.raises(oml.UsageError, match="in_place"):
        oml.convert_step(copy_fixture(RL, tmp_path / "again"), target, in_place=True, copy=True)


@contextlib.contextmanager
def _shm_dir() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="omtl-share-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_out_on_another_file_system_copies_and_says_why(tmp_path):
    with _shm_dir() as shm:
        if os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("/dev/shm and the test's directory are one file system")
        root = tmp_path / "run"
        step = copy_fixture(RL, root)
        before = _legacy(step)
        out = shm / "out"
        # forked from a warm interpreter (`forked_cli`): the command's output and files
        res = run_cli(
            "convert", step, "--target-from", MAXTEXT_NATIVE, "--out", out / "2", "--json", cwd=ROOT
        )
        assert res.returncode == 0, res.stderr
        (report,) = json.loads(res.stdout)
        files = report["data_files"]
        n = len(_pairs(step, out / "2" / "items"))
        assert files["mode"] == "share" and files["copy"]["files"] == n, files
        assert files["copy"]["why"] == {"EXDEV: another file system": n}
        assert report["bytes_written"] >= files["copy"]["bytes"] == _source_bytes(step)
        for new, _ in _pairs(step, out / "2" / "items"):
            assert new.stat().st_nlink == 1
        assert _legacy(step) == before
        text = run_cli(
            "convert", step, "--target-from", MAXTEXT_NATIVE, "--out", out / "3", cwd=ROOT
        )
        assert f"data files: {n} copied" in text.stdout, text.stdout
        assert f"copied because: EXDEV: another file system ({n})" in text.stdout
        oml.convert_step(step, oml.Target.from_checkpoint(MAXTEXT_NATIVE), copy=True)
        assert _same_values(out / "2" / "items", step / "items")
        assert _same_values(out / "3" / "items", step / "items")


def test_remove_legacy_after_a_shared_convert_keeps_items_readable(target, tmp_path):
    reference = copy_fixture(RL, tmp_path / "ref")
    oml.convert_step(reference, target, copy=True)
    step = copy_fixture(RL, tmp_path / "run")
    report = oml.convert_step(step, target, remove_legacy=True)
    assert report.data_files["copy"]["files"] == 0
    note = next(n for n in report.notes if "removed legacy" in n)
    assert "quick verification: every data file is shared" in note, report.notes
    assert not any((step / n).exists() for n in LEGACY)
    # The shared files hold the data under their one remaining name.
    files = [f for f in (step / "items").rglob("*") if f.is_file()]
    assert all(f.stat().st_nlink == 1 for f in files)
    assert _same_values(step / "items", reference / "items")
    assert oml.detect_layout(step) is oml.Layout.MAXTEXT


def test_a_copied_file_makes_the_removal_verify_every_value(target, tmp_path):
    """model_params lives on another file system (a link to /dev/shm): its files fall back to
    copies, optimizer_state's are shared; the removal then compares every value."""
    with _shm_dir() as shm:
        step = copy_fixture(RL, tmp_path / "run")
        if os.stat(shm).st_dev == os.stat(step).st_dev:
            pytest.skip("/dev/shm and the test's directory are one file system")
        shutil.move(str(step / "model_params"), str(shm / "model_params"))
        os.symlink(shm / "model_params", step / "model_params")
        before = tree_digest(shm / "model_params")
        report = oml.convert_step(step, target)
        files = report.data_files
        assert (
            files["copy"]["files"] > 0
            and files["hardlink"]["files"] + files["reflink"]["files"] > 0
        ), files
        assert set(files["copy"]["why"]) == {"EXDEV: another file system"}
        ok, why = legacy_removal.removal_check(step, store=store_for(step))
        assert not ok and "copied, not shared" in why
        notes = legacy_removal.remove_legacy(epath.Path(step), store=store_for(step))
        assert any("full verification" in n for n in notes), notes
        assert not (step / "model_params").exists() and not (step / "optimizer_state").exists()
        assert tree_digest(shm / "model_params") == before  # only the link was removed
        assert sorted(restore_flat(step / "items"))


def test_a_replaced_hard_link_is_no_longer_trusted(target, tmp_path):
    step = copy_fixture(RL, tmp_path / "run")
    report = oml.convert_step(step, target)
    if not report.data_files["hardlink"]["files"]:
        pytest.skip("this file system shares by reflink")
    new, _ = max(_pairs(step, step / "items"), key=lambda p: p[0].stat().st_size)
    data = new.read_bytes()
    new.unlink()
    new.write_bytes(data)  # the same bytes, another inode: a copy nothing verified
    ok, why = legacy_removal.removal_check(step, store=store_for(step))
    assert not ok and "no longer the legacy files" in why
    assert oml.verify_step(step).ok  # and the full verification that follows passes


# -- reflinks: on an XFS image, where mkfs.xfs and loop mounts are available ---------------
@contextlib.contextmanager
def _xfs(tmp_path: Path) -> Iterator[Path]:
    mkfs = shutil.which("mkfs.xfs")
    if mkfs is None or os.geteuid() != 0:
        pytest.skip("reflinks need mkfs.xfs (xfsprogs) and root to mount an XFS image")
    image, mnt = tmp_path / "xfs.img", tmp_path / "xfs"
    with open(image, "wb") as f:
        f.truncate(320 << 20)  # sparse; XFS's smallest file system is 300 MB
    mnt.mkdir()
    made = subprocess.run([mkfs, "-q", "-m", "reflink=1", str(image)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"mkfs.xfs failed: {made.stderr.decode()[-200:]}")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount an XFS image here: {mounted.stderr.decode()[-200:]}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_reflinks_where_the_file_system_has_them(target, tmp_path):
    with _xfs(tmp_path) as mnt:
        reference = copy_fixture(RL, tmp_path / "ref")
        oml.convert_step(reference, target, copy=True)
        step = copy_fixture(RL, mnt / "run")
        before = _legacy(step)
        report = oml.convert_step(step, target)
        files = report.data_files
        pairs = _pairs(step, step / "items")
        assert files["reflink"]["files"] == len(pairs), files
        assert files["hardlink"]["files"] == files["copy"]["files"] == 0
        for new, old in pairs:  # separate files, one link each, sharing their extents
            assert new.stat().st_ino != old.stat().st_ino and new.stat().st_nlink == 1
        # Reflinked bytes are shared, not written: only the B-tree and the metadata count.
        assert 0 < report.bytes_written < _source_bytes(step) // 2
        assert "reflinked" in str(report)
        assert _legacy(step) == before and oml.verify_step(step).ok
        # Copy-on-write: a change to a legacy file never reaches items/ (unlike a hard link).
        new, old = max(pairs, key=lambda p: p[0].stat().st_size)
        kept = new.read_bytes()
        with open(old, "r+b") as f:
            f.write(b"\xff" * 16)
        assert new.read_bytes() == kept
        old.write_bytes(kept)  # undo, in place
        assert legacy_removal.removal_check(step, store=store_for(step))[0]
        report = oml.convert_step(step, target, remove_legacy=True)  # finishes the removal
        assert any("quick verification" in n for n in report.notes), report.notes
        assert not any((step / n).exists() for n in LEGACY)
        assert _same_values(step / "items", reference / "items")
        # --copy is a physical copy even here (copy_file_range, like cp, would clone).
        other = copy_fixture(RL, mnt / "copy")
        os.sync()
        used = _used(mnt)
        report = oml.convert_step(other, target, copy=True)
        os.sync()
        assert report.data_files["copy"]["files"] == len(_pairs(other, other / "items"))
        assert _used(mnt) - used >= _source_bytes(other)


def _used(mnt: Path) -> int:
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_copies_run_in_parallel_and_each_file_is_counted_once(tmp_path):
    """After the first copy the rest are copied by worker threads: every file once, its
    exact bytes, the counts added under a lock; a failure in a worker is raised."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    sizes = [0, 1, 4095, 4096, 1 << 20, (3 << 20) + 7] * 8
    pairs = []
    for i, n in enumerate(sizes):
        (src / f"f{i}").write_bytes(os.urandom(n))
        pairs.append((str(src / f"f{i}"), str(dst / f"f{i}")))
    placed = placement.Placement(mode=placement.COPY_MODE)
    placement.Placer(placed, share=False).place_all(pairs, workers=4)
    for a, b in pairs:
        assert Path(a).read_bytes() == Path(b).read_bytes()
        assert os.stat(a).st_ino != os.stat(b).st_ino
    assert placed.files[placement.COPY] == len(sizes) and placed.bytes[placement.COPY] == sum(sizes)
    assert placed.why == {placement.ASKED: len(sizes)}

    bad = [*pairs[:5], (pairs[5][0], str(tmp_path / "missing" / "f5")), *pairs[6:]]
    for _, b in pairs:
        os.unlink(b)
    with pytest.raises(FileNotFoundError, match="missing"):
        placement.Placer(placement.Placement(), share=False).place_all(bad, workers=4)
