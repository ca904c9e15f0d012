"""Whole arrays decoded from their one stored chunk by zstandard (tskv._read_one_chunk):
bit for bit what tensorstore reads, for Tunix (zarr2) and MaxText 0.2.5 (zarr3 shards)
items; other layouts fall back to tensorstore; a damaged chunk is a CheckpointReadError."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FIXTURES, copy_fixture
from etils import epath

from orbax_maxtext_layout import tskv
from orbax_maxtext_layout.errors import CheckpointReadError
from orbax_maxtext_layout.spec import read_specs

ITEMS = [
    "maxtext025/pretrain_run/checkpoints/1/items",
    "maxtext025/sft_run/checkpoints/2/model_params",
    "tunix017/rl_run/checkpoints/actor/2/model_params",
]


def _tensorstore_read(src, path, ctx):
    saved, tskv._zstd = tskv._zstd, None
    try:
        return tskv.read_array(src, path, ctx)
    finally:
        tskv._zstd = saved


@pytest.mark.parametrize("item", ITEMS)
def test_every_array_is_decoded_by_zstandard_bit_for_bit(item):
    d = epath.Path(FIXTURES / item)
    ctx = tskv.ts_context()
    src = tskv.SourceItem.open(d, ctx)
    arrays = [(p, s) for p, s in read_specs(d).items() if s.shape != ()]
    assert arrays
    for p, _ in arrays:
        fast = tskv._read_one_chunk(src, tskv.param_name(p))
        assert fast is not None, p  # the fast path applies to every stored layout here
        want = _tensorstore_read(src, p, ctx)
        assert (fast.dtype, fast.shape) == (want.dtype, want.shape), p
        assert fast.tobytes() == want.tobytes(), p
        assert fast.flags.writeable


def test_an_array_of_several_chunks_is_read_by_tensorstore(tmp_path):
    ctx = tskv.ts_context()
    kv = {"driver": "file", "path": str(tmp_path) + "/"}
    data = np.arange(24, dtype=np.float32).reshape(4, 6)
    store = tskv.create_array(kv, "x", data.shape, data.dtype, (1, 6), use_zarr3=True, context=ctx)
    store.write(data).result()
    src = tskv.SourceItem.__new__(tskv.SourceItem)
    object.__setattr__(src, "kv", tskv.ts.KvStore.open(kv).result())
    object.__setattr__(src, "files", type("F", (), {"use_zarr3": True, "dir": tmp_path})())
    assert tskv._read_one_chunk(src, "x") is None


def test_a_damaged_chunk_is_a_read_error_naming_the_array(tmp_path):
    step = copy_fixture("tunix017/rl_run/checkpoints/actor/2", tmp_path)
    d = epath.Path(step / "model_params")
    ctx = tskv.ts_context()
    specs = read_specs(d)
    path = max((p for p, s in specs.items() if s.shape != ()), key=lambda p: specs[p].nbytes)
    name = tskv.param_name(path)
    # Rewrite the array's one chunk with its zstd frame cut in half, through the kvstore.
    src = tskv.SourceItem.open(d, ctx)
    key, *_ = tskv._one_chunk_layout(src, name)
    raw = src.kv.read(f"{name}/{key}").result().value
    src.kv.write(f"{name}/{key}", raw[: len(raw) // 2]).result()
    src = tskv.SourceItem.open(d, tskv.ts_context())
    with pytest.raises(CheckpointReadError, match=name.replace(".", r"\.")):
        tskv.read_array(src, path, ctx)
