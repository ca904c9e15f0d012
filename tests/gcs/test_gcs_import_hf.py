"""import-hf from and to gs:// against the local emulator: the same step as on a disk, and a
hostile directory on gs:// refused with nothing written. Needs MaxText 0.2.5 (the interop venv
runs it; elsewhere it skips)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from orbax_maxtext_layout.formats.safetensors_reader import HfInputError
from orbax_maxtext_layout.hf.export_hf import export_hf
from orbax_maxtext_layout.hf.import_hf import import_hf

from .conftest import tiny_llama_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("maxtext") is None, reason="import-hf runs MaxText 0.2.5's mappings"
)

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "maxtext025"
sys.path.insert(0, str(ROOT / "tests"))
from conftest import restore_flat  # noqa: E402

sys.path.pop(0)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """The tiny llama's pre-training step as Hugging Face safetensors (export-hf, sharded)."""
    out = tmp_path_factory.mktemp("hf") / "hf"
    kw = dict(
        maxtext_config=tiny_llama_config(), override_model_architecture=True, max_shard_size=8 << 10
    )
    export_hf(FIX / "pretrain_run/checkpoints/1", out, **kw)
    return out


def test_import_from_and_to_gs_equals_disk(gs_prefix, hf_dir, tmp_path):
    keys = [*tiny_llama_config(), "scan_layers=true"]
    local = import_hf(hf_dir, tmp_path / "run", maxtext_config=keys, save_dtype="float32")
    remote_hf = gs_prefix.upload(hf_dir, "hf")
    remote = import_hf(remote_hf, gs_prefix.path("run"), maxtext_config=keys, save_dtype="float32")
    assert remote.params == local.params > 10
    assert remote.bytes_read == local.bytes_read  # each byte read once, on gs:// too
    got = gs_prefix.download("run", tmp_path / "down")
    assert sorted(p.name for p in got.iterdir()) == ["0"]
    want, have = restore_flat(tmp_path / "run/0/items"), restore_flat(got / "0/items")
    assert sorted(want) == sorted(have)
    for path, value in want.items():
        a, b = np.asarray(value), np.asarray(have[path])
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    meta = json.loads((got / "0/_CHECKPOINT_METADATA").read_text())
    assert meta["custom_metadata"]["scan_layers"] is True


def test_a_hostile_directory_on_gs_is_refused_and_nothing_is_written(gs_prefix, hf_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in hf_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere/model.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    remote = gs_prefix.upload(bad, "bad")
    with pytest.raises(HfInputError, match="elsewhere"):
        import_hf(
            remote, gs_prefix.path("run"), maxtext_config=[*tiny_llama_config(), "scan_layers=true"]
        )
    assert not gs_prefix.objects("run")
