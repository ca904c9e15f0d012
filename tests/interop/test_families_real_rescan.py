"""Interop: MaxText 0.2.5's own gpt-oss steps changed scan form by the command line, both ways,
judged by MaxText's own ``to_huggingface``.

The sources are the frozen pre-training steps of tests/fixtures/maxtext025 (MaxText's own
pre-training loop; ``gen_maxtext025.py --only gptoss``) of a block-scanned mixture of experts:
gpt-oss, ``decoder/layers/layers_0`` and ``layers_1`` with two scan steps each, and its unscanned
form ``decoder/layers_0 .. layers_3``. Each is converted with ``python -m orbax_maxtext_layout
convert STEP --unroll|--stack --target-from <MaxText's step of the other form> --out DIR`` and
checked with ``verify DIR``, a process each (forked from the suite's fork server,
`hf_export_support.run_cli`). A model's Hugging Face weights do not depend on its scan form, so
MaxText's export of the output (its form read from the ``scan_layers`` the output records) must
equal its export of the source, tensor for tensor (names, shapes, dtypes, bytes). Only the command line and MaxText are used here; the core suite checks the same conversions,
and qwen3-moe's, leaf by leaf (tests/test_family_fixtures.py). Four exports: about 95 s of CPU
time, a minute on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import hf_export_support as S
import maxtext_loop_support as L
import pytest

GEN = L.generator()


def _keys(keys: list[str]) -> list[str]:
    return [k for k in keys if not k.startswith("scan_layers=")]


# name -> (source step, MaxText's step of the other form, the family's model keys, the change)
CASES = {
    "gptoss_unroll": (
        "gptoss_pretrain_run/checkpoints/0",
        "gptoss_pretrain_unscanned_run/checkpoints/0",
        _keys(GEN.GPTOSS_MODEL_KEYS),
        "unroll",
    ),
    "gptoss_stack": (
        "gptoss_pretrain_unscanned_run/checkpoints/0",
        "gptoss_pretrain_run/checkpoints/0",
        _keys(GEN.GPTOSS_MODEL_KEYS),
        "stack",
    ),
}


def _run(step: str) -> str:
    """A source step's run directory name (``gptoss_pretrain_run``)."""
    return Path(step).parts[0]


def _cli(*args: object) -> subprocess.CompletedProcess:
    """``python -m orbax_maxtext_layout ARGS``, forked from the suite's fork server."""
    return S.run_cli(*args, timeout=300)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, object]:
    """``<case>``/``<case>_verify``: the two commands' results; ``hf``: MaxText's
    ``to_huggingface`` of every source step (by its run's name) and output (``<case>_output``)."""
    work = tmp_path_factory.mktemp("families_real_rescan")
    tokenizer = S.write_tokenizer(work / "tokenizer")
    out: dict[str, object] = {}
    jobs, exported = [], set()
    for name, (source, other, keys, change) in CASES.items():
        step = L.copy_tree(L.FIXTURE / source, work / name / "source" / Path(source).name)
        dest = work / name / "out" / step.name
        target = L.FIXTURE / other
        out[name] = _cli("convert", step, f"--{change}", "--target-from", target, "--out", dest)
        out[f"{name}_verify"] = _cli("verify", dest.parent, "--json")
        jobs.append(
            S.export_job(f"{name}_output", dest / "items", work / "hf" / name, tokenizer, keys=keys)
        )
        run = _run(source)
        if run not in exported:  # each source step is exported once
            exported.add(run)
            hf = work / "hf" / run
            jobs.append(S.export_job(run, step / "items", hf, tokenizer, keys=keys))
    out["hf"] = S.run_all(jobs)
    return out


@pytest.mark.parametrize("case", CASES)
def test_the_command_line_writes_the_other_form_and_verify_replays_it(case, outputs):
    res = outputs[case]
    assert res.returncode == 0, res.stdout + res.stderr
    assert "converted (maxtext)" in res.stdout, res.stdout
    res = outputs[f"{case}_verify"]
    assert res.returncode == 0, res.stdout + res.stderr
    assert [r["ok"] for r in json.loads(res.stdout)] == [True], res.stdout


@pytest.mark.parametrize("case", CASES)
def test_maxtext_exports_the_rescanned_step_as_its_source(case, outputs):
    hf = outputs["hf"]
    got, want = hf[f"{case}_output"], hf[_run(CASES[case][0])]
    assert want.returncode == 0, want.why()
    assert got.returncode == 0, got.why()
    # MaxText took the output's form from the scan_layers this library recorded (no command
    # line here names scan_layers; base.yml says true, and MaxText logs a change only).
    if CASES[case][3] == "unroll":
        assert S.SYNCED_FROM_METADATA.format(False) in got.log, got.why()
    a, b = S.read_hf(_hf_dir(got)), S.read_hf(_hf_dir(want))
    assert b and S.hf_diff(a, b) == []


def _hf_dir(proc: S.Proc) -> Path:
    """Where MaxText's ``to_huggingface`` wrote (its ``base_output_directory``)."""
    (arg,) = [a for a in proc.argv if a.startswith("base_output_directory=")]
    return Path(arg.split("=", 1)[1])
