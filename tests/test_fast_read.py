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
from orbax_maxtext_layout.orbax_io import (
    item_writer,
    orbax_files,
    reader,
    stored_values,
)
from orbax_maxtext_layout.orbax_io.orbax_files import io_counts
from orbax_maxtext_layout.orbax_io.reader import ItemReader
from orbax_maxtext_layout.orbax_io.spec import read_specs
from orbax_maxtext_layout.storage.store import store_for

ITEMS = [
    "maxtext025/pretrain_run/checkpoints/1/items",
    "maxtext025/sft_run/checkpoints/2/model_params",
    "tunix017/rl_run/checkpoints/actor/2/model_params",
]


@pytest.mark.parametrize("item", ITEMS)
def test_every_array_of_the_real_fixtures_reads_as_tensorstore_reads_it(item):
    d = epath.Path(FIXTURES / item)
    ctx = item_writer.ts_context()
    src = ItemReader.open(d, ctx)
    arrays = [p for p, s in read_specs(d).items() if s.shape != ()]
    assert arrays
    for p in arrays:
        got = src.read_whole(orbax_files.param_name(p))
        want = src.read_array(p)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), p
        assert got.tobytes() == want.tobytes(), p


def test_a_damaged_chunk_is_a_read_error_naming_the_array(tmp_path):
    step = copy_fixture("tunix017/rl_run/checkpoints/actor/2", tmp_path)
    d = epath.Path(step / "model_params")
    ctx = item_writer.ts_context()
    specs = read_specs(d)
    path = max((p for p, s in specs.items() if s.shape != ()), key=lambda p: specs[p].nbytes)
    name = orbax_files.param_name(path)
    # Rewrite the array's one chunk with its zstd frame cut in half, through the kvstore.
    src = ItemReader.open(d, ctx)
    key = src.layout(name).key((0,) * len(specs[path].shape))
    raw = src.kv.read(f"{name}/{key}").result().value
    src.kv.write(f"{name}/{key}", raw[: len(raw) // 2]).result()
    src = ItemReader.open(d, item_writer.ts_context())
    with pytest.raises(CheckpointReadError, match=name.replace(".", r"\.")):
        src.read_whole(name)


def _item(tmp_path, zarr3: bool, data: np.ndarray, chunk: tuple) -> ItemReader:
    """An OCDBT database holding ``data`` as ``w``, in chunks of ``chunk`` (zstd), read as
    an item (its kvstore alone: no Orbax files around it)."""
    ctx = item_writer.ts_context()
    kv = orbax_files.open_kvstore(epath.Path(tmp_path), ctx, use_ocdbt=True)
    out = item_writer.create_array(kv.spec().to_json(), "w", data.shape, data.dtype, chunk,
                            use_zarr3=zarr3, context=ctx)  # fmt: skip
    out.write(data).result()
    # this library's writer stores every chunk: one missing is damage (`fills_missing`)
    attrs = {"use_zarr3": zarr3, "use_ocdbt": True, "dir": epath.Path(tmp_path)}
    files = type("F", (), {**attrs, "fills_missing": False})
    kv = orbax_files.open_kvstore(epath.Path(tmp_path), ctx, use_ocdbt=True)
    return ItemReader(files(), kv, store_for(epath.Path(tmp_path)), ctx)


@pytest.mark.parametrize("zarr3", [True, False], ids=["zarr3", "zarr2"])
def test_a_chunk_reads_from_its_data_file_as_through_the_kvstore(tmp_path, zarr3):
    """On a local disk a value is read straight from its data file (`os.pread`); through the
    kvstore (as on an object store) it reads the same bytes."""
    data = np.random.default_rng(0).normal(size=(64, 3, 2048)).astype(np.float32)  # 1.5 MiB
    src = _item(tmp_path, zarr3, data, data.shape)
    lay = src.layout("w")
    assert lay.streamed and src.value_file(f"w/{lay.key((0, 0, 0))}") is not None
    through_kv = _item(tmp_path / "kv", zarr3, data, data.shape)
    through_kv._value_files = {}  # no data file known: the kvstore path
    for s in (src, through_kv):
        assert s.read_whole("w").tobytes() == data.tobytes()


@pytest.mark.parametrize("max_bytes", [64, 5000, 1 << 20], ids=["elements", "rows", "runs"])
@pytest.mark.parametrize("zarr3", [True, False], ids=["zarr3", "zarr2"])
def test_a_chunk_larger_than_a_piece_is_streamed_once(tmp_path, zarr3, max_bytes):
    """A stored chunk over the piece size is decoded once, as runs of whole rows (single
    indices on the leading axes where a row is too large), tiling the array."""
    data = np.random.default_rng(1).normal(size=(6, 5, 7, 3, 1300)).astype(np.float32)
    src = _item(tmp_path, zarr3, data, (6, 5, 7, 3, 1300))
    seen = np.zeros(data.shape, np.int8)
    with io_counts() as counts:
        for p in src.pieces("w", max_bytes=max_bytes, reuse=True):
            assert p.data.nbytes <= max(max_bytes, 1300 * 4)
            assert np.array_equal(p.data, data[p.box])
            seen[p.box] += 1
    assert (seen == 1).all()
    assert [n for (kind, _), n in counts.items() if kind == "chunk decoded"] == [1]


def test_stored_values_compare_in_their_data_files_piece_by_piece(tmp_path):
    """`reader.same_stored` (verify's copied arrays): equal stored values are equal, one byte
    flipped in the second 8 MiB piece of a value is found, and a value not in a local data
    file is left to the kvstore (None)."""
    data = np.random.default_rng(1).integers(0, 1 << 16, size=(5 << 20,)).astype(np.uint16)
    a, b, c = (_item(tmp_path / n, False, data, (data.size,)) for n in "abc")
    key = f"w/{a.layout('w').key((0,))}"
    path, offset, length = c.value_file(key)
    assert length > stored_values.PIECE + 100  # compressed, still over one piece
    with open(path, "r+b") as f:  # the stored bytes damaged, the length kept
        f.seek(offset + stored_values.PIECE + 100)
        byte = f.read(1)[0]
        f.seek(offset + stored_values.PIECE + 100)
        f.write(bytes([byte ^ 1]))
    assert reader.same_stored(a, key, b, key) is True
    assert reader.same_stored(a, key, c, key) is False
    os.truncate(path, offset + stored_values.PIECE)  # cut short: the kvstore's read reports it
    assert reader.same_stored(a, key, c, key) is None
    b._value_files = {}  # no data file known (as on an object store)
    assert reader.same_stored(a, key, b, key) is None


def test_values_stored_inline_are_read_from_the_b_tree(tmp_path):
    """Small values (and the zarr metadata) that Orbax stores inline in the OCDBT B-tree are
    read from the walk of the B-tree done when the item is opened (`stored_values.InlineValue`,
    `ItemReader.small_value`): the bytes the kvstore reads, with no kvstore read."""
    import orbax.checkpoint as ocp

    from orbax_maxtext_layout.orbax_io.stored_values import InlineValue

    rng = np.random.default_rng(3)
    tree = {"a": np.arange(7, dtype=np.float32), "b": rng.normal(size=(3, 5)).astype(np.float32)}
    path = epath.Path(tmp_path) / "small"
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(path, args=ocp.args.PyTreeSave(tree))
    src = ItemReader.open(path)
    for name, want in tree.items():
        lay = src.layout(name)
        key = f"{name}/{lay.key((0,) * want.ndim)}"
        value = src.stored_value(key)
        assert isinstance(value, InlineValue)  # the control below reads the same key
        with value:
            assert bytes(value.read()) == bytes(src.kv.read(key).result().value)
            assert value.read() == b""  # read whole
        meta = f"{name}/.zarray" if not src.use_zarr3 else f"{name}/zarr.json"
        assert src.small_value(meta) == bytes(src.kv.read(meta).result().value)
        assert src.read_whole(name).tobytes() == want.tobytes()
    assert src.stored_value("a/nothing") is None and src.small_value("a/nothing") is None
