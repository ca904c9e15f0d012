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


@pytest.mark.parametrize("item", ITEMS[:2])
def test_a_local_item_is_read_from_its_data_files_as_through_the_kvstore(item):
    """On a local disk a value is read straight from its data file (`os.pread`); through the
    kvstore (as on an object store) it reads the same bytes."""
    d = epath.Path(FIXTURES / item)
    ctx = tskv.ts_context()
    src = tskv.SourceItem.open(d, ctx)
    in_files = 0
    for p, s in read_specs(d).items():
        if s.shape == ():
            continue
        name = tskv.param_name(p)
        key, *_ = tskv._one_chunk_layout(src, name)
        # in a data file at an offset, unless small enough to sit in the B-tree (1 KiB)
        in_files += src.value_file(f"{name}/{key}") is not None
        from_file = tskv._read_one_chunk(src, name)
        through_kv = tskv.SourceItem.open(d, ctx)
        through_kv._value_files = {}  # no data file known: the kvstore path
        assert through_kv.value_file(f"{name}/{key}") is None
        assert from_file.tobytes() == tskv._read_one_chunk(through_kv, name).tobytes(), p
    assert in_files >= 3


@pytest.mark.parametrize("piece", [64, 1 << 20], ids=["rows-larger-than-a-piece", "row-blocks"])
@pytest.mark.parametrize("zarr3", [True, False], ids=["zarr3", "zarr2"])
def test_layers_are_split_out_as_the_chunk_is_decoded(tmp_path, monkeypatch, piece, zarr3):
    """`read_layers` decodes a one-chunk array once into one buffer per layer, on every
    axis, bit for bit the tensorstore slices."""
    monkeypatch.setattr(tskv, "_PIECE", piece)
    ctx = tskv.ts_context()
    kv = tskv.open_kvstore(epath.Path(tmp_path), ctx, use_ocdbt=True)
    rng = np.random.default_rng(0)
    data = rng.normal(size=(6, 5, 7, 3)).astype(np.float32)
    out = tskv.create_array(kv.spec().to_json(), "w", data.shape, data.dtype, data.shape,
                            use_zarr3=zarr3, context=ctx)  # fmt: skip
    out.write(data).result()
    files = type("F", (), {"use_zarr3": zarr3, "use_ocdbt": True, "dir": epath.Path(tmp_path)})
    item = tskv.SourceItem(files(), kv)  # no Orbax files around it: its kvstore alone
    for axis in range(data.ndim):
        layers, own = tskv.read_layers(item, ("w",), axis, ctx, fast=True)
        assert own and len(layers) == data.shape[axis]
        for i, layer in enumerate(layers):
            assert layer.flags.c_contiguous and layer.flags.owndata
            assert np.array_equal(layer, np.take(data, i, axis)), (axis, i)
    # Written layer by layer, one chunk each (as a merge writes): read back whole.
    stacked = tskv.create_array(kv.spec().to_json(), "s", data.shape, data.dtype, (6, 1, 7, 3),
                                use_zarr3=zarr3, context=ctx)  # fmt: skip
    for i in range(5):
        tskv.write_part(stacked, np.ascontiguousarray(data[:, i]), (1, i))
    assert np.array_equal(stacked.read().result(), data)
