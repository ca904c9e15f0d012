"""Writes on gs:// (issue 12) against the local emulator: the same results as on a disk, no
array bytes through the client, a commit marker instead of a rename, a conditional lock."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import orbax.checkpoint as ocp
import pytest

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.storage import objstore

from .conftest import restored_leaves

EXAMPLES = oml.EXAMPLES_DIR
TUNIX_RUN = EXAMPLES / "tunix_rl_run"
STEP = "checkpoints/actor/2"
MAXTEXT_STEP = EXAMPLES / "maxtext_run" / "checkpoints" / "2"
JSON_FILES = ("_METADATA", "_sharding", "array_metadatas/process_0")


def _local_copy(tmp_path) -> Path:
    run = tmp_path / "local" / "tunix_rl_run"
    shutil.copytree(TUNIX_RUN, run)
    return run


@pytest.fixture
def gs_run(gs_prefix):
    return gs_prefix.upload(TUNIX_RUN, "tunix_rl_run"), gs_prefix.upload(MAXTEXT_STEP, "mt/2")


@pytest.mark.parametrize("mode", ["default", "in_place", "out"])
def test_convert_on_gs_equals_the_same_conversion_on_disk(gs_run, gs_prefix, tmp_path, mode):
    run, maxtext = gs_run
    local = _local_copy(tmp_path)
    target = oml.Target.from_checkpoint(MAXTEXT_STEP)
    kwargs = {"default": {}, "in_place": {"in_place": True}, "out": {}}[mode]
    remote_out = gs_prefix.path("out/2") if mode == "out" else None
    local_out = tmp_path / "out" / "2" if mode == "out" else None
    got = oml.convert_step(
        run / STEP, oml.Target.from_checkpoint(maxtext), out=remote_out, **kwargs
    )
    want = oml.convert_step(local / STEP, target, out=local_out, **kwargs)
    assert got.status == want.status == "converted", got.notes
    assert got.destinations == want.destinations and got.rules == want.rules
    remote_step = remote_out or run / STEP
    local_step = local_out or local / STEP
    assert oml.detect_layout(remote_step) is oml.Layout.MAXTEXT
    assert (remote_step / "items" / "commit_success.txt").exists()
    assert oml.read_specs(remote_step / "items") == oml.read_specs(local_step / "items")
    for name in JSON_FILES:  # the Orbax metadata files are byte for byte the same
        assert (remote_step / "items" / name).read_bytes() == (
            local_step / "items" / name
        ).read_bytes()
    assert restored_leaves(remote_step / "items") == restored_leaves(local_step / "items")
    legacy = {p.name for p in remote_step.iterdir()} & {"model_params", "optimizer_state"}
    assert bool(legacy) is (mode == "default")
    if mode == "out":  # a published destination step, the source untouched
        assert (remote_out / "commit_success.txt").exists()
        assert oml.detect_layout(run / STEP) is oml.Layout.TUNIX
    if mode == "default":
        result = oml.verify_step(remote_step)
        assert result.ok, result.problems
        meta = json.loads((remote_step / "_CHECKPOINT_METADATA").read_text())
        assert meta["custom_metadata"]["orbax_maxtext_layout"]["rules"] == want.rules


def test_an_items_dir_without_its_marker_is_incomplete_and_a_rerun_replaces_it(gs_run, tmp_path):
    run, maxtext = gs_run
    target = oml.Target.from_checkpoint(maxtext)
    # What a run killed before its commit marker leaves: items/ written, no marker.
    local = _local_copy(tmp_path)
    oml.convert_step(local / STEP, oml.Target.from_checkpoint(MAXTEXT_STEP))
    (local / STEP / "items" / "commit_success.txt").unlink()
    for f in (local / STEP / "items").rglob("*"):
        if f.is_file():
            (run / STEP / "items" / f.relative_to(local / STEP / "items")).write_bytes(
                f.read_bytes()
            )
    objstore.refresh(run)
    assert oml.detect_layout(run / STEP) is oml.Layout.TUNIX
    assert [s.layout for s in oml.find_steps(run / "checkpoints")] == [oml.Layout.TUNIX]
    report = oml.convert_step(run / STEP, target)
    assert report.status == "converted"
    assert oml.verify_step(run / STEP).ok


def test_a_failed_out_conversion_leaves_no_listable_step(gs_run, gs_prefix):
    run, maxtext = gs_run
    # Damage a data file of array chunks (planning reads only metadata, so it passes):
    # refused before the commit (B3).
    data = sorted(
        (p for p in (run / STEP / "model_params" / "ocdbt.process_0" / "d").iterdir()),
        key=lambda p: p.stat().length,
    )[-1]
    data.write_bytes(data.read_bytes()[:10])
    objstore.refresh(run)
    out = gs_prefix.path("out/2")
    with pytest.raises(oml.CheckpointReadError, match="damaged source data"):
        oml.convert_step(run / STEP, oml.Target.from_checkpoint(maxtext), out=out)
    assert not (out / "commit_success.txt").exists()
    with ocp.CheckpointManager(gs_prefix.path("out"), item_names=("items",)) as mngr:
        assert mngr.all_steps() == []


@pytest.mark.parametrize("damage", ["truncate", "empty", "delete"])
@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in_place"])
def test_damaged_source_data_is_refused_before_the_commit(gs_run, gs_prefix, damage, in_place):
    """B3 on gs://: a data file the new items/ would reference is checked against its size
    (no decode) and the step is refused naming it; nothing is committed or deleted."""
    run, maxtext = gs_run
    data = max(
        (run / STEP / "model_params" / "ocdbt.process_0" / "d").iterdir(),
        key=lambda p: p.stat().length,
    )
    if damage == "delete":
        data.unlink()
    else:
        data.write_bytes(data.read_bytes()[:10] if damage == "truncate" else b"")
    objstore.refresh(run)
    before = gs_prefix.objects("tunix_rl_run/" + STEP)
    with pytest.raises(oml.CheckpointReadError, match=f"damaged source data.*{data.name}"):
        oml.convert_step(run / STEP, oml.Target.from_checkpoint(maxtext), in_place=in_place)
    assert gs_prefix.objects("tunix_rl_run/" + STEP) == before  # no items/, legacy kept
    assert oml.detect_layout(run / STEP) is oml.Layout.TUNIX


def test_a_dead_runs_lock_on_a_converted_step_is_removed_by_the_rerun(gs_run):
    """A run killed after its commit and before releasing its lock (B2 on gs://): the rerun
    finds the step converted, removes the dead owner's lock and keeps a live owner's."""
    run, maxtext = gs_run
    target = oml.Target.from_checkpoint(maxtext)
    assert oml.convert_step(run / STEP, target).status == "converted"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = run / STEP / ".orbax-maxtext-layout.lock"
    for pid, removed in ((os.getpid(), False), (dead.pid, True)):
        lock.write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
        objstore.refresh(lock)
        report = oml.convert_step(run / STEP, target)
        assert report.status == "skipped"
        assert ("removed the lock of a dead run" in report.notes) is removed
        objstore.refresh(lock)
        assert lock.exists() is not removed


def test_the_lock_is_a_conditional_create(gs_prefix):
    lock = gs_prefix.path("step/.lock")
    assert objstore.write_exclusive(lock, b"a")
    assert not objstore.write_exclusive(lock, b"b")
    assert lock.read_bytes() == b"a"


@pytest.mark.parametrize(
    "mode",
    [{}, {"in_place": True}, {"renumber": True}],
    ids=["copy", "in_place", "renumber"],
)
def test_no_array_bytes_through_the_client(gcs_emulator, gs_synth, mode):
    """Also when renumbering moves the step directory (Tunix 3 -> MaxText 2): the move is
    server-side copies too."""
    local, step, target = gs_synth
    arrays = sum(
        s.nbytes
        for item in ("model_params", "optimizer_state")
        for s in oml.read_specs(local / item).values()
    )
    with gcs_emulator.measure() as c:
        report = oml.convert_step(step, target, **mode)
    assert report.status == "converted"
    assert c.by_kind.get("copy", 0) > 0  # data files copied server-side
    assert c.media_bytes <= arrays // 100, (c.media_bytes, arrays, c.by_kind)
    if mode.get("renumber"):
        assert report.step_dir == str(step.parent / "2") and not step.exists()
        step = step.parent / "2"
        assert oml.detect_layout(step) is oml.Layout.MAXTEXT
    assert oml.verify_step(step, quick=True).ok or "in_place" in mode  # legacy removed
