"""merge-lora on gs:// against the local emulator: the same merged step as on a disk, the
unadapted leaves copied server-side (at most 1% of their bytes through the client), and a
refusal that leaves nothing listable."""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
from lora_writers import EMB, base_params, lora_factors, write_adapters, write_base

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.storage import objstore

from .conftest import restored_leaves

EMBEDDING_BYTES = 48 << 20  # the bulk of the base: an unadapted leaf


def test_merge_lora_on_gs_equals_disk_with_server_side_copies(gcs_emulator, gs_prefix, tmp_path):
    base = base_params()
    rows = EMBEDDING_BYTES // (4 * EMB)
    base[("token_embedder", "embedding")] = (
        np.random.default_rng(3).normal(size=(rows, EMB)).astype(np.float32)
    )
    b = write_base(tmp_path / "base", 0, base)
    a = write_adapters(tmp_path / "sft", 2, lora_factors())
    gb = gs_prefix.upload(b.parent, "base") / "0"
    ga = gs_prefix.upload(a.parent, "sft") / "2"
    local = oml.merge_lora(a, b, alpha=8, out=tmp_path / "merged")
    with gcs_emulator.measure() as c:
        remote = oml.merge_lora(ga, gb / "items", alpha=8, out=gs_prefix.path("merged"))
    out = gs_prefix.path("merged/0")
    assert remote.merged == local.merged and remote.destinations == local.destinations
    assert (out / objstore.COMMIT_MARKER).exists() and (
        out / "items" / objstore.COMMIT_MARKER
    ).exists()
    assert restored_leaves(out / "items") == restored_leaves(tmp_path / "merged" / "0" / "items")
    merged = sum(v.nbytes for p, v in base.items() if p[-1] == "kernel")
    unmerged = sum(v.nbytes for p, v in base.items()) - merged
    assert c.by_kind.get("copy", 0) > 0  # data files copied server-side
    # Through the client: metadata, B-tree nodes, and the merged kernels (read, computed and
    # written by the client), never the unadapted leaves' bytes.
    assert c.media_bytes <= unmerged // 100 + 3 * merged, (
        c.media_bytes,
        unmerged,
        merged,
        c.by_kind,
    )
    assert oml.verify_step(out).ok
    assert ocp.CheckpointManager(gs_prefix.path("merged")).all_steps() == [0]


def test_merge_lora_refusal_on_gs_writes_nothing(gs_prefix, tmp_path):
    base = {p: v for p, v in base_params().items() if "wo" not in p}
    b = write_base(tmp_path / "base", 0, base)
    a = write_adapters(tmp_path / "sft", 2, lora_factors())
    gb = gs_prefix.upload(b.parent, "base") / "0"
    ga = gs_prefix.upload(a.parent, "sft") / "2"
    try:
        oml.merge_lora(ga, gb, alpha=8, out=gs_prefix.path("merged"))
    except oml.LayoutMismatchError as e:
        assert "decoder/layers/mlp/wo" in str(e)
    else:
        raise AssertionError("merge-lora accepted adapters for a module the base lacks")
    assert not gs_prefix.objects("merged")
