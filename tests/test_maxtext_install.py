"""`orbax_maxtext_layout.maxtext` without MaxText installed (the interop suite runs it with
MaxText 0.2.5), and the step metadata after a legacy removal."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MAXTEXT_NATIVE, RL_ACTOR_STEPS, child_env, copy_fixture, tree_digest

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.maxtext import install, is_tunix_path

HAS_MAXTEXT = importlib.util.find_spec("maxtext") is not None
ROOT = Path(__file__).parent.parent


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


# A trainer's stand-in: its main asks the library for a LoRA adapter step as a model (as MaxText's
# ``load_params_from_path`` does through the runner), which the library refuses; or fails
# with an error of its own.
TRAINER = """
import sys

import orbax_maxtext_layout as oml


def main():
    what, step, native = sys.argv[1:]
    if what == "lora":
        params = oml.Target.from_checkpoint(native).items()["params"]
        oml.load_params_from_path(step + "/model_params", params)
    else:
        int(what)


if __name__ == "__main__":
    main()
"""


def _run_trainer(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``orbax_maxtext_layout.maxtext.run("trainer", args)``, the runner's work once MaxText
    is patched, in a process of its own (the trainer exits it)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "trainer.py").write_text(TRAINER)
    code = "import sys\nfrom orbax_maxtext_layout.maxtext import run\nrun('trainer', sys.argv[1:])"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env({"PYTHONPATH": str(tmp_path / "site")}),
        timeout=300,
    )


def test_the_runner_prints_a_refusal_as_one_message_and_exits_1(tmp_path):
    step = copy_fixture("tunix017/sft_lora_run/checkpoints/1", tmp_path)
    before = tree_digest(step.parent)
    params = oml.Target.from_checkpoint(MAXTEXT_NATIVE).items()["params"]
    with pytest.raises(oml.LoraAdapterStepError) as refusal:
        oml.load_params_from_path(str(step / "model_params"), params)
    res = _run_trainer(tmp_path, "lora", str(step), str(MAXTEXT_NATIVE))
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stderr.endswith(f"error: {refusal.value}\n"), res.stderr
    assert res.stderr.count("error: ") == 1 and "merge-lora" in res.stderr
    assert tree_digest(step.parent) == before


def test_the_runner_leaves_other_errors_their_traceback(tmp_path):
    res = _run_trainer(tmp_path, "not-a-number", "-", "-")
    assert res.returncode == 1
    assert "Traceback" in res.stderr and "ValueError: invalid literal" in res.stderr
    assert "error: " not in res.stderr
