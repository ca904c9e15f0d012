"""``import_hf`` while its shards are cut (issue 58, item 2): a named error (`HfInputError`,
naming the shard) or the same step as an untouched import, never a signal, and after an
error nothing left under ``--out`` (no work directory).

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

import import_hf_support as H
import maxtext_loop_support as L
import pytest
from conftest import child_env

pytestmark = pytest.mark.skipif(not H.hf_python(), reason="needs the hf venv (OMTL_HF_PYTHON)")

CHILD = H.REPO / "tests" / "truncation_child.py"
CUTS = ("zero", "half", "tail", "delete")
POINTS = 16


def test_an_import_survives_its_shards_cut_at_any_point(tmp_path):
    hf = H.write_hf(tmp_path / "hf", ["llama_bf16_sharded"])["llama_bf16_sharded"]
    config = [str(L.base_yml()), *H.FAMILY_KEYS["llama3.1"], H.scan_key(True)]
    ats = [1.3 * i / (POINTS - 1) for i in range(POINTS)]
    job = {
        "op": "import",
        "pristine": str(hf),
        "work": str(tmp_path / "work"),
        "cases": [{"at": a, "cut": CUTS[i % len(CUTS)]} for i, a in enumerate(ats)],
        "maxtext_config": config,
    }
    (tmp_path / "work").mkdir()
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
            assert g["error"] == "HfInputError" and g["named"], g
    assert any(g["outcome"] == "error" for g in got)
