"""The one chunk-aware reader (issue 30): every stored chunk decoded once, per-device chunks.

The steps are written as a pod saves them: `sharded_child.py` runs stock Orbax (through
google-tunix's save path, `writers.write_tunix_step`) on 8 CPU devices, each Param sharded
on its largest non-layer axis, so every large array is stored as 8 chunks that each span
all 3 layers (zarr3: Orbax's shards of one inner chunk; zarr2: plain chunks). Reading such
an array layer by layer decodes each chunk 3 times; the counts below (``("chunk decoded",
...)`` of `orbax_files.io_counts`) must be exactly one per stored chunk.
"""

from __future__ import annotations

import collections
import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import writers as W
from conftest import child_env, raw, restore_flat
from etils import epath
from test_pagecache import page_cache_drops, resident

from orbax_maxtext_layout import convert_step, verify_step
from orbax_maxtext_layout.errors import CheckpointReadError
from orbax_maxtext_layout.model.scan_targets import unroll_target
from orbax_maxtext_layout.model.target import Target
from orbax_maxtext_layout.orbax_io import (
    chunks,
    item_writer,
    stored_values,
    zarr,
)
from orbax_maxtext_layout.orbax_io.orbax_files import io_counts
from orbax_maxtext_layout.orbax_io.reader import ItemReader

HERE = Path(__file__).resolve().parent
EMB = 8192  # wi, wo, embedding and logits of 1.5-2 MiB: past `zarr.SMALL`, streamed


def _write(roots: dict[bool, Path]) -> dict[bool, Path]:
    """``{zarr3: step 1 under root}``, written by one child."""
    args = [a for zarr3, root in roots.items() for a in (root, "1", EMB, str(zarr3).lower())]
    subprocess.run(
        [sys.executable, str(HERE / "sharded_child.py"), *map(str, args)],
        check=True,
        capture_output=True,
        env=child_env(),  # its 8 CPU devices, whatever this process's backend
    )
    return {zarr3: root / "1" for zarr3, root in roots.items()}


@pytest.fixture(scope="session")
def sharded_steps(tmp_path_factory) -> dict[bool, Path]:
    """Both steps, written once in each test process (with ``-n``, each worker): a
    module-scoped parametrized fixture was written again at every switch of parameter
    between the tests a worker was handed. Tests only read them; one that changes a step
    changes a copy."""
    made = tmp_path_factory.mktemp("sharded")
    return _write({True: made / "zarr3", False: made / "zarr2"})


@pytest.fixture(params=[True, False], ids=["zarr3", "zarr2"])
def step(request, sharded_steps) -> Path:
    return sharded_steps[request.param]


def _restore(item_dir: Path) -> dict:
    """Stock Orbax's restore of an item saved from 8 devices, as host numpy arrays (its
    recorded shardings name devices this process does not have)."""
    import jax
    import orbax.checkpoint as ocp

    from orbax_maxtext_layout.base.treepaths import flatten, norm_key

    handler = ocp.PyTreeCheckpointHandler()
    meta = handler.metadata(epath.Path(item_dir)).tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    tree = handler.restore(epath.Path(item_dir), args=ocp.args.PyTreeRestore(restore_args=args))
    flat = flatten(tree, is_leaf=lambda x: hasattr(x, "dtype"))
    return {tuple(norm_key(k) for k in p): np.asarray(v) for p, v in flat.items()}


def _streamed(src: ItemReader) -> dict[str, zarr.ChunkLayout]:
    names = {
        k.decode().rsplit("/", 1)[0]
        for k in src.kv.list().result()
        if k.endswith(b"/zarr.json") or k.endswith(b"/.zarray")
    }
    lays = {n: src.layout(n) for n in names}
    return {n: lay for n, lay in lays.items() if lay is not None and lay.streamed}


def _decodes(counts: collections.Counter) -> dict[str, int]:
    return {k: n for (kind, k), n in counts.items() if kind == "chunk decoded"}


@pytest.mark.parametrize("max_bytes", [64 << 20, 96 << 10], ids=["whole-chunks", "streamed"])
def test_pieces_tile_each_array_decoding_each_stored_chunk_once(step, max_bytes):
    ctx = item_writer.ts_context()
    src = ItemReader.open(epath.Path(step / "model_params"), ctx)
    want = {".".join(map(str, p)): x for p, x in _restore(step / "model_params").items()}
    lays = _streamed(src)
    assert len(lays) == 4 and all(lay.nbytes // lay.chunk_bytes == 8 for lay in lays.values())
    for name, lay in lays.items():
        out = np.zeros(lay.shape, lay.dtype)
        seen = np.zeros(lay.shape, np.int8)
        with io_counts() as counts:
            got = list(src.pieces(name, max_bytes=max_bytes))
        for p in got:
            assert p.data.nbytes <= max(max_bytes, 0) or p.data.nbytes == lay.chunk_bytes
            out[p.box] = p.data
            seen[p.box] += 1
        assert (seen == 1).all(), name  # the pieces tile the array, none twice
        np.testing.assert_array_equal(out, want[name], err_msg=name)
        decodes = _decodes(counts)
        assert len(decodes) == 8 and set(decodes.values()) == {1}, (name, decodes)
        if max_bytes < lay.chunk_bytes:  # a chunk over the size is streamed in row runs
            assert len(got) > 8, name
        np.testing.assert_array_equal(src.read_whole(name), want[name])


def test_unroll_and_its_verify_decode_each_stored_chunk_once(step, tmp_path):
    """``convert --unroll`` writes each layer of a per-device-chunked scanned param from one
    walk of its chunks (not one walk per layer), and ``verify`` replays it the same way."""
    import shutil

    scanned = Target.from_nnx(W.abstract_model(scanned=True, emb=EMB, vocab=64))
    out = tmp_path / "1"
    shutil.copytree(step, out)  # converted beside its legacy items, which verify reads
    with io_counts() as counts:
        report = convert_step(out, unroll_target(scanned), rescan="unroll", memory_budget=16 << 20)
    assert report.status == "converted", report
    # the written data files left the page cache once on the disk (`pagecache`); what
    # stays is B-tree nodes, read again by the check before the commit
    data = list((out / "items" / item_writer.DATA_DIR).iterdir())
    pages = sum(-(-p.stat().st_size // mmap.PAGESIZE) for p in data)
    assert pages > 128
    if page_cache_drops():  # gVisor (the TPU host) keeps every page, whatever it is told
        assert sum(resident(p) for p in data) < pages // 10
    decodes = _decodes(counts)
    big = [k for k in decodes if "mlp" in k]
    assert len(big) == 16 and set(decodes.values()) == {1}, decodes
    got = restore_flat(out / "items")
    src = _restore(out / "model_params")
    for i in range(3):
        for mod in ("wi", "wo"):
            have = raw(got[("params", "params", "decoder", f"layers_{i}", "mlp", mod, "kernel")])
            stacked = src[("decoder", "layers", "mlp", mod, "kernel", "value")]
            np.testing.assert_array_equal(have, stacked[:, i])
    with io_counts() as counts:
        result = verify_step(out)
    assert result.ok, result.problems
    decodes = _decodes(counts)
    assert [k for k in decodes if "mlp" in k] and set(decodes.values()) == {1}, decodes
    # both sides: the source's chunks and the unrolled layers' own chunks, each once
    written = [k for k in decodes if "/items/" in k and "layers_1.mlp.wo" in k]
    assert written and all(decodes[k] == 1 for k in written), decodes

    # a written layer's chunk damaged: verify names that layer (and only it)
    ctx = item_writer.ts_context()
    dst = ItemReader.open(epath.Path(out / "items"), ctx)
    name = "params.params.decoder.layers_1.mlp.wo.kernel"
    key = f"{name}/{dst.layout(name).key((0, 0))}"
    data_file, offset, length = dst.value_file(key)
    with open(data_file, "r+b") as f:
        f.seek(offset + length // 2)
        f.write(b"\0" * (length // 4))
    result = verify_step(out)
    assert not result.ok
    assert any("layers_1" in p and "wo" in p for p in result.problems), result.problems
    assert not any("layers_2" in p for p in result.problems), result.problems


def test_a_damaged_chunk_is_named(step, tmp_path):
    """A stored chunk cut short stops the read, naming the array (never zeros)."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(step, copy)
    ctx = item_writer.ts_context()
    src = ItemReader.open(epath.Path(copy / "model_params"), ctx)
    name = next(n for n in _streamed(src) if "wi" in n)
    key = f"{name}/{src.layout(name).key((0, 0, 0))}"
    data_file, offset, length = src.value_file(key)
    with open(data_file, "r+b") as f:  # the chunk's zstd frame, its middle zeroed
        f.seek(offset + length // 2)
        f.write(b"\0" * (length // 4))
    with pytest.raises(CheckpointReadError, match=name.replace(".", r"\.")):
        list(src.pieces(name, max_bytes=1 << 20))


def test_reading_an_array_whole_leaves_a_held_piece_intact(step):
    """A merge reads its factors whole (`read_whole`) while a piece of its base, decoded
    into the worker's reused buffer, is held: the piece must keep its values."""
    ctx = item_writer.ts_context()
    src = ItemReader.open(epath.Path(step / "model_params"), ctx)
    first, other = sorted(_streamed(src))[:2]
    held = next(src.pieces(first, max_bytes=64 << 20, reuse=True))
    before = held.data.copy()
    src.read_whole(other)
    np.testing.assert_array_equal(held.data, before)


def test_a_stored_chunk_is_read_through_one_reused_buffer(step, monkeypatch):
    """zstandard's reader asks for a chunk's bytes piece by piece (64 KiB here): every read
    lands in one buffer of the thread (a fresh ``bytes`` per read took fresh pages, which
    the kernel zeroes), and the decoded pieces stay right."""
    monkeypatch.setattr(stored_values, "PIECE", 64 << 10)
    ctx = item_writer.ts_context()
    src = ItemReader.open(epath.Path(step / "model_params"), ctx)
    want = {".".join(map(str, p)): x for p, x in _restore(step / "model_params").items()}
    for name, lay in _streamed(src).items():
        out = np.zeros(lay.shape, lay.dtype)
        for p in src.pieces(name, max_bytes=96 << 10, reuse=True):
            out[p.box] = p.data
        np.testing.assert_array_equal(out, want[name], err_msg=name)
        frames = chunks._frames(src, name, lay, name, scratch="test")  # holds the file open
        _, frame = next(frames)
        first, second = frame.read(4096), frame.read(4096)
        assert isinstance(frame, stored_values.FileValue) and len(first) == len(second) == 4096
        at = [np.frombuffer(v, np.uint8).__array_interface__["data"][0] for v in (first, second)]
        assert at[0] == at[1], name  # the second read reused the first's buffer
