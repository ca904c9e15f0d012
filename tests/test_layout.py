"""Step discovery and layout detection on real directory trees."""

from __future__ import annotations

import shutil

import pytest
from conftest import FIXTURES, copy_fixture

from orbax_maxtext_layout import Layout, detect_layout, find_steps
from orbax_maxtext_layout.orbax_io.layout import step_dir_of


def test_detects_each_fixture_layout_from_directories_only():
    assert detect_layout(FIXTURES / "maxtext_native/run/checkpoints/2") is Layout.MAXTEXT
    assert detect_layout(FIXTURES / "tunix017/rl_run/checkpoints/actor/2") is Layout.TUNIX
    assert (
        detect_layout(FIXTURES / "tunix_snapshot_v1/sft_model_only/checkpoints/1") is Layout.TUNIX
    )
    assert detect_layout(FIXTURES / "tunix017/rl_run/checkpoints") is Layout.UNKNOWN


def test_v0_and_v1_writers_are_detected_alike_despite_different_typestrs():
    v0 = FIXTURES / "tunix017/rl_run/checkpoints/actor/2"
    v1 = FIXTURES / "tunix_snapshot_v1/rl_run/checkpoints/actor/2"
    assert "v1" not in (v0 / "_CHECKPOINT_METADATA").read_text()
    assert "experimental.v1" in (v1 / "_CHECKPOINT_METADATA").read_text()
    assert detect_layout(v0) is detect_layout(v1) is Layout.TUNIX


def test_find_steps_roles_tmp_dirs_and_noise(tmp_path):
    root = tmp_path / "checkpoints"
    src = FIXTURES / "tunix017/sft_run/checkpoints/1"
    for rel in ["3", "10", "actor/2", "actor/7", "critic/4"]:
        shutil.copytree(src, root / rel)
    shutil.copytree(src, root / "5.orbax-checkpoint-tmp-123")  # interrupted save
    shutil.copytree(src, root / "actor" / "8.orbax-checkpoint-tmp-9")
    (root / "not_a_step").mkdir()
    (root / "12").write_text("a file, not a step")
    (root / "metrics").mkdir()
    (root / "20").mkdir()  # numeric but empty: listed, layout UNKNOWN
    got = [(s.role, s.step, s.layout) for s in find_steps(root)]
    assert got == [
        (None, 3, Layout.TUNIX),
        (None, 10, Layout.TUNIX),
        (None, 20, Layout.UNKNOWN),
        ("actor", 2, Layout.TUNIX),
        ("actor", 7, Layout.TUNIX),
        ("critic", 4, Layout.TUNIX),
    ]


def test_converted_step_is_maxtext(tmp_path):
    step = copy_fixture("tunix017/rl_run/checkpoints/actor/2", tmp_path)
    shutil.copytree(FIXTURES / "maxtext_native/run/checkpoints/2/items", step / "items")
    assert detect_layout(step) is Layout.MAXTEXT


@pytest.mark.parametrize("leaf", ["items", "model_params", "optimizer_state", ""])
def test_step_dir_of(tmp_path, leaf):
    assert step_dir_of(tmp_path / "7" / leaf if leaf else tmp_path / "7") == tmp_path / "7"
