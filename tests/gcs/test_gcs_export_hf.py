"""export-hf from and to gs:// against the local emulator: the same files as on a disk,
config.json published last, a refusal that leaves nothing, and a publish cut short that a
rerun completes. Needs MaxText 0.2.5 (the interop venv runs it; elsewhere it skips)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from orbax_maxtext_layout.hf.export_hf import export_hf
from orbax_maxtext_layout.storage import objstore
from orbax_maxtext_layout.storage.store import EXPORT_WORK_SUFFIX

from .conftest import tiny_llama_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("maxtext") is None, reason="export-hf runs MaxText 0.2.5's mappings"
)

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "maxtext025"
TOKENIZER = ROOT / "tests" / "fixtures" / "hf_tokenizer"


def _files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_export_from_and_to_gs_equals_disk(gs_prefix, tmp_path):
    step = gs_prefix.upload(FIX / "sft_run", "sft") / "checkpoints" / "2"
    kw = dict(
        maxtext_config=tiny_llama_config(), override_model_architecture=True, max_shard_size=8 << 10
    )
    local = export_hf(
        FIX / "sft_run/checkpoints/2", tmp_path / "hf", hf_model_path=str(TOKENIZER), **kw
    )
    out = gs_prefix.path("hf")
    remote = export_hf(step, out, hf_model_path=str(TOKENIZER), **kw)
    assert remote.status == local.status == "exported"
    assert len(remote.shards) == len(local.shards) > 2
    got = gs_prefix.download("hf", tmp_path / "down")
    assert _files(got) == _files(tmp_path / "hf")
    assert not gs_prefix.objects(f"hf{EXPORT_WORK_SUFFIX}")  # the work objects are gone
    index = json.loads((got / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s["name"] for s in remote.shards}


def test_a_refusal_on_gs_leaves_nothing(gs_prefix):
    lora = gs_prefix.upload(FIX / "lora_run", "lora") / "checkpoints" / "2"
    from orbax_maxtext_layout.errors import LayoutMismatchError

    with pytest.raises(LayoutMismatchError, match="--base"):
        export_hf(lora, gs_prefix.path("hf"), maxtext_config=tiny_llama_config())
    assert not gs_prefix.objects("hf") and not gs_prefix.objects(f"hf{EXPORT_WORK_SUFFIX}")


def test_a_publish_cut_short_is_completed_by_a_rerun(gs_prefix, tmp_path):
    """A kill inside the publish (server-side copies) leaves some files under out without
    config.json, and the work objects: the rerun publishes again; config.json comes last."""
    step = FIX / "pretrain_run/checkpoints/1"
    kw = dict(
        maxtext_config=tiny_llama_config(), override_model_architecture=True, max_shard_size=8 << 10
    )
    want = export_hf(step, tmp_path / "hf", **kw)
    out = gs_prefix.path("hf")
    work = gs_prefix.path(f"hf{EXPORT_WORK_SUFFIX}")
    export_hf(step, out, **kw)
    # Re-create the state of a publish cut short: the work objects back, config.json not
    # yet copied under out.
    objstore.copy_tree(out, work)
    (out / "config.json").unlink()
    objstore.refresh(out)
    assert not (out / "config.json").exists() and gs_prefix.objects("hf")
    again = export_hf(step, out, **kw)
    assert again.status == "exported" and want.tensors == again.tensors
    assert _files(gs_prefix.download("hf", tmp_path / "down")) == _files(tmp_path / "hf")
    assert not gs_prefix.objects(f"hf{EXPORT_WORK_SUFFIX}")


def test_a_published_export_on_gs_is_not_replaced(gs_prefix, tmp_path):
    from orbax_maxtext_layout.errors import StepExistsError

    step = FIX / "pretrain_run/checkpoints/1"
    kw = dict(maxtext_config=tiny_llama_config(), override_model_architecture=True)
    export_hf(step, gs_prefix.path("hf"), **kw)
    before = gs_prefix.objects("hf")
    with pytest.raises(StepExistsError):
        export_hf(step, gs_prefix.path("hf"), **kw)
    assert gs_prefix.objects("hf") == before


def test_adapter_export_from_and_to_gs_equals_disk(gs_prefix, tmp_path):
    """``--adapter`` on gs://: the same two files as on a disk, ``adapter_config.json``
    published last; a publish cut short (no config under out, the work objects there) is
    completed by a rerun."""
    lora = gs_prefix.upload(FIX / "lora_run", "lora") / "checkpoints" / "2"
    kw = dict(
        maxtext_config=tiny_llama_config(), override_model_architecture=True, alpha=8, adapter=True
    )
    local = export_hf(FIX / "lora_run/checkpoints/2", tmp_path / "ad", **kw)
    out = gs_prefix.path("ad")
    remote = export_hf(lora, out, **kw)
    assert remote.status == local.status == "exported"
    assert remote.files == local.files == ["adapter_config.json", "adapter_model.safetensors"]
    assert _files(gs_prefix.download("ad", tmp_path / "down")) == _files(tmp_path / "ad")
    assert not gs_prefix.objects(f"ad{EXPORT_WORK_SUFFIX}")

    work = gs_prefix.path(f"ad{EXPORT_WORK_SUFFIX}")
    objstore.copy_tree(out, work)
    (out / "adapter_config.json").unlink()
    objstore.refresh(out)
    again = export_hf(lora, out, **kw)
    assert again.status == "exported"
    assert _files(gs_prefix.download("ad", tmp_path / "down2")) == _files(tmp_path / "ad")
    assert not gs_prefix.objects(f"ad{EXPORT_WORK_SUFFIX}")
