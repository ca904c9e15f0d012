"""Interop (issue 59): `export_hf` and `import_hf` with an options object write what the
same options as keyword arguments write (the core suite's tests/test_options.py checks the
other two functions, and the refusals, without MaxText).

The step (`chunked_step.py`, stock Orbax in a child process): a small llama3.1 override, one
chunk per array. It is exported twice (``ExportOptions`` and keywords, a budget small enough
that every param goes piece by piece), and the export is imported back twice
(``ImportOptions`` and keywords, float32, with a progress callback)."""

from __future__ import annotations

import json
from pathlib import Path

import chunked_step
import maxtext_loop_support as L
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.paths import flatten

KEYS = [
    "model_name=llama3.1-8b",
    "override_model_config=true",
    "base_emb_dim=128",
    "base_mlp_dim=256",
    "base_num_query_heads=2",
    "base_num_kv_heads=1",
    "head_dim=64",
    "base_num_decoder_layers=2",
    "vocab_size=256",
    "weight_dtype=bfloat16",
    "dtype=bfloat16",
    "scan_layers=true",
]


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> Path:
    return chunked_step.make(tmp_path_factory.mktemp("options") / "run", 0, "one", KEYS)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _report(report, root: Path) -> dict:
    d = json.loads(report.to_json())
    d.pop("seconds", None)
    return {k: v.replace(str(root), "<root>") if isinstance(v, str) else v for k, v in d.items()}


def test_export_hf_options_and_keywords_export_alike(step, tmp_path):
    config = [str(L.base_yml()), *KEYS]
    keywords = dict(override_model_architecture=True, memory_budget=1 << 16, max_shard_size=1 << 17)
    by_keywords = oml.export_hf(step, tmp_path / "kw" / "hf", maxtext_config=config, **keywords)
    options = oml.ExportOptions(**keywords)
    by_options = oml.export_hf(step, tmp_path / "obj" / "hf", options, maxtext_config=config)
    assert _report(by_keywords, tmp_path / "kw") == _report(by_options, tmp_path / "obj")
    files = _files(tmp_path / "obj" / "hf")
    assert len([n for n in files if n.endswith(".safetensors")]) > 1  # split by max_shard_size
    assert _files(tmp_path / "kw" / "hf") == files


def _params(step_dir: Path) -> dict:
    tree = ocp.PyTreeCheckpointHandler().restore(step_dir / "items")
    flat = flatten(tree["params"], is_leaf=lambda x: hasattr(x, "dtype"))
    return {k: (str(v.dtype), v.shape, np.asarray(v).tobytes()) for k, v in flat.items()}


def test_import_hf_options_and_keywords_import_alike(step, tmp_path):
    config = [str(L.base_yml()), *KEYS]
    hf = tmp_path / "hf"
    oml.export_hf(step, hf, maxtext_config=config, override_model_architecture=True)
    seen: dict[str, list] = {"kw": [], "obj": []}
    by_keywords = oml.import_hf(
        hf,
        tmp_path / "kw",
        maxtext_config=config,
        save_dtype="float32",
        memory_budget=1 << 16,
        progress=lambda done, total: seen["kw"].append((done, total)),
    )
    options = oml.ImportOptions(
        save_dtype="float32",
        memory_budget=1 << 16,
        progress=lambda done, total: seen["obj"].append((done, total)),
    )
    by_options = oml.import_hf(hf, tmp_path / "obj", options, maxtext_config=config)
    assert _report(by_keywords, tmp_path / "kw") == _report(by_options, tmp_path / "obj")
    assert seen["kw"] and seen["kw"][-1] == seen["obj"][-1]
    got = _params(tmp_path / "obj" / "0")
    assert got and _params(tmp_path / "kw" / "0") == got
    assert {dtype for dtype, _, _ in got.values()} == {"float32"}
