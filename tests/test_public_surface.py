"""The public surface, listed: every name a user imports, every command and option of the CLI,
and the entry points. Moving the package's rooms (docs/design.md) must leave all of it where
it was; this test fails on any name, command or option that moved, vanished or appeared
unlisted."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import orbax_maxtext_layout as oml
from orbax_maxtext_layout import cli

ROOT = Path(__file__).resolve().parent.parent

PACKAGE_ALL = [
    "EXAMPLES_DIR", "KNOWN_INTERMEDIATES", "SCAN_GROUPS", "TUNIX_STEP_KEY", "AdapterReport",
    "CheckpointManager", "CheckpointReadError", "ConvertOptions", "Dest", "Drop", "ExportOptions",
    "ExportReport", "ImportOptions", "ImportReport", "LayerMap",
    "Layout", "LayoutMismatchError", "LeafSpec", "LoraAdapterStepError", "LoraAdapters",
    "MaxTextLayoutHandler", "MaxTextLayoutRestore", "MaxTextLayoutSave", "MergeOptions",
    "MergeReport", "Move",
    "Op", "OrbaxMaxTextLayoutError", "Plan", "ReadOnlyStepError", "StackReport",
    "StepExistsError", "StepInfo", "StepLocked", "StepReport", "Target", "UsageError",
    "VerifyResult", "__version__", "apply_op", "convert_step", "converted_provenance",
    "detect_layout", "export_hf", "find_steps", "import_hf", "layer_map", "load_params_from_path",
    "make_plan", "maxtext_forms", "maxtext_opt_state", "merge_lora", "narrow", "plan_export",
    "plan_maxtext_step", "plan_merge", "plan_step", "read_specs", "replay_plan",
    "restore_as_items", "scan_axes", "stack", "stack_target", "to_maxtext_items",
    "tunix_step_number", "unroll", "unroll_target", "unstack_layer", "verify_step",
]  # fmt: skip

PUBLIC_MODULES = {
    "orbax_maxtext_layout.training": ["Checkpointer"],
    "orbax_maxtext_layout.maxtext": ["install", "main", "run"],
    "orbax_maxtext_layout.paths": [
        "FlatTree", "Path", "children", "flatten", "keystr", "norm_key", "unflatten",
    ],
    "orbax_maxtext_layout.cli": ["main", "build_parser", "parse_size"],
}  # fmt: skip

COMMANDS = {
    "convert": (["root"], [
        "--copy", "--dry-run", "--follow-symlinks", "--help", "--ignore", "--in-place", "--json",
        "--keep-step-numbers", "--maxtext-config", "--memory-budget", "--optimizer", "--out",
        "--plain-scan", "--quiet", "--remove-legacy", "--stack", "--steps", "--target",
        "--target-from", "--unroll", "--verbose", "-h", "-q", "-v",
    ]),
    "demo": ([], ["--help", "--out", "-h"]),
    "export-hf": (["step"], [
        "--adapter", "--alpha", "--base", "--base-model-name-or-path", "--dry-run", "--help",
        "--hf-model-path", "--json", "--max-shard-size", "--maxtext-config", "--memory-budget",
        "--out", "--override-model-architecture", "--process-count", "--process-index", "-h",
    ]),
    "import-hf": (["hf_dir"], [
        "--adapter", "--as-lora", "--base", "--dry-run", "--help", "--json", "--maxtext-config", "--memory-budget", "--out",
        "--save-dtype", "-h",
    ]),
    "inspect": (["path"], [
        "--help", "--json", "--maxtext-config", "--target", "--target-from", "-h",
    ]),
    "merge-lora": (["adapter_step"], [
        "--alpha", "--base", "--dry-run", "--help", "--json", "--maxtext-config",
        "--memory-budget", "--out", "--plain-scan", "--scan-axis", "--stack", "--target",
        "--target-from", "--unroll", "-h",
    ]),
    "verify": (["root"], ["--help", "--json", "--quick", "-h"]),
}  # fmt: skip


def test_the_package_exports_exactly_its_listed_names() -> None:
    assert sorted(oml.__all__) == sorted(PACKAGE_ALL)
    for name in PACKAGE_ALL:
        assert getattr(oml, name) is not None, name


@pytest.mark.parametrize("module", sorted(PUBLIC_MODULES))
def test_public_modules_keep_their_names(module: str) -> None:
    mod = importlib.import_module(module)
    for name in PUBLIC_MODULES[module]:
        assert callable(getattr(mod, name)) or isinstance(getattr(mod, name), type), name


def test_the_v1_checkpointer_is_orbax_s_with_the_library_s_manager() -> None:
    from orbax.checkpoint.experimental import v1 as ocp1

    from orbax_maxtext_layout.training import Checkpointer

    assert issubclass(Checkpointer, ocp1.training.Checkpointer)


def _commands(parser: argparse.ArgumentParser) -> dict:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                opts = sorted(o for a in sub._actions for o in a.option_strings)
                out[name] = ([a.dest for a in sub._actions if not a.option_strings], opts)
    return out


def test_every_command_keeps_its_arguments_and_options() -> None:
    assert _commands(cli.build_parser()) == COMMANDS


def test_exit_codes_are_where_they_were() -> None:
    assert cli.NOTHING_VERIFIED == 3
    assert cli.main(["verify", str(ROOT / "no-such-run")]) != 0
    with pytest.raises(SystemExit) as usage:
        cli.main(["convert"])  # no root: argparse's usage error
    assert usage.value.code == 2


def test_the_entry_points_still_point_at_the_faces() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {"orbax-maxtext-layout": "orbax_maxtext_layout.cli:run"}
    for module in ("orbax_maxtext_layout", "orbax_maxtext_layout.maxtext"):
        done = subprocess.run(
            [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 or "usage" in (done.stdout + done.stderr).lower(), done
