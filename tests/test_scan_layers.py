"""Every step this library writes records ``custom_metadata["scan_layers"]``, the scan form
written, as MaxText's own ``save_checkpoint`` does (its `verify_and_sync_scan_layers` reads
it); the step's other custom metadata stays as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import MAXTEXT_NATIVE, RL_ACTOR_STEPS, copy_fixture
from test_lora import _llama

import orbax_maxtext_layout as oml

RL = RL_ACTOR_STEPS["tunix017_rl"]
DPO = "tunix017/dpo_run/checkpoints/1"  # unscanned


def _custom(step: Path) -> dict:
    return json.loads((Path(step) / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]


@pytest.mark.parametrize(
    "how",
    ["default", "in_place", "out", "unroll", "unroll_out"],
)
def test_convert_records_the_scan_form_it_writes(tmp_path, how):
    scanned = oml.Target.from_checkpoint(MAXTEXT_NATIVE)
    step = copy_fixture(RL, tmp_path)
    before = _custom(step)
    assert "scan_layers" not in before  # Tunix never records it
    unroll = how.startswith("unroll")
    target = oml.unroll_target(scanned) if unroll else scanned
    out = tmp_path / "out" / "1" if how.endswith("out") else None
    report = oml.convert_step(
        step,
        target,
        in_place=how == "in_place",
        out=out,
        rescan="unroll" if unroll else None,
    )
    assert report.status == "converted", report.notes
    custom = _custom(out or step)
    assert custom["scan_layers"] is (not unroll)
    # the rest of the step's custom metadata (Tunix's global_step, role) is kept
    assert {k: v for k, v in custom.items() if k in before} == before


def test_stack_records_scanned(tmp_path):
    target = oml.Target.from_checkpoint(MAXTEXT_NATIVE).without_optimizer()
    step = copy_fixture(DPO, tmp_path)
    report = oml.convert_step(step, target, rescan="stack", optimizer="drop")
    assert report.status == "converted"
    assert _custom(step)["scan_layers"] is True


@pytest.mark.parametrize("scan", [None, "unroll"])
def test_merge_lora_records_the_scan_form_it_writes(tmp_path, scan):
    _, _, base, adapters = _llama(tmp_path)
    out = tmp_path / "merged"
    oml.merge_lora(adapters, base, alpha=8, out=out, scan=scan)
    assert _custom(out / "0")["scan_layers"] is (scan is None)
