"""`orbax_maxtext_layout.maxtext` without MaxText installed (the interop suite runs it with
MaxText 0.2.5), and the step metadata after a legacy removal."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import MAXTEXT_NATIVE, RL_ACTOR_STEPS, copy_fixture

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.maxtext import install, is_tunix_path

HAS_MAXTEXT = importlib.util.find_spec("maxtext") is not None


@pytest.mark.skipif(HAS_MAXTEXT, reason="MaxText is installed here (interop suite covers it)")
def test_install_without_maxtext_says_what_is_missing():
    with pytest.raises(ImportError, match=r"maxtext 0\.2\.5"):
        install()
    res = subprocess.run(
        [sys.executable, "-m", "orbax_maxtext_layout.maxtext", "some.module"],
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and "maxtext 0.2.5" in res.stderr


def test_the_runner_without_arguments_prints_its_usage():
    res = subprocess.run(
        [sys.executable, "-m", "orbax_maxtext_layout.maxtext"], capture_output=True, text=True
    )
    assert res.returncode == 2 and "python -m orbax_maxtext_layout.maxtext" in res.stderr


def test_the_package_never_imports_maxtext():
    code = (
        "import sys, orbax_maxtext_layout.cli, orbax_maxtext_layout.maxtext, "
        "orbax_maxtext_layout.training\n"
        "print(any(m == 'maxtext' or m.startswith('maxtext.') for m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_tunix_paths_are_told_from_maxtext_ones(tmp_path):
    step = copy_fixture(RL_ACTOR_STEPS["tunix017_rl"], tmp_path)
    assert is_tunix_path(step / "model_params")
    assert is_tunix_path(step) and is_tunix_path(step / "items")  # items not written yet
    assert not is_tunix_path(MAXTEXT_NATIVE) and not is_tunix_path(MAXTEXT_NATIVE / "items")


def test_item_handlers_follow_the_legacy_removal(tmp_path):
    step = copy_fixture(RL_ACTOR_STEPS["tunix017_rl"], tmp_path)

    def handlers():
        return json.loads((step / "_CHECKPOINT_METADATA").read_text())["item_handlers"]

    assert set(handlers()) == {"model_params", "optimizer_state"}
    oml.convert_step(step, oml.Target.from_checkpoint(MAXTEXT_NATIVE))
    assert set(handlers()) == {"model_params", "optimizer_state", "items"}
    oml.convert_step(step, oml.Target.from_checkpoint(MAXTEXT_NATIVE), remove_legacy=True)
    assert not (step / "model_params").exists()
    assert set(handlers()) == {"items"}
