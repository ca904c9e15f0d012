"""Interop: ``convert STEP --unroll|--stack --target-from OTHER --out DIR`` of MaxText 0.2.5's
own steps (issue 41, item 3), judged by MaxText's own ``to_huggingface``.

A model's Hugging Face weights do not depend on its scan form, so MaxText's export of the
rescanned output (in the written form) must equal, tensor for tensor (names, shapes, dtypes,
bytes), its export of the source step (in the source's form). Neither command line names
``scan_layers``: MaxText takes each step's form from the ``scan_layers`` its metadata records
(`verify_and_sync_scan_layers`), the output's as this library wrote it; the log of each
unscanned output's export says so (base.yml says ``scan_layers: true``). Families: the plain llama scan both ways, gemma3's block scans and
mixtral's MoE experts (``--unroll``). The sources are the frozen pre-training steps of
tests/fixtures/maxtext025 (MaxText's pre-training loop), each converted against MaxText's
step of the other form; every output also passes ``verify`` against its source.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import hf_export_support as S
import maxtext_loop_support as L
import pytest

from orbax_maxtext_layout import cli

GEN = L.generator()


def _keys(keys: list[str]) -> list[str]:
    return [k for k in keys if not k.startswith("scan_layers=")]


# name -> (source step, MaxText's step of the other form, the family's model keys, the change)
CASES = {
    "llama_unroll": (
        "pretrain_run/checkpoints/1",
        "pretrain_unscanned_run/checkpoints/0",
        _keys(GEN.MODEL_KEYS),
        "unroll",
    ),
    "llama_stack": (
        "pretrain_unscanned_run/checkpoints/0",
        "pretrain_run/checkpoints/1",
        _keys(GEN.MODEL_KEYS),
        "stack",
    ),
    "gemma3_unroll": (
        "gemma3_pretrain_run/checkpoints/0",
        "gemma3_pretrain_unscanned_run/checkpoints/0",
        _keys(GEN.GEMMA3_MODEL_KEYS),
        "unroll",
    ),
    "mixtral_unroll": (
        "mixtral_pretrain_run/checkpoints/0",
        "mixtral_pretrain_unscanned_run/checkpoints/0",
        _keys(GEN.MIXTRAL_MODEL_KEYS),
        "unroll",
    ),
}


def main(*args: object) -> tuple[int, str]:
    """The command line in-process: its exit code and output."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = cli.main([*map(str, args)])
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, object]:
    """``<case>``: the conversion's exit code and output, ``<case>_verify``: ``verify``'s,
    ``<case>_out``: the output step; ``hf``: MaxText's ``to_huggingface`` of every source
    (``<case>_source``) and output (``<case>_output``), two at a time."""
    work = tmp_path_factory.mktemp("maxtext_rescan")
    tokenizer = S.write_tokenizer(work / "tokenizer")
    out: dict[str, object] = {}
    jobs = []
    for name, (source, other, keys, change) in CASES.items():
        step = L.copy_tree(L.FIXTURE / source, work / name / "source" / Path(source).name)
        dest = work / name / "out" / step.name
        target = L.FIXTURE / other
        out[name] = main("convert", step, f"--{change}", "--target-from", target, "--out", dest)
        out[f"{name}_verify"] = main("verify", dest.parent)
        out[f"{name}_out"] = dest
        for what, items in (("source", step / "items"), ("output", dest / "items")):
            hf = work / "hf" / f"{name}_{what}"
            jobs.append(S.export_job(f"{name}_{what}", items, hf, tokenizer, keys=keys))
    out["hf"] = S.run_all(jobs)
    return out


@pytest.mark.parametrize("case", CASES)
def test_convert_writes_the_other_form_and_verify_replays_it(case, outputs):
    rc, text = outputs[case]
    assert rc == 0, text
    assert "converted (maxtext)" in text, text
    rc, text = outputs[f"{case}_verify"]
    assert rc == 0 and ": ok (" in text, text


@pytest.mark.parametrize("case", CASES)
def test_maxtext_exports_the_rescanned_step_as_its_source(case, outputs):
    hf = outputs["hf"]
    got, want = hf[f"{case}_output"], hf[f"{case}_source"]
    assert want.returncode == 0, want.why()
    assert got.returncode == 0, got.why()
    # MaxText took the unscanned output's form from the scan_layers this library recorded
    # (base.yml says true; MaxText logs the change only).
    if CASES[case][3] == "unroll":
        assert S.SYNCED_FROM_METADATA.format(False) in got.log, got.why()
    a, b = S.read_hf(_hf_dir(got)), S.read_hf(_hf_dir(want))
    assert b and S.hf_diff(a, b) == []


def _hf_dir(proc: S.Proc) -> Path:
    """Where MaxText's ``to_huggingface`` wrote (its ``base_output_directory``)."""
    (arg,) = [a for a in proc.argv if a.startswith("base_output_directory=")]
    return Path(arg.split("=", 1)[1])
