"""``import_hf`` while its shards are cut, and ``export_hf`` while its step's data files are
(issue 58, item 2): a named error (`HfInputError` naming the shard; `CheckpointReadError`
naming the data file) or the same output as an untouched run, never a signal, and after an
error nothing left under ``--out`` or beside it (no work directory).

The campaign is tests/truncation_child.py's (op ``import``), with MaxText's mapping of the
tiny llama3.1 of import_hf_support (``llama_bf16_sharded``: six shards), run by the
interop venv's python (a child forked from the suite's MaxText fork server,
hf_export_support.run_cli); the reads themselves are checked without MaxText by
tests/test_truncation.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import hf_export_support as S
import import_hf_support as H
import maxtext_loop_support as L
import pytest
import truncation_child as T

pytestmark = pytest.mark.skipif(not H.hf_python(), reason="needs the hf venv (OMTL_HF_PYTHON)")

CUTS = ("zero", "half", "tail", "delete")
POINTS = 16


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return H.hf_checkpoints(tmp_path_factory, ["llama_bf16_sharded"])["llama_bf16_sharded"]


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
    # the campaign's child, forked from the suite's MaxText fork server (MaxText imported once
    # per test process), with this checkout's library: T.run's checks on what it reports
    child = S.run_cli(argv=(T.__file__, json.dumps(job)), cwd=work, timeout=900)
    got = T.outcomes(job, child)
    assert len(got) == POINTS
    for g in got:
        if g["outcome"] == "ok":
            assert g["correct"], g
        else:
            assert g["error"] == error and g["read_error"] and g["named"], g.get("trace", g)
    assert any(g["outcome"] == "error" for g in got)


def test_an_import_survives_its_shards_cut_at_any_point(hf, tmp_path):
    _campaign("import", hf, tmp_path / "work", "HfInputError")


def test_an_export_survives_its_data_files_cut_at_any_point(hf, tmp_path):
    """The step exported is the import of ``hf`` (made first, in the child)."""
    _campaign("export", hf, tmp_path / "work", "CheckpointReadError")
