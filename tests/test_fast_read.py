"""The zstandard path of the chunk-aware reader (`chunks`): bit for bit what tensorstore
reads, from a data file as through the kvstore; a damaged chunk is a CheckpointReadError.

(Per-device chunks written by stock Orbax are in test_chunks.py.)"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import FIXTURES, copy_fixture
from etils import epath

from orbax_maxtext_layout.errors import CheckpointReadError
from orbax_maxtext_layout.orbax_io import chunks, tskv
from orbax_maxtext_layout.orbax_io.orbax_files import io_counts
from orbax_maxtext_layout.orbax_io.spec import read_specs

ITEMS = [
    "maxtext025/pretrain_run/checkpoints/1/items",
    "maxtext025/sft_run/checkpoints/2/model_params",
    "tunix017/rl_run/checkpoints/actor/2/model_params",
]


@pytest.mark.parametrize("item", ITEMS)
def test_every_array_of_the_real_fixtures_reads_as_tensorstore_reads_it(item):
    d = epath.Path(FIXTURES / item)
    ctx = tskv.ts_context()
    src = tskv.SourceItem.open(d, ctx)
    arrays = [p for p, s in read_specs(d).items() if s.shape != ()]
    assert arrays
    for p in arrays:
        got = chunks.read_whole(src, tskv.param_name(p), ctx)
        want = tskv.read_array(src, p, ctx)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), p
        assert got.tobytes() == want.tobytes(), p


def test_a_damaged_chunk_is_a_read_error_naming_the_array(tmp_path):
    step = copy_fixture("tunix017/rl_run/checkpoints/actor/2", tmp_path)
    d = epath.Path(step / "model_params")
    ctx = tskv.ts_context()
    specs = read_specs(d)
    path = max((p for p, s in specs.items() if s.shape != ()), key=lambda p: specs[p].nbytes)
    name = tskv.param_name(path)
    # Rewrite the array's one chunk with its zstd frame cut in half, through the kvstore.
    src = tskv.SourceItem.open(d, ctx)
    key = chunks.layout(src, name).key((0,) * len(specs[path].shape))
    raw = src.kv.read(f"{name}/{key}").result().value
    src.kv.write(f"{name}/{key}", raw[: len(raw) // 2]).result()
    src = tskv.SourceItem.open(d, tskv.ts_context())
    with pytest.raises(CheckpointReadError, match=name.replace(".", r"\.")):
        chunks.read_whole(src, name, ctx)


def _item(tmp_path, zarr3: bool, data: np.ndarray, chunk: tuple) -> tskv.SourceItem:
    """An OCDBT database holding ``data`` as ``w``, in chunks of ``chunk`` (zstd), read as
    an item (its kvstore alone: no Orbax files around it)."""
    ctx = tskv.ts_context()
    kv = tskv.open_kvstore(epath.Path(tmp_path), ctx, use_ocdbt=True)
    out = tskv.create_array(kv.spec().to_json(), "w", data.shape, data.dtype, chunk,
                            use_zarr3=zarr3, context=ctx)  # fmt: skip
    out.write(data).result()
    files = type("F", (), {"use_zarr3": zarr3, "use_ocdbt": True, "dir": epath.Path(tmp_path)})
    return tskv.SourceItem(files(), tskv.open_kvstore(epath.Path(tmp_path), ctx, use_ocdbt=True))


@pytest.mark.parametrize("zarr3", [True, False], ids=["zarr3", "zarr2"])
def test_a_chunk_reads_from_its_data_file_as_through_the_kvstore(tmp_path, zarr3):
    """On a local disk a value is read straight from its data file (`os.pread`); through the
    kvstore (as on an object store) it reads the same bytes."""
    data = np.random.default_rng(0).normal(size=(64, 3, 2048)).astype(np.float32)  # 1.5 MiB
    src = _item(tmp_path, zarr3, data, data.shape)
    ctx = tskv.ts_context()
    lay = chunks.layout(src, "w")
    assert lay.streamed and src.value_file(f"w/{lay.key((0, 0, 0))}") is not None
    through_kv = _item(tmp_path / "kv", zarr3, data, data.shape)
    through_kv._value_files = {}  # no data file known: the kvstore path
    for s in (src, through_kv):
        assert chunks.read_whole(s, "w", ctx).tobytes() == data.tobytes()


@pytest.mark.parametrize("max_bytes", [64, 5000, 1 << 20], ids=["elements", "rows", "runs"])
@pytest.mark.parametrize("zarr3", [True, False], ids=["zarr3", "zarr2"])
def test_a_chunk_larger_than_a_piece_is_streamed_once(tmp_path, zarr3, max_bytes):
    """A stored chunk over the piece size is decoded once, as runs of whole rows (single
    indices on the leading axes where a row is too large), tiling the array."""
    data = np.random.default_rng(1).normal(size=(6, 5, 7, 3, 1300)).astype(np.float32)
    src = _item(tmp_path, zarr3, data, (6, 5, 7, 3, 1300))
    ctx = tskv.ts_context()
    seen = np.zeros(data.shape, np.int8)
    with io_counts() as counts:
        for p in chunks.pieces(src, "w", ctx, max_bytes=max_bytes, reuse=True):
            assert p.data.nbytes <= max(max_bytes, 1300 * 4)
            assert np.array_equal(p.data, data[p.box])
            seen[p.box] += 1
    assert (seen == 1).all()
    assert [n for (kind, _), n in counts.items() if kind == "chunk decoded"] == [1]


def test_stored_values_compare_in_their_data_files_piece_by_piece(tmp_path):
    """`tskv.same_stored` (verify's copied arrays): equal stored values are equal, one byte
    flipped in the second 8 MiB piece of a value is found, and a value not in a local data
    file is left to the kvstore (None)."""
    data = np.random.default_rng(1).integers(0, 1 << 16, size=(5 << 20,)).astype(np.uint16)
    a, b, c = (_item(tmp_path / n, False, data, (data.size,)) for n in "abc")
    key = f"w/{chunks.layout(a, 'w').key((0,))}"
    path, offset, length = c.value_file(key)
    assert length > tskv._PIECE + 100  # compressed, still over one piece
    with open(path, "r+b") as f:  # the stored bytes damaged, the length kept
        f.seek(offset + tskv._PIECE + 100)
        byte = f.read(1)[0]
        f.seek(offset + tskv._PIECE + 100)
        f.write(bytes([byte ^ 1]))
    assert tskv.same_stored(a, key, b, key) is True
    assert tskv.same_stored(a, key, c, key) is False
    os.truncate(path, offset + tskv._PIECE)  # cut short: the kvstore's read reports it
    assert tskv.same_stored(a, key, c, key) is None
    b._value_files = {}  # no data file known (as on an object store)
    assert tskv.same_stored(a, key, b, key) is None
