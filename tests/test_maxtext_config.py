"""``--maxtext-config`` without MaxText (the core suite's Python has none; the interop suite,
tests/interop/test_maxtext_config.py, builds targets with MaxText 0.2.5): a usage error that
says what to install, for every command that takes a target, and nothing written."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
from conftest import SFT_STEPS, copy_fixture, tree_digest
from forked_cli import run_cli

from orbax_maxtext_layout import Target

HAS_MAXTEXT = importlib.util.find_spec("maxtext") is not None
pytestmark = pytest.mark.skipif(HAS_MAXTEXT, reason="MaxText is installed (the interop suite)")
CONFIG = ["configs/base.yml", "model_name=llama3.1-8b", "scan_layers=true"]
INSTALL = ("maxtext 0.2.5", "Python 3.12", "--target-from")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The command in ``cwd``, JAX_PLATFORMS unset (`forked_cli.run_cli`: forked from a warm
    interpreter, with the environment and exit code of ``python -m orbax_maxtext_layout``)."""
    return run_cli(*args, cwd=cwd, env={"JAX_PLATFORMS": None})


@pytest.fixture
def work(tmp_path) -> tuple[Path, Path]:
    """A cwd and a run root holding a Tunix step."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    copy_fixture(SFT_STEPS["tunix017_sft"], tmp_path)
    return cwd, tmp_path / SFT_STEPS["tunix017_sft"]


@pytest.mark.parametrize(
    "args",
    [
        ["convert", "{root}", "--maxtext-config", *CONFIG],
        ["convert", "{root}", "--maxtext-config", CONFIG[0]],
        # the root after the option's values is a positional argument all the same
        ["convert", "--dry-run", "--maxtext-config", *CONFIG, "{root}", "--json"],
        ["inspect", "{root}", "--maxtext-config", *CONFIG, "--json"],
        ["merge-lora", "{root}", "--base", "{root}", "--out", "{out}", "--maxtext-config", *CONFIG],
    ],
    ids=["convert", "convert-config-only", "convert-root-last", "inspect", "merge-lora"],
)
def test_without_maxtext_it_exits_2_saying_what_to_install(work, args):
    cwd, step = work
    before = tree_digest(step.parent)
    res = cli(*(a.format(root=step.parent, out=cwd / "merged") for a in args), cwd=cwd)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "error: cannot build the target" in res.stderr
    assert all(s in res.stderr for s in INSTALL), res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert tree_digest(step.parent) == before and list(cwd.iterdir()) == []


def test_the_api_raises_import_error_saying_what_to_install():
    with pytest.raises(ImportError, match=r"maxtext 0\.2\.5 \(it needs Python 3\.12\)"):
        Target.from_maxtext_config(CONFIG)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--maxtext-config", "base.yaml"], "'base.yaml' is not a MaxText config file (.yml)"),
        (
            ["--maxtext-config", *CONFIG, "--target-from", "X"],
            "argument --target-from: not allowed with argument --maxtext-config",
        ),
        (["--maxtext-config"], "expected at least one argument"),
    ],
    ids=["not-yml", "with-target-from", "no-value"],
)
def test_usage_errors(work, args, message):
    cwd, step = work
    res = cli("convert", step.parent, *args, cwd=cwd)
    assert res.returncode == 2 and message in res.stderr, res.stderr
