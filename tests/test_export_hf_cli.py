"""export-hf's refusals that come before MaxText is needed, through the real CLI.

The export itself runs MaxText's own mappings; it is tested against MaxText's
``to_huggingface`` in tests/interop/test_export_hf*.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import copy_fixture, tree_digest

from orbax_maxtext_layout import cli

LORA = "maxtext025/lora_run/checkpoints/2"
BASE = "maxtext025/pretrain_run/checkpoints/1"
CONFIG = ["--maxtext-config", "base.yml", "model_name=llama3.1-8b"]
HAS_MAXTEXT = importlib.util.find_spec("maxtext") is not None


def _nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not out.with_name(out.name + ".export-hf-tmp").exists()


def test_an_adapter_step_without_base_is_refused_naming_base_and_merge_lora(tmp_path, capsys):
    step = copy_fixture(LORA, tmp_path)
    before = tree_digest(step)
    out = tmp_path / "hf"
    rc = cli.main(["export-hf", str(step), "--out", str(out), *CONFIG])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "--base" in err and "merge-lora" in err and str(step) in err
    _nothing_written(out)
    assert tree_digest(step) == before


def test_base_for_a_step_that_is_not_an_adapter_step_is_a_usage_error(tmp_path, capsys):
    step = copy_fixture(BASE, tmp_path)
    out = tmp_path / "hf"
    rc = cli.main(["export-hf", str(step), "--out", str(out), "--base", str(step), *CONFIG])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "not a LoRA adapter step" in err
    _nothing_written(out)


def test_an_out_that_holds_files_is_refused(tmp_path, capsys):
    step = copy_fixture(BASE, tmp_path)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    rc = cli.main(["export-hf", str(step), "--out", str(out), *CONFIG])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "already holds files" in err
    assert [p.name for p in out.iterdir()] == ["config.json"]


@pytest.mark.skipif(HAS_MAXTEXT, reason="MaxText is installed here")
def test_without_maxtext_export_hf_says_what_to_install(tmp_path, capsys):
    step = copy_fixture(BASE, tmp_path)
    out = tmp_path / "hf"
    rc = cli.main(["export-hf", str(step), "--out", str(out), *CONFIG])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "maxtext 0.2.5" in err and "orbax-maxtext-layout[maxtext]" in err
    _nothing_written(out)


def test_maxtext_config_is_required(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["export-hf", str(tmp_path), "--out", str(tmp_path / "hf")])
    assert e.value.code == 2
    assert "--maxtext-config" in capsys.readouterr().err
