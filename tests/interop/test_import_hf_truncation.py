"""``import_hf`` while its shards are cut, and ``export_hf`` while its step's data files are
(issue 58, item 2): a named error (`HfInputError` naming the shard; `CheckpointReadError`
naming the data file) or the same output as an untouched run, never a signal, and after an
error nothing left under ``--out`` or beside it (no work directory).

The campaign is tests/truncation_child.py's (op ``import``), with MaxText's mapping of the
tiny llama3.1 of import_hf_support (``llama_bf16_sharded``: six shards), run by the
interop venv's python; the reads themselves are checked without MaxText by
tests/test_truncation.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import import_hf_support as H
import maxtext_loop_support as L
import pytest
from conftest import child_env

pytestmark = pytest.mark.skipif(not H.hf_python(), reason="needs the hf venv (OMTL_HF_PYTHON)")

CHILD = H.REPO / "tests" / "truncation_child.py"
CUTS = ("zero", "half", "tail", "delete")
POINTS = 16


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    return H.write_hf(root, ["llama_bf16_sharded"])["llama_bf16_sharded"]


def _campaign(op: str, hf: Path, work: Path, error: str) -> None:
    config = [str(L.base_yml()), *H.FAMILY_KEYS["llama3.1"], H.scan_key(True)]
    ats = [1.3 * i / (POINTS - 1) for i in range(POINTS)]
    job = {
        "op": op,
        "pristine": str(hf),
        "hf": str(hf),
        "work": str(work),
        "cases": [{"at": a, "cut": CUTS[i % len(CUTS)]} for i, a in enumerate(ats)],
        "maxtext_config": config,
    }
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, str(CHILD), json.dumps(job)],
        capture_output=True,
        text=True,
        env=child_env({"PYTHONPATH": str(H.REPO)}),
        timeout=900,
    )
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    done = f"after {len(lines)} lines: {lines[-1] if lines else None}"
    assert proc.returncode != -signal.SIGBUS, f"the child died of SIGBUS {done}"
    assert proc.returncode == 0, f"exit {proc.returncode} {done}\n{proc.stderr[-3000:]}"
    got = lines[1:]
    assert len(got) == POINTS
    for g in got:
        if g["outcome"] == "ok":
            assert g["correct"], g
        else:
            assert g["error"] == error and g["read_error"] and g["named"], g
    assert any(g["outcome"] == "error" for g in got)


def test_an_import_survives_its_shards_cut_at_any_point(hf, tmp_path):
    _campaign("import", hf, tmp_path / "work", "HfInputError")


def test_an_export_survives_its_data_files_cut_at_any_point(hf, tmp_path):
    """The step exported is the import of ``hf`` (made first, in the child)."""
    _campaign("export", hf, tmp_path / "work", "CheckpointReadError")
