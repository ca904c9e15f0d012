"""Interop: ``merge-lora --unroll``/``--stack`` with ``--maxtext-config``, the key
``scan_layers`` in either value (issue 41). The config names the model; the flag names the
written form. ``merge-lora`` read the key as the *input's* form: ``--unroll ... scan_layers=false``
exited 1 ("not in the unscanned target") and ``--stack ... scan_layers=true`` wrote the params
unscanned with exit 0, recording ``scan_layers`` false.

Judged by MaxText 0.2.5's own ``to_huggingface`` of each output in its form (the flag's): a
merge's Hugging Face weights do not depend on its scan form, so the export of the rescanned
merge must equal, tensor for tensor, the export of the same merge written in the input's form
(no scan change). Families: the plain llama scan, gemma3's block scans and mixtral's MoE experts
(scanned LoRA runs, ``--unroll``), and the llama unscanned LoRA run (``--stack``).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import hf_export_support as S
import maxtext_loop_support as L
import pytest

from orbax_maxtext_layout import cli
from orbax_maxtext_layout.orbax_io import stepmeta

GEN = L.generator()
ALPHA = f"{float(GEN.LORA_ALPHA):g}"


def _keys(keys: list[str]) -> list[str]:
    return [k for k in keys if not k.startswith("scan_layers=")]


# name -> (LoRA run, its base run and step, the family's model keys, the written form)
CASES = {
    "llama_unroll": ("lora_run", ("pretrain_run", "1"), _keys(GEN.MODEL_KEYS), "unroll"),
    "gemma3_unroll": (
        "gemma3_lora_run",
        ("gemma3_pretrain_run", "0"),
        _keys(GEN.GEMMA3_MODEL_KEYS),
        "unroll",
    ),
    "mixtral_unroll": (
        "mixtral_lora_run",
        ("mixtral_pretrain_run", "0"),
        _keys(GEN.MIXTRAL_MODEL_KEYS),
        "unroll",
    ),
    "llama_stack": (
        "lora_unscanned_run",
        ("pretrain_unscanned_run", "0"),
        _keys(GEN.MODEL_KEYS),
        "stack",
    ),
}


def merge(*args: object) -> tuple[int, str]:
    """``merge-lora ARGS`` in-process: its exit code and output."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = cli.main(["merge-lora", *map(str, args)])
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("merge_scan_forms")


@pytest.fixture(scope="module")
def outputs(work) -> dict[str, object]:
    """``<case>_<scan_layers>``: ``merge-lora --unroll|--stack --maxtext-config ...
    scan_layers=<true|false>`` (its exit code, output and step); ``<case>_asis``: the same
    merge with no scan change; and MaxText's ``to_huggingface`` of each, in its form."""
    tokenizer = S.write_tokenizer(work / "tokenizer")
    out: dict[str, object] = {}
    jobs = []
    for name, (run, (base_run, base_step), keys, form) in CASES.items():
        step = L.copy_tree(L.FIXTURE / run / "checkpoints" / "2", work / name / "2")
        base = L.copy_tree(L.FIXTURE / base_run / "checkpoints" / base_step, work / name / "b")
        common = (step, "--base", base, "--alpha", ALPHA)
        dest = work / name / "asis"
        rc, text = merge(*common, "--out", dest)
        assert rc == 0, text
        written_scanned = form == "stack"
        jobs.append(
            S.export_job(
                f"{name}_asis",
                dest / "0" / "items",
                work / "hf" / f"{name}_asis",
                tokenizer,
                scan_layers=not written_scanned,
                keys=keys,
            )
        )
        for scan_layers in ("true", "false"):
            dest = work / name / scan_layers
            config = ["--maxtext-config", str(L.base_yml()), *keys, f"scan_layers={scan_layers}"]
            out[f"{name}_{scan_layers}"] = (*merge(*common, "--out", dest, f"--{form}", *config),)
            out[f"{name}_{scan_layers}_step"] = dest / "0"
            # MaxText exports the one the library got wrong: the key naming the written form
            # (the other output must hold the same bytes, `test_..._whatever_...`).
            if (dest / "0" / "items").is_dir() and (scan_layers == "true") is written_scanned:
                jobs.append(
                    S.export_job(
                        f"{name}_{scan_layers}",
                        dest / "0" / "items",
                        work / "hf" / f"{name}_{scan_layers}",
                        tokenizer,
                        scan_layers=written_scanned,
                        keys=keys,
                    )
                )
    out["hf"] = S.run_all(jobs)
    return out


@pytest.mark.parametrize("scan_layers", ["true", "false"])
@pytest.mark.parametrize("case", CASES)
def test_the_flag_names_the_written_form_whatever_the_config_s_scan_layers(
    case, scan_layers, outputs
):
    rc, text = outputs[f"{case}_{scan_layers}"]
    assert rc == 0, text
    step = outputs[f"{case}_{scan_layers}_step"]
    stacked = CASES[case][3] == "stack"
    custom = stepmeta.custom(stepmeta.read(step))
    assert custom.get("scan_layers") is stacked, custom
    names = L.read_item(step / "items")
    layered = {n for n in names if "/decoder/layers" in n}
    assert layered, sorted(names)
    unrolled = any("/decoder/layers_" in n for n in layered)
    assert unrolled is not stacked, sorted(layered)[:5]
    other = outputs[f"{case}_{'false' if scan_layers == 'true' else 'true'}_step"]
    if (other / "items").is_dir():  # the two values of the key write the same step
        assert L.diff(names, L.read_item(other / "items")) == []


@pytest.mark.parametrize("case", CASES)
def test_maxtext_exports_the_rescanned_merge_as_the_merge_itself(case, outputs):
    scan_layers = "true" if CASES[case][3] == "stack" else "false"
    hf = outputs["hf"]
    got, want = hf[f"{case}_{scan_layers}"], hf[f"{case}_asis"]
    assert want.returncode == 0, want.why()
    assert got.returncode == 0, got.why()
    a, b = S.read_hf(_hf_dir(got)), S.read_hf(_hf_dir(want))
    assert b and S.hf_diff(a, b) == []


def _hf_dir(proc: S.Proc) -> Path:
    """Where MaxText's ``to_huggingface`` wrote (its ``base_output_directory``)."""
    (arg,) = [a for a in proc.argv if a.startswith("base_output_directory=")]
    return Path(arg.split("=", 1)[1])
