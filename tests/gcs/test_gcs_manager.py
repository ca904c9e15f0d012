"""The v0 `CheckpointManager` and the v1 `training.Checkpointer` on gs:// (issue 12).

Restore, save, the save-time move of a legacy step and its lazy migration give the same
checkpoints as on a disk. A move killed at any point is finished or rolled back by the next
manager or `convert`. SIGKILLs at seeded random times during the manager's migration never
leave a step that reads as neither legacy nor complete items.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp
import pytest
from forked_cli import run_call

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.cli import main
from orbax_maxtext_layout.orbax_io import stepmeta
from orbax_maxtext_layout.storage import objstore

from .conftest import restored_leaves
from .emulator import invalidate_gcsfs_caches
from .manager_job import cycle

EXAMPLES = oml.EXAMPLES_DIR
TUNIX_RUN = EXAMPLES / "tunix_rl_run"
TEMPLATE = EXAMPLES / "maxtext_run" / "checkpoints" / "2"
ACTOR = "checkpoints/actor"  # Tunix directory 2 = MaxText step 1
KILLS = int(os.environ.get("OMTL_GCS_MANAGER_KILLS", "10"))
SEED = int(os.environ.get("OMTL_RELIABILITY_SEED", "20261201"))
JOB = Path(__file__).with_name("manager_job.py")  # its `run`, forked (`_job`)
LEGACY = ("model_params", "optimizer_state")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The Tunix step converted on a disk: what every migrated or saved step must hold."""
    run = tmp_path_factory.mktemp("ref") / "run"
    shutil.copytree(TUNIX_RUN, run)
    oml.convert_step(run / ACTOR / "2", oml.Target.from_checkpoint(TEMPLATE))
    return restored_leaves(run / ACTOR / "2" / "items")


def _tops(gs_prefix, rel: str) -> set[str]:
    return {k.split("/")[0] for k in gs_prefix.objects(rel)}


def _legacy_objects(gs_prefix, rel: str) -> dict[str, int]:
    return {k: v for k, v in gs_prefix.objects(rel).items() if k.split("/")[0] in LEGACY}


def _leftovers(gs_prefix, rel: str) -> list[str]:
    """Locks, move markers and legacy items anywhere under ``rel``."""
    return sorted(
        k
        for k in gs_prefix.objects(rel)
        if k.endswith(".lock") or objstore.MOVING in k or set(k.split("/")) & set(LEGACY)
    )


# -- the same run on gs:// and on a disk --------------------------------------------------
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_manager_on_gs_equals_the_manager_on_disk(gs_prefix, tmp_path, use_async):
    local = tmp_path / "run"
    shutil.copytree(TUNIX_RUN, local)
    remote = gs_prefix.upload(TUNIX_RUN, "run")
    assert cycle(str(local / ACTOR), str(TEMPLATE), use_async=use_async) == [1, 2]
    with gs_prefix.emu.measure() as c:
        assert cycle(str(remote / ACTOR), str(TEMPLATE), use_async=use_async) == [1, 2]
    assert c.by_kind.get("copy", 0) > 0, c.by_kind  # the move: server-side copies
    invalidate_gcsfs_caches()
    assert _tops(gs_prefix, "run/" + ACTOR) == set(os.listdir(local / ACTOR)) == {"1", "2"}
    for name in ("1", "2"):  # 1: the moved, migrated Tunix step; 2: the new save
        step = remote / ACTOR / name
        assert oml.detect_layout(step) is oml.Layout.MAXTEXT
        assert restored_leaves(step / "items") == restored_leaves(local / ACTOR / name / "items")
    meta = json.loads((remote / ACTOR / "1" / "_CHECKPOINT_METADATA").read_text())
    want = json.loads((local / ACTOR / "1" / "_CHECKPOINT_METADATA").read_text())
    for m in (meta, want):  # B-tree nodes written (varies by a byte between runs)
        m["custom_metadata"]["orbax_maxtext_layout"].pop("bytes_written")
    # How the data files were placed: server-side copies there, shared files on a disk.
    assert meta["custom_metadata"]["orbax_maxtext_layout"].pop("data_files")["mode"] == (
        "server-side"
    )
    assert want["custom_metadata"]["orbax_maxtext_layout"].pop("data_files")["mode"] == "share"
    assert meta["custom_metadata"] == want["custom_metadata"]
    assert meta["custom_metadata"][oml.TUNIX_STEP_KEY] == 2
    assert _leftovers(gs_prefix, "run/" + ACTOR) == []
    with ocp.CheckpointManager(remote / ACTOR, item_names=("items",)) as stock:
        assert stock.all_steps() == [1, 2]


def test_v1_checkpointer_on_gs_equals_the_same_run_on_disk(gs_prefix, tmp_path):
    """MaxText 0.2.5's loop through v1: load the latest step, save at its ``step``."""
    from orbax.checkpoint import v1 as ocp1

    from orbax_maxtext_layout.training import Checkpointer

    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev),
        oml.Target.from_checkpoint(TEMPLATE).items(),
    )
    policy = ocp1.training.save_decision_policies.FixedIntervalPolicy(interval=1)

    def run(root) -> list[int]:
        with Checkpointer(root, save_decision_policy=policy, remove_legacy=True) as ckptr:
            restored = ckptr.load_checkpointables(ckptr.latest.step, {"items": abstract})
            items = restored["items"]
            assert ckptr.save_checkpointables(int(items["step"]), {"items": items})
            ckptr.wait()
            return [c.step for c in ckptr.checkpoints]

    local = tmp_path / "run"
    shutil.copytree(TUNIX_RUN, local)
    remote = gs_prefix.upload(TUNIX_RUN, "run")
    assert run(local / ACTOR) == run(remote / ACTOR) == [1, 2]
    invalidate_gcsfs_caches()
    for name in ("1", "2"):
        step = remote / ACTOR / name
        assert oml.detect_layout(step) is oml.Layout.MAXTEXT
        assert restored_leaves(step / "items") == restored_leaves(local / ACTOR / name / "items")
    assert _leftovers(gs_prefix, "run/" + ACTOR) == []
    with ocp1.training.Checkpointer(remote / ACTOR) as stock:
        assert [c.step for c in stock.checkpoints] == [1, 2]


# -- a move killed at each phase -----------------------------------------------------------
def _killed_move(tmp_path: Path, phase: str) -> Path:
    """A local copy of the run as `objstore.move_dir` of Tunix ``2`` to ``1`` leaves it when
    killed in ``phase`` (the manager had recorded the Tunix step number first)."""
    run = tmp_path / phase / "run"
    shutil.copytree(TUNIX_RUN, run)
    src, dst = run / ACTOR / "2", run / ACTOR / "1"
    meta = json.loads((src / "_CHECKPOINT_METADATA").read_text())
    meta = stepmeta.with_tunix_step(meta, 2)
    (src / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
    dst.mkdir()
    (dst / objstore.MOVING).write_text(json.dumps({"from": "2"}))
    if phase == "copying":  # some objects copied, no commit marker yet
        shutil.copy(src / "_CHECKPOINT_METADATA", dst)
        shutil.copytree(src / "model_params", dst / "model_params")
    else:
        for child in src.iterdir():
            (shutil.copytree if child.is_dir() else shutil.copy)(child, dst / child.name)
        if phase == "deleting":  # the source's marker and part of it already deleted
            (src / "commit_success.txt").unlink()
            shutil.rmtree(src / "optimizer_state")
    return run


def test_a_finished_move_is_seen_by_orbax_in_the_same_process(gs_prefix, tmp_path, reference):
    """The manager finishes a move killed while deleting its source, then saves into the
    source's directory: Orbax (through epath's own gcsfs instance, which had listed the
    half-deleted source) must see it gone. Found by the SIGKILL campaign below."""
    remote = gs_prefix.upload(_killed_move(tmp_path, "deleting"), "run")
    actor = remote / ACTOR
    # epath lists the run: its gcsfs instance caches "2" (and what is left in it)
    assert [s.step for s in oml.find_steps(actor)] == [1, 2]
    assert sorted(p.name for p in (actor / "2").iterdir()) == [
        "_CHECKPOINT_METADATA",
        "model_params",
    ]
    assert cycle(str(actor), str(TEMPLATE)) == [1, 2]
    invalidate_gcsfs_caches()
    assert restored_leaves(actor / "1" / "items") == reference


@pytest.mark.parametrize("driver", ["manager", "convert"])
@pytest.mark.parametrize("phase", ["copying", "copied", "deleting"])
def test_a_killed_move_is_finished_or_rolled_back(gs_prefix, tmp_path, reference, phase, driver):
    gs_prefix.upload(TUNIX_RUN, "pristine")
    pristine = _legacy_objects(gs_prefix, "pristine/" + ACTOR + "/2")
    remote = gs_prefix.upload(_killed_move(tmp_path, phase), "run")
    actor = remote / ACTOR
    # What the kill left reads as one legacy step: an uncommitted copy is no step, and
    # a committed copy is the step (its source, if still committed, a twin of it).
    committed = [d for d in ("1", "2") if oml.detect_layout(actor / d) is oml.Layout.TUNIX]
    assert committed == {"copying": ["2"], "copied": ["1", "2"], "deleting": ["1"]}[phase]
    if driver == "manager":
        with oml.CheckpointManager(actor, item_names=("items",)) as mngr:
            assert mngr.all_steps() == [1]  # the move finished or rolled back at listing
        invalidate_gcsfs_caches()
        holder = "2" if phase == "copying" else "1"
        assert _tops(gs_prefix, "run/" + ACTOR) == {holder}
        assert _legacy_objects(gs_prefix, f"run/{ACTOR}/{holder}") == pristine
        assert not objstore.finish_move(actor / "1")
    else:
        argv = ["convert", str(remote / "checkpoints"), "--target-from", str(TEMPLATE), "-q"]
        assert main(argv) == 0
        invalidate_gcsfs_caches()
        assert _tops(gs_prefix, "run/" + ACTOR) == {"1"}
        assert oml.detect_layout(actor / "1") is oml.Layout.MAXTEXT
        assert restored_leaves(actor / "1" / "items") == reference
    assert not [k for k in gs_prefix.objects("run") if objstore.MOVING in k]


def test_debris_where_the_legacy_step_moves_is_replaced(gs_prefix, tmp_path, reference):
    """Objects without a commit marker where the step moves (say, a dead client's last
    requests, landed late) are not a step: the move replaces them, as Orbax replaces a
    step directory it saves."""
    run = tmp_path / "run"
    shutil.copytree(TUNIX_RUN, run)
    (run / ACTOR / "1" / "model_params").mkdir(parents=True)
    shutil.copy(
        run / ACTOR / "2" / "model_params" / "_METADATA", run / ACTOR / "1" / "model_params"
    )
    remote = gs_prefix.upload(run, "run")
    assert cycle(str(remote / ACTOR), str(TEMPLATE)) == [1, 2]
    invalidate_gcsfs_caches()
    for name in ("1", "2"):
        assert restored_leaves(remote / ACTOR / name / "items") == reference
    assert _leftovers(gs_prefix, "run/" + ACTOR) == []


# -- SIGKILLs during the manager's migration --------------------------------------------------
def _job(gcs_emulator, actor, kill_after: float | None = None) -> subprocess.CompletedProcess:
    """The job (`manager_job.run`) as its script runs it, in a child forked from the
    reliability suite's server (`forked_cli.run_call`: imports done, so the kill times are
    drawn over the job, not an interpreter's start); SIGKILL after ``kill_after`` s."""
    return run_call(
        f"{JOB}:run",
        directory=str(actor),
        template=str(TEMPLATE),
        env=gcs_emulator.env(),
        kill_after=kill_after,
    )


def _after_kill(gs_prefix, rel: str, pristine: dict, reference: dict) -> str:
    """Checks the state a kill left; returns where the Tunix step is."""
    actor = gs_prefix.path(rel)
    holders = []
    for name in sorted(_tops(gs_prefix, rel)):
        layout = oml.detect_layout(actor / name)
        if layout is oml.Layout.MAXTEXT:  # accepted as items: then complete
            assert restored_leaves(actor / name / "items") == reference, name
            holders += [f"{name}:items"] if name == "1" else []
        elif layout is oml.Layout.TUNIX:  # accepted as legacy: then intact
            assert _legacy_objects(gs_prefix, f"{rel}/{name}") == pristine, name
            holders.append(f"{name}:legacy")
        else:  # not a step: nobody lists it (no commit marker)
            assert not (actor / name / "commit_success.txt").exists(), name
    with ocp.CheckpointManager(actor, item_names=("items",)) as stock:
        listed = stock.all_steps()  # stock Orbax lists only steps that read as one of both
    assert all(oml.detect_layout(actor / str(s)) is not oml.Layout.UNKNOWN for s in listed)
    assert holders, f"the Tunix step is in no directory: {sorted(_tops(gs_prefix, rel))}"
    return "+".join(holders)


@pytest.mark.slow  # the slow pass (.ci/run): a kill campaign against the emulator
def test_sigkill_during_the_manager_migration_on_gs(gcs_emulator, gs_prefix, reference):
    gs_prefix.upload(TUNIX_RUN, "pristine")
    pristine = _legacy_objects(gs_prefix, "pristine/" + ACTOR + "/2")
    run = gs_prefix.upload(TUNIX_RUN, "timing")
    t = time.perf_counter()
    timing = _job(gcs_emulator, run / ACTOR)
    assert timing.returncode == 0, timing.stderr[-2000:]
    total = time.perf_counter() - t
    rng = random.Random(f"{SEED}-gs-manager")
    outcomes: dict[str, int] = {}
    for i in range(KILLS):
        rel = f"k{i}"
        run = gs_prefix.upload(TUNIX_RUN, rel)
        _job(gcs_emulator, run / ACTOR, kill_after=rng.uniform(0, total))
        gcs_emulator.wait_idle()  # requests the dead client had sent still land
        invalidate_gcsfs_caches()
        where = _after_kill(gs_prefix, f"{rel}/{ACTOR}", pristine, reference)
        outcomes[where] = outcomes.get(where, 0) + 1
        # The rerun (the same job, in this process) completes whatever the kill left.
        steps = cycle(str(run / ACTOR), str(TEMPLATE))
        invalidate_gcsfs_caches()
        assert 1 in steps, (i, steps)
        for s in steps:  # the migrated step and every save hold the Tunix step's state
            assert oml.detect_layout(run / ACTOR / str(s)) is oml.Layout.MAXTEXT, (i, s)
            assert restored_leaves(run / ACTOR / str(s) / "items") == reference, (i, s)
        assert _leftovers(gs_prefix, f"{rel}/{ACTOR}") == [], i
    print(f"manager on gs: {KILLS} kills, {outcomes}")
