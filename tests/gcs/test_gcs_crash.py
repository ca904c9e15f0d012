"""SIGKILL of `convert` on gs:// at seeded random times: afterwards the step reads as legacy
or as complete items, never as a half items/ that anyone accepts; a rerun completes.

Each killed `convert` is the command line in a child forked from the reliability suite's
server (`forked_cli.run_cli`: JAX, Orbax and the package imported, no backend, no
tensorstore, no gcsfs touched), as the disk campaigns run it: the kill times are drawn over
the conversion itself, not over an interpreter's start, which took most of a fresh process's
time here."""

from __future__ import annotations

import os
import random
import shutil
import time

import pytest
from forked_cli import run_cli

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.cli import main
from orbax_maxtext_layout.storage import objstore

from .conftest import restored_leaves
from .emulator import invalidate_gcsfs_caches

EXAMPLES = oml.EXAMPLES_DIR
STEP = "checkpoints/actor/2"
TARGET = EXAMPLES / "maxtext_run" / "checkpoints" / "2"
KILLS = {"copy": 20, "in_place": 10}  # OMTL_GCS_KILLS=N sets both
SEED = int(os.environ.get("OMTL_RELIABILITY_SEED", "20261201"))


def _convert(gcs_emulator, root, *extra, kill_after: float | None = None):
    """``convert ROOT`` as the command line runs it, in a forked child (SIGKILL after
    ``kill_after`` seconds from the fork, unless it has exited)."""
    args = ["convert", str(root), "--target-from", str(TARGET), "-q", "--keep-step-numbers"]
    return run_cli(*args, *extra, env=gcs_emulator.env(), kill_after=kill_after)


def _legacy(gs_prefix, rel: str) -> dict[str, int]:
    return {
        k: v
        for k, v in gs_prefix.objects(rel).items()
        if k.split("/")[0] in ("model_params", "optimizer_state")
    }


@pytest.mark.slow  # the slow pass (.ci/run): a kill campaign against the emulator
@pytest.mark.parametrize("mode", ["copy", "in_place"])
def test_sigkill_during_a_gs_conversion(gcs_emulator, gs_prefix, tmp_path, mode):
    extra = ["--in-place"] if mode == "in_place" else []
    local = tmp_path / "ref" / "run"
    shutil.copytree(EXAMPLES / "tunix_rl_run", local)
    oml.convert_step(local / STEP, oml.Target.from_checkpoint(TARGET))
    reference = restored_leaves(local / STEP / "items")

    # How long an uninterrupted run takes: kills land between start and that.
    run = gs_prefix.upload(EXAMPLES / "tunix_rl_run", "timing")
    t = time.perf_counter()
    timing = _convert(gcs_emulator, run / "checkpoints", *extra)
    assert timing.returncode == 0, timing.stderr[-2000:]
    total = time.perf_counter() - t
    rng = random.Random(f"{SEED}-{mode}")
    outcomes = {"legacy": 0, "converted": 0}
    kills = int(os.environ.get("OMTL_GCS_KILLS", KILLS[mode]))
    for i in range(kills):
        rel = f"k{i}"
        run = gs_prefix.upload(EXAMPLES / "tunix_rl_run", rel)
        legacy_before = _legacy(gs_prefix, f"{rel}/{STEP}")
        _convert(gcs_emulator, run / "checkpoints", *extra, kill_after=rng.uniform(0, total))
        gcs_emulator.wait_idle()  # requests the dead client had sent still land
        invalidate_gcsfs_caches()
        objstore.refresh(run)
        step = run / STEP
        layout = oml.detect_layout(step)
        assert layout in (oml.Layout.TUNIX, oml.Layout.MAXTEXT), (i, layout)
        if layout is oml.Layout.MAXTEXT:  # accepted as converted: then it is complete
            assert restored_leaves(step / "items") == reference, i
            outcomes["converted"] += 1
        else:  # still legacy: legacy items intact (nothing is deleted before the commit)
            assert _legacy(gs_prefix, f"{rel}/{STEP}") == legacy_before, i
            outcomes["legacy"] += 1
        # The rerun (in this process: the same command) completes, whatever the kill left.
        argv = ["convert", str(run / "checkpoints"), "--target-from", str(TARGET), "-q"]
        assert main([*argv, "--keep-step-numbers", *extra]) == 0, i
        invalidate_gcsfs_caches()
        assert oml.detect_layout(step) is oml.Layout.MAXTEXT
        assert restored_leaves(step / "items") == reference, i
        left = {k for k in gs_prefix.objects(f"{rel}/{STEP}") if k.endswith(".lock")}
        assert not left, (i, left)
        if mode == "in_place":
            assert not _legacy(gs_prefix, f"{rel}/{STEP}"), i
    print(f"{mode}: {kills} kills, {outcomes}")
