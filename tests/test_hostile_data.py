"""Hostile checkpoints (issue 46): chunk streams, zarr metadata and JSON files that lie.

Checkpoints are untrusted input. Each case writes a real checkpoint (stock Orbax, or a copy
of a fixture) and then edits it as an attacker would: a key of its OCDBT database rewritten
through tensorstore (`_put`: a chunk, or an array's zarr metadata), or one of its JSON
files. The library must refuse each with a `CheckpointReadError` naming the file, the array
and the chunk (the CLI: exit 1, one line, no traceback), write nothing, and never return
wrong values, abort the process or allocate what a forged shape asks for. Reads that could
abort or allocate run in a child under a memory cap (`hostile_child.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
import zstandard
from conftest import MAXTEXT_NATIVE, address_space_cap, child_env, copy_fixture, tree_digest
from etils import epath
from ocdbt_craft import crc32c  # tests/ocdbt_craft.py, proved by test_ocdbt_craft

from orbax_maxtext_layout import cli
from orbax_maxtext_layout.errors import CheckpointReadError
from orbax_maxtext_layout.orbax_io import (
    item_writer,
    stepmeta,
)
from orbax_maxtext_layout.orbax_io.reader import ItemReader
from orbax_maxtext_layout.orbax_io.spec import read_specs

HERE = Path(__file__).resolve().parent
RL = "tunix017/rl_run/checkpoints/actor/2"  # zarr2
V1_RL = "tunix_snapshot_v1/rl_run/checkpoints/actor/2"  # zarr3, Orbax's shards
LORA = "maxtext025/lora_run/checkpoints/2"
BASE = "maxtext025/pretrain_run/checkpoints/1"
KERNEL = "base.decoder.layers.mlp.wi_0.kernel.value"  # float32[16, 3, 32] in RL and V1_RL
CAP = address_space_cap()  # the children's address space (scales with the cores)
W = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB: streamed (`SMALL`)


# -- writing hostile inputs ---------------------------------------------------------------
def _kv(item: Path) -> ts.KvStore:
    return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()


def _put_chunk(item: Path, key: str, frame: bytes, *, sharded: bool) -> None:
    """Stores ``frame`` as chunk ``key``; ``sharded``: as Orbax's zarr3 shard of one inner
    chunk (the frame, its index ``<QQ offset, length``, the index's crc32c)."""
    if sharded:
        index = struct.pack("<QQ", 0, len(frame))
        frame = frame + index + struct.pack("<I", crc32c(index))
    _kv(item).write(key, frame).result()


def _edit_json(item: Path, key: str, change) -> None:
    kv = _kv(item)
    meta = json.loads(bytes(kv.read(key).result().value))
    change(meta)
    kv.write(key, json.dumps(meta).encode()).result()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Items written by stock Orbax: ``w`` (float32[512, 1024]) and ``s`` (float32[3, 4]),
    in zarr2 and in Orbax's sharded zarr3; and the zarr3 one with ``w`` stored plain (one
    zstd frame per chunk, as this library writes zarr3)."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    root = tmp_path_factory.mktemp("saved")
    out = {}
    for layout, zarr3 in (("zarr2", False), ("zarr3-sharded", True)):
        c = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=zarr3))
        tree = {"w": jnp.asarray(W), "s": jnp.ones((3, 4), jnp.float32)}
        c.save(epath.Path(root / layout), args=ocp.args.PyTreeSave(tree))
        c.close()
        out[layout] = root / layout
    plain = root / "zarr3-plain"
    shutil.copytree(out["zarr3-sharded"], plain)
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}]
    _edit_json(plain, "w/zarr.json", lambda m: m.update(codecs=codecs))
    _put_chunk(plain, "w/c/0/0", zstandard.compress(W.tobytes()), sharded=False)
    out["zarr3-plain"] = plain
    return out


def _copy(saved: dict[str, Path], layout: str, tmp_path: Path) -> Path:
    item = tmp_path / layout
    shutil.copytree(saved[layout], item)
    return item


def _chunk_key(layout: str) -> str:
    return "w/0.0" if layout == "zarr2" else "w/c/0/0"


def _src(item: Path) -> ItemReader:
    return ItemReader.open(epath.Path(item), item_writer.ts_context())


def _all_reads_refused(item: Path, name: str, match: str) -> None:
    """`read_whole`, `pieces` (whole chunks, and row runs) and `read_chunk` of ``name``
    each raise `CheckpointReadError` matching ``match``."""
    src = _src(item)
    lay = src.layout(name)
    with pytest.raises(CheckpointReadError, match=match):
        src.read_whole(name)
    for max_bytes in (64 << 20, 256 << 10):
        with pytest.raises(CheckpointReadError, match=match):
            list(src.pieces(name, max_bytes=max_bytes))
    with pytest.raises(CheckpointReadError, match=match):
        src.read_chunk(name, (0,) * len(lay.shape), lay.chunk)


# -- chunk streams ------------------------------------------------------------------------
LAYOUTS = ["zarr2", "zarr3-sharded", "zarr3-plain"]


def _longer(how: str) -> bytes:
    """A stream of the chunk's bytes and 4 KiB more."""
    data, more = W.tobytes(), b"\x01" * 4096
    if how == "no-declared-size":  # one frame, no content size: only the end tells
        return zstandard.ZstdCompressor(write_content_size=False).compress(data + more)
    if how == "a-second-frame":  # the chunk's own frame, then another
        return zstandard.compress(data) + zstandard.compress(more)
    return zstandard.compress(data + more)  # "declared-size": the header says 2 MiB + 4 KiB


@pytest.mark.parametrize("how", ["no-declared-size", "a-second-frame", "declared-size"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_stream_longer_than_its_chunk_is_refused(saved, tmp_path, layout, how):
    """Decoding stops at the chunk's size; the bytes past it must be refused, not dropped
    (they were: the first 2 MiB came back as the array). Stock tensorstore refuses them."""
    item = _copy(saved, layout, tmp_path)
    _put_chunk(item, _chunk_key(layout), _longer(how), sharded=layout == "zarr3-sharded")
    key = _chunk_key(layout).split("/", 1)[1]
    _all_reads_refused(item, "w", rf"{item}: cannot read w: chunk {key}.*(more bytes|declares)")


def _declaring(size: int, data: bytes) -> bytes:
    """A zstd frame of ``data`` whose header declares ``size`` bytes."""
    frame = bytearray(zstandard.compress(data))
    fhd = frame[4]  # the frame header descriptor
    assert fhd >> 6 == 2  # a 4-byte content size field: after the window and the dict id
    struct.pack_into("<I", frame, 5 + (0 if fhd & 0x20 else 1) + (0, 1, 2, 4)[fhd & 3], size)
    assert zstandard.get_frame_parameters(bytes(frame)).content_size == size
    return bytes(frame)


@pytest.mark.parametrize(
    "declared,data",
    [(W.nbytes + 4096, W.tobytes() + b"\1" * 4096), (W.nbytes + 4096, W.tobytes())]
    + [(W.nbytes - 4096, W.tobytes())],
    ids=["larger-and-longer", "larger", "smaller"],
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_frame_declaring_another_size_is_refused_before_any_piece(
    saved, tmp_path, layout, declared, data
):
    """A frame whose header declares another size than the chunk's is refused from its
    header, before any piece of it is handed out (a writer would have written those).
    Before, pieces came out until zstd found the frame inconsistent at its end, or, for a
    longer stream, the read ended without error."""
    item = _copy(saved, layout, tmp_path)
    _put_chunk(item, _chunk_key(layout), _declaring(declared, data), sharded="sharded" in layout)
    src = _src(item)
    walk = src.pieces("w", max_bytes=256 << 10)
    with pytest.raises(CheckpointReadError, match=rf"declares {declared} bytes, the chunk holds"):
        next(walk)
    _all_reads_refused(item, "w", rf"{item}: cannot read w: chunk .* declares {declared} bytes")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_stored_streams_still_read_exactly(saved, layout):
    """The checks refuse nothing Orbax writes: every read gives the saved values."""
    src = _src(saved[layout])
    np.testing.assert_array_equal(src.read_whole("w"), W)
    out = np.zeros_like(W)
    for p in src.pieces("w", max_bytes=256 << 10):
        out[p.box] = p.data
    np.testing.assert_array_equal(out, W)
    np.testing.assert_array_equal(src.read_chunk("w", (0, 0), W.shape), W)


# -- children under a memory cap ----------------------------------------------------------
def _child(jobs: list[dict]) -> list[dict]:
    """Runs ``jobs`` in `hostile_child.py` (capped at `CAP`); its results, one per job. An
    abort (the process killed by a signal) fails the test, naming what it had done."""
    res = subprocess.run(
        [sys.executable, str(HERE / "hostile_child.py"), str(CAP), json.dumps(jobs)],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert res.returncode == 0 and len(lines) == len(jobs) + 1, (
        f"the child ended with {res.returncode} after {len(lines) - 1} of {len(jobs)} jobs "
        f"({lines[-1] if lines else None}): {res.stderr[-3000:]}"
    )
    return lines[1:]


def _refused(got: dict, *names: object) -> None:
    """A job refused with `CheckpointReadError` (API) or exit 1 and no traceback (CLI),
    naming each of ``names``."""
    if "cli" in got["job"]:
        assert got["error"] is None and got["rc"] == 1, got
        assert "Traceback" not in got["stderr"], got["stderr"]
        text = got["stderr"] + got["stdout"]  # verify: its report names the problem
    else:
        assert got.get("read_error"), got
        text = got["message"]
    for n in names:
        assert str(n) in text, (n, got)


def _converted(tmp_path: Path, rel: str) -> Path:
    """A copy of fixture step ``rel`` converted beside its legacy items (verify's input)."""
    step = copy_fixture(rel, tmp_path / "converted")
    rc = cli.main(["convert", str(step), "--target-from", str(MAXTEXT_NATIVE), "-q"])
    assert rc == 0
    return next(s for s in step.parent.iterdir() if (s / "items").is_dir())


def _forge_chunk_shape(item: Path, zarr3: bool, chunk: list[int]) -> str:
    """Sets the chunk shape of `KERNEL` in ``item``; returns its metadata key."""
    return _forge_chunk_shape_of(item, KERNEL, zarr3, chunk)


def _forge_chunk_shape_of(item: Path, name: str, zarr3: bool, chunk: list[int]) -> str:
    """Sets the chunk shape of array ``name`` in ``item``; returns its metadata key."""
    if zarr3:

        def change(m):
            m["chunk_grid"]["configuration"]["chunk_shape"] = chunk
            m["codecs"][0]["configuration"]["chunk_shape"] = chunk

        key = f"{name}/zarr.json"
    else:

        def change(m):
            m["chunks"] = chunk

        key = f"{name}/.zarray"
    _edit_json(item, key, change)
    return key


@pytest.mark.parametrize("rel", [RL, V1_RL], ids=["zarr2", "zarr3"])
def test_a_forged_chunk_shape_is_refused_not_aborted(tmp_path, rel):
    """A chunk of 2**20 x 2**20 x 32 for a 16 x 3 x 32 array: the reader aborted the process
    (std::bad_alloc) and verify with it; convert, comparing stored bytes, accepted it."""
    forged = [1 << 20, 1 << 20, 32]
    before = copy_fixture(rel, tmp_path / "before")  # forged before conversion
    key = _forge_chunk_shape(before / "model_params", rel == V1_RL, forged)
    after = _converted(tmp_path, rel)  # forged after conversion, in its legacy items
    _forge_chunk_shape(after / "model_params", rel == V1_RL, forged)
    digests = {p: tree_digest(p) for p in (before, after)}
    item = str(before / "model_params")
    got = _child(
        [
            {"call": "read_whole", "item": item, "name": KERNEL},
            {"call": "read_specs", "item": item},
            {"cli": ["inspect", str(before)]},
            {"cli": ["convert", str(before), "--target-from", str(MAXTEXT_NATIVE)]},
            {"cli": ["verify", str(after)]},
        ]
    )
    for g in got:
        _refused(g, key, "chunk shape")
    assert {p: tree_digest(p) for p in (before, after)} == digests  # nothing written


def test_a_chunk_larger_than_its_array_is_refused(tmp_path, capsys):
    """A chunk twice the array (Orbax's chunks never are): stock cannot read it; convert
    copied it on as it was, and verify passed the copy."""
    step = copy_fixture(RL, tmp_path)
    key = _forge_chunk_shape(step / "model_params", False, [32, 3, 32])
    before = tree_digest(step)
    with pytest.raises(CheckpointReadError, match=rf"{KERNEL}/\.zarray: invalid chunk shape"):
        read_specs(epath.Path(step / "model_params"))
    rc = cli.main(["convert", str(step), "--target-from", str(MAXTEXT_NATIVE), "-q"])
    err = capsys.readouterr().err
    assert rc == 1 and key in err and "Traceback" not in err, err
    assert tree_digest(step) == before


def test_a_forged_array_shape_is_refused_before_it_is_allocated(saved, tmp_path):
    """2**40 elements in the zarr metadata: numpy's raw MemoryError (4 TiB) before; now
    refused against the machine's memory, and a walk of the chunks stops at the first one
    that is not stored. In ``_METADATA`` (a write_shape past the array): refused."""
    zarr = _copy(saved, "zarr2", tmp_path)
    _edit_json(zarr, "w/.zarray", lambda m: m.update(shape=[1 << 20, 1 << 20]))
    meta = tmp_path / "meta"
    shutil.copytree(saved["zarr2"], meta)
    doc = json.loads((meta / "_METADATA").read_text())
    doc["tree_metadata"]["('w',)"]["value_metadata"]["write_shape"] = [1 << 20, 1 << 20]
    (meta / "_METADATA").write_text(json.dumps(doc))
    digests = {p: tree_digest(p) for p in (zarr, meta)}
    got = _child(
        [
            {"call": "read_whole", "item": str(zarr), "name": "w"},
            {"call": "pieces", "item": str(zarr), "name": "w"},
            {"call": "read_whole", "item": str(meta), "name": "w"},
            {"call": "read_specs", "item": str(meta)},
        ]
    )
    _refused(got[0], zarr, "w", "more than this machine's memory")
    _refused(got[1], zarr, "w", "chunk 0.1 is not stored")
    for g in got[2:]:
        _refused(g, meta, "w/.zarray", "_METADATA write_shape")
    assert {p: tree_digest(p) for p in (zarr, meta)} == digests


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr2", "zarr3"])
def test_a_grid_of_millions_of_tiny_chunks_is_refused_before_any_work(tmp_path, zarr3):
    """Issue 58: zarr metadata that claims [1, 1] chunks for a float32[2048, 2048] array
    (4.2 M chunks). The engine planned a task per claimed chunk first (~330 bytes each: 1.4
    GB and 20 s), then failed on the one stored chunk; stock fails at once on the missing
    chunks. Refused now from the metadata, naming the array's metadata key, in at most
    twice stock's time and memory (both in capped children)."""
    import orbax.checkpoint as ocp

    item = tmp_path / "item"
    tree = {"w": np.arange(2048 * 2048, dtype=np.float32).reshape(2048, 2048)}
    c = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=zarr3))
    c.save(epath.Path(item), args=ocp.args.PyTreeSave(tree))
    c.close()
    key = _forge_chunk_shape_of(item, "w", zarr3, [1, 1])
    ours = _child([{"call": "restore", "item": str(item), "name": "w"}])[0]
    _refused(ours, item, key, "a grid of 4,194,304 chunks")
    stock = _child([{"call": "stock_restore", "item": str(item), "name": "w"}])[0]
    assert stock["error"], stock  # stock refuses too (a chunk it expects is not stored)
    assert ours["seconds"] <= 2 * stock["seconds"] + 0.5, (ours, stock)
    assert ours["peak_rss_kib"] <= 2 * stock["peak_rss_kib"], (ours, stock)


# -- JSON files ---------------------------------------------------------------------------
def _write_huge_json(f: Path, size: int) -> None:
    """A valid JSON object of about ``size`` bytes: a list of zeros (what costs a parser
    most: an object per element)."""
    with open(f, "wb") as out:
        out.write(b'{"pad": [')
        block = b"0," * (1 << 19)
        for _ in range(size // len(block)):
            out.write(block)
        out.write(b"0]}")


def test_a_huge_step_metadata_file_is_refused_at_once(tmp_path):
    """A 200 MB ``_CHECKPOINT_METADATA`` (stock never reads it): parsed several times per
    command before (convert: 2.8 GB, a minute); now refused from its size, unread."""
    huge = tmp_path / "huge"
    _write_huge_json(huge, 200 << 20)
    step = copy_fixture(RL, tmp_path / "tunix")
    adapter = copy_fixture(LORA, tmp_path / "adapter")
    after = _converted(tmp_path, RL)
    steps = (step, adapter, after)
    for s in steps:
        os.unlink(s / "_CHECKPOINT_METADATA")
        os.link(huge, s / "_CHECKPOINT_METADATA")
    digests = {s: tree_digest(s) for s in steps}
    base = copy_fixture(BASE, tmp_path / "base")
    merged = tmp_path / "merged"
    config = ["--maxtext-config", "base.yml", "model_name=llama3.1-8b"]
    got = _child(
        [
            {"call": "step_metadata", "item": str(step)},
            {"cli": ["inspect", str(step)]},
            {"cli": ["convert", str(step), "--target-from", str(MAXTEXT_NATIVE)]},
            {"cli": ["verify", str(after)]},
            {"cli": ["merge-lora", str(adapter), "--base", str(base), "--out", str(merged)]},
            {"cli": ["export-hf", str(adapter), "--out", str(tmp_path / "hf"), *config]},
        ]
    )
    start = got[0]["peak_rss_kib"]
    for g in got:
        _refused(g, "_CHECKPOINT_METADATA", "64 MiB")
        assert g["seconds"] < 20, g
    assert got[-1]["peak_rss_kib"] - start < 256 << 10, got  # KiB: nothing of 200 MB held
    assert {s: tree_digest(s) for s in steps} == digests
    assert not merged.exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "rel", ["_METADATA", "_sharding", "array_metadatas/process_0"], ids=lambda r: r.split("/")[0]
)
def test_an_item_json_file_past_its_limit_is_refused_unread(tmp_path, rel):
    """300 MB (sparse: nothing is written, and nothing must be read): refused from its
    size, naming the limit, and not handed to Orbax's own reader either."""
    item = copy_fixture(RL, tmp_path) / "model_params"
    os.truncate(item / rel, 300 << 20)
    with pytest.raises(CheckpointReadError, match=rf"{rel}: .*larger than 256 MiB"):
        read_specs(epath.Path(item))


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "rel",
    [
        "_CHECKPOINT_METADATA",
        "model_params/_METADATA",
        "model_params/_sharding",
        "model_params/array_metadatas/process_0",
    ],
    ids=["step-metadata", "METADATA", "sharding", "array-metadatas"],
)
def test_deeply_nested_json_is_refused(tmp_path, capsys, rel):
    """100,000 nested lists: Python's parser raises RecursionError, which ended inspect and
    convert in a traceback. Now a CheckpointReadError naming the file, for every command."""
    step = copy_fixture(RL, tmp_path / "tunix")
    after = _converted(tmp_path, RL)
    for s in (step, after):
        (s / rel).write_text(DEEP)
    digests = {s: tree_digest(s) for s in (step, after)}
    runs = [
        ["inspect", str(step)],
        ["convert", str(step), "--target-from", str(MAXTEXT_NATIVE)],
        ["verify", str(after)],
    ]
    for argv in runs:
        rc = cli.main(argv)
        out, err = capsys.readouterr()
        text = err + out  # verify: its report names the problem
        assert rc == 1 and rel in text and "nested too deeply" in text, (argv, text)
    if rel.startswith("model_params/_METADATA"):
        with pytest.raises(CheckpointReadError, match="nested too deeply"):
            read_specs(epath.Path(step / "model_params"))
    if rel == "_CHECKPOINT_METADATA":
        with pytest.raises(CheckpointReadError, match="nested too deeply"):
            stepmeta.read(step)
    assert {s: tree_digest(s) for s in (step, after)} == digests


def test_deeply_nested_zarr_metadata_is_refused_before_tensorstore_reads_it(tmp_path):
    """A 100,000-deep ``.zarray``: Python's parser raised RecursionError, and the fallback
    to Orbax's metadata reader handed it to tensorstore, which crashed the process. Now
    refused where it is parsed. Run in a child: a crash must fail the test, not the worker."""
    step = copy_fixture(RL, tmp_path / "tunix")
    after = _converted(tmp_path, RL)
    key = f"{KERNEL}/.zarray"
    for s in (step, after):
        _kv(s / "model_params").write(key, DEEP.encode()).result()
    digests = {s: tree_digest(s) for s in (step, after)}
    item = str(step / "model_params")
    got = _child(
        [
            {"call": "read_specs", "item": item},
            {"call": "read_whole", "item": item, "name": KERNEL},
            {"cli": ["inspect", str(step)]},
            {"cli": ["convert", str(step), "--target-from", str(MAXTEXT_NATIVE)]},
            {"cli": ["verify", str(after)]},
        ]
    )
    for g in got:
        _refused(g, key, "nested too deeply")
    assert {s: tree_digest(s) for s in (step, after)} == digests


@pytest.mark.parametrize("rel", ["items/_METADATA", "_CHECKPOINT_METADATA"])
def test_deeply_nested_json_is_refused_by_merge_lora_and_export_hf(tmp_path, capsys, rel):
    adapter = copy_fixture(LORA, tmp_path / "adapter")
    base = copy_fixture(BASE, tmp_path / "base")
    target = base if rel.startswith("items") else adapter
    (target / rel).write_text(DEEP)
    digests = {s: tree_digest(s) for s in (adapter, base)}
    out = tmp_path / "out"
    config = ["--maxtext-config", "base.yml", "model_name=llama3.1-8b"]
    runs = [["merge-lora", str(adapter), "--base", str(base), "--alpha", "8", "--out", str(out)]]
    if target is adapter:
        runs.append(["export-hf", str(adapter), "--out", str(out), *config])
    for argv in runs:
        rc = cli.main(argv)
        err = capsys.readouterr().err
        assert rc == 1 and rel.split("/")[-1] in err and "nested too deeply" in err, (argv, err)
    assert {s: tree_digest(s) for s in (adapter, base)} == digests
    assert not out.exists()
