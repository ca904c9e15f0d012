"""The safetensors sink of export-hf: files laid out from shapes alone, written tensor by
tensor in any order, read back by the safetensors library itself."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import mmap
import random

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from orbax_maxtext_layout.formats import safetensors_writer as so

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - jax brings ml_dtypes
    BF16 = None


def _tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for i in range(12):
        shape = tuple(int(x) for x in rng.integers(1, 9, size=int(rng.integers(1, 4))))
        dtype = [np.float32, np.float16, np.int32, np.float64][i % 4]
        out[f"model.layers.{i}.w{i % 3}.weight"] = (rng.standard_normal(shape) * 9).astype(dtype)
    out["model.embed_tokens.weight"] = rng.standard_normal((5, 3)).astype(np.float32)
    return out


def _write(tmp_path, arrays: dict[str, np.ndarray], max_shard_size: int) -> list[so.Shard]:
    shards = so.layout_shards(
        [so.Tensor(n, a.shape, a.dtype) for n, a in arrays.items()], max_shard_size
    )
    files = [so.ShardFile(str(tmp_path / s.name), s) for s in shards]
    where = {t.name: f for f in files for t in f.shard.tensors}
    names = list(arrays)
    random.Random(0).shuffle(names)  # any order, from two threads
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda n: where[n].write(n, arrays[n]), names))
    for f in files:
        f.close()
    return shards


def test_one_file_reads_back_with_safetensors(tmp_path):
    arrays = _tensors(np.random.default_rng(0))
    shards = _write(tmp_path, arrays, so.DEFAULT_MAX_SHARD_SIZE)
    assert [s.name for s in shards] == ["model.safetensors"]
    assert so.index(shards) is None
    got = load_file(str(tmp_path / "model.safetensors"))
    assert set(got) == set(arrays)
    for n, a in arrays.items():
        assert got[n].dtype == a.dtype and got[n].shape == a.shape
        assert got[n].tobytes() == a.tobytes(), n
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}
    assert (tmp_path / "model.safetensors").stat().st_size == shards[0].size


def test_shards_split_greedily_over_sorted_names_with_a_consistent_index(tmp_path):
    arrays = _tensors(np.random.default_rng(1))
    limit = 300
    shards = _write(tmp_path, arrays, limit)
    n = len(shards)
    assert n > 2
    assert [s.name for s in shards] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    # MaxText's shard_checkpoint: sorted names, a new file when the next would pass the limit
    order = [t.name for s in shards for t in sorted(s.tensors, key=lambda t: t.name)]
    assert order == sorted(arrays)
    for s, nxt in itertools.pairwise(shards):
        assert s.data_bytes + min(nxt.tensors, key=lambda t: t.name).nbytes > limit
    idx = so.index(shards)
    assert idx["metadata"]["total_size"] == sum(a.nbytes for a in arrays.values())
    assert set(idx["weight_map"]) == set(arrays)
    for name, file in idx["weight_map"].items():
        got = load_file(str(tmp_path / file))
        assert got[name].tobytes() == arrays[name].tobytes()
        with safe_open(str(tmp_path / file), "np") as f:
            assert f.metadata() == {"format": "pt"}
    json.dumps(idx)


@pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes")
def test_bfloat16_is_named_bf16(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3).astype(BF16)
    _write(tmp_path, {"x": a}, so.DEFAULT_MAX_SHARD_SIZE)
    header_len = int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((tmp_path / "model.safetensors").read_bytes()[8 : 8 + header_len])
    assert header["x"]["dtype"] == "BF16" and header["x"]["shape"] == [2, 3]
    assert (8 + header_len) % 8 == 0


def test_a_tensor_of_another_shape_or_dtype_is_refused_and_a_missing_one_blocks_close(tmp_path):
    shard = so.layout_shards(
        [so.Tensor("a", (2, 2), np.float32), so.Tensor("b", (3,), np.float32)]
    )[0]
    f = so.ShardFile(str(tmp_path / shard.name), shard)
    with pytest.raises(ValueError, match="header says"):
        f.write("a", np.zeros((4,), np.float32))
    f2 = so.ShardFile(str(tmp_path / "other.safetensors"), shard)
    f2.write("a", np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="never written"):
        f2.close()
    f.abandon()
    f2.abandon()


def test_row_runs_leave_the_page_cache_before_their_tensor_is_complete(tmp_path):
    """A tensor written in row runs (a chunk of an fsdp save that spans every layer: its
    tensors complete only with the param's last chunk) leaves the page cache run by run,
    not when complete: runs synced before the next is written are out."""
    from test_pagecache import DROPS, page_cache_drops, resident

    if not page_cache_drops():
        pytest.skip(DROPS)

    a = np.random.default_rng(2).standard_normal((512, 1024)).astype(np.float32)
    shard = so.layout_shards([so.Tensor("b", a.shape, a.dtype)])[0]
    path = tmp_path / shard.name
    f = so.ShardFile(str(path), shard)
    f.write_box("b", (0, 0), a[:128])
    f.write_box("b", (128, 0), a[128:256])  # the first run: written back, then evicted
    f.write_box("b", (256, 0), a[256:384])  # the second too
    run = 128 * 1024 * 4 // mmap.PAGESIZE
    assert f.missing == ["b"]
    # the last run (129 pages: the data is not page-aligned), the header's page, and the
    # page the first two runs share
    assert resident(path) <= run + 3, resident(path)
    f.write_box("b", (384, 0), a[384:])
    f.close()
    assert load_file(str(path))["b"].tobytes() == a.tobytes()


def test_a_closed_shard_is_out_of_the_page_cache_and_reads_back(tmp_path):
    """Tensors written whole, by row runs and by column blocks (the mapped copy) leave the
    page cache once the shard is closed (`pagecache.RangeDropper`), bytes intact."""
    from test_pagecache import DROPS, page_cache_drops, resident

    if not page_cache_drops():
        pytest.skip(DROPS)

    rng = np.random.default_rng(1)
    arrays = {n: rng.standard_normal((512, 1024)).astype(np.float32) for n in "abc"}
    shard = so.layout_shards([so.Tensor(n, a.shape, a.dtype) for n, a in arrays.items()])[0]
    path = tmp_path / shard.name
    f = so.ShardFile(str(path), shard)
    f.write("a", arrays["a"])
    for r in range(0, 512, 128):  # row runs
        f.write_box("b", (r, 0), arrays["b"][r : r + 128])
    for c in range(0, 1024, 256):  # column blocks: every row's run, through a mapping
        f.write_box("c", (0, c), arrays["c"][:, c : c + 256])
    f.close()
    assert resident(path) == 0
    got = load_file(str(path))
    for n, a in arrays.items():
        assert got[n].tobytes() == a.tobytes(), n


def test_the_sink_lays_out_writes_and_publishes_the_index_then_the_config_last(tmp_path):
    """`SafetensorsSink`, the `formats.sink.Sink` the exports write through: the same files
    as `layout_shards` and `ShardFile` (the index as MaxText writes it, json with indent 2),
    parts written by name and by box, the index and the config published by `finish`."""
    from etils import epath

    from orbax_maxtext_layout.formats.sink import Part, PartWriter, Sink
    from orbax_maxtext_layout.storage.store import store_for

    arrays = _tensors(np.random.default_rng(3))
    tensors = [so.Tensor(n, a.shape, a.dtype) for n, a in arrays.items()]
    sink = so.SafetensorsSink(300)
    assert isinstance(sink, Sink)
    parts = sink.layout(tensors)
    assert parts == so.layout_shards(tensors, 300) and len(parts) > 2
    assert all(isinstance(p, Part) and p.signature == p.header for p in parts)
    for k, p in enumerate(parts):
        f = sink.open(p, str(tmp_path / p.name))
        assert isinstance(f, PartWriter) and len(f.missing) == len(p.tensors)
        for t in p.tensors:
            a = arrays[t.name]
            if k % 2 and a.ndim > 1:  # by box: two halves of the first axis
                h = a.shape[0] // 2
                f.write_box(t.name, (0,) * a.ndim, a[:h])
                f.write_box(t.name, (h,) + (0,) * (a.ndim - 1), a[h:])
            else:
                f.write(t.name, a)
        f.close()
    work = epath.Path(tmp_path)
    sink.finish(store_for(work), work, parts, ("config.json", '{"a": 1}'))
    index = (tmp_path / so.INDEX_FILE).read_text()
    assert index == json.dumps(so.index(parts), indent=2)
    assert (tmp_path / "config.json").read_text() == '{"a": 1}'
    for name, file in json.loads(index)["weight_map"].items():
        assert load_file(str(tmp_path / file))[name].tobytes() == arrays[name].tobytes()
    # one file: no index; a named file (the adapter's) is laid out under its name
    one = so.SafetensorsSink(weights_file="adapter_model.safetensors")
    (part,) = one.layout(tensors)
    assert part.name == "adapter_model.safetensors" and one.index([part]) == {}
    assert part.header == so.layout_shards(tensors)[0].header
