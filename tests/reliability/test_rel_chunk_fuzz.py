"""Fuzz (hypothesis, seeded) of zarr metadata and chunk streams under the chunk reader (issue 46).

Copies of three fixtures (zarr2 in OCDBT, Orbax's sharded zarr3, Pathways' zarr2 in one
directory per array) have one stored value of an array replaced at a time: its zarr
metadata (random edits of shape, chunks, dtype, codecs and the rest, or of its JSON text)
or a chunk (truncated, bits flipped, bytes or a zstd frame appended; for a zarr3 shard, its
frame edited under a rebuilt index too). A child under a memory cap (`rel_chunk_child`)
reads the array with `chunks.read_whole` and `chunks.pieces`, through tensorstore and
through the streamed path, and with stock tensorstore where the library accepted the
metadata. Each read may only:

- raise `CheckpointReadError`, or
- return the original values, or what stock tensorstore reads from the same bytes (a flip
  in an unchecksummed zstd literal changes values for every reader alike: Orbax writes
  frames without checksums).

Never another exception, never values of its own, never an abort.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import rel_support as S
import zstandard
from conftest import address_space_cap
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from ocdbt_craft import crc32c  # tests/ocdbt_craft.py, proved by test_ocdbt_craft

set_hypothesis_home_dir(S.session_dir() / "hypothesis")

SETTINGS = settings(
    max_examples=S.scale(20, 400),
    deadline=None,
    database=None,  # write nothing outside tests/reliability
    derandomize=not S.FULL,  # CI: the same inputs on every machine
    suppress_health_check=list(HealthCheck),
)
CAP = address_space_cap()  # the child's address space (scales with the cores)
KERNEL = "base.decoder.layers.mlp.wi_0.kernel.value"  # float32[16, 3, 32]
COUNT = "base.decoder.dropout.rngs.params.count.value"  # a scalar
ITEMS = {  # fixture -> (item, zarr3, sharded)
    "zarr2": (S.RL, False),
    "zarr3": (S.V1_RL, True),
    "pathways": (S.PATHWAYS, False),
}


def _kv(item: Path):
    import tensorstore as ts

    if (item / "manifest.ocdbt").exists():
        return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
    return ts.KvStore.open(f"file://{item}/").result()


@pytest.fixture(scope="module")
def items(tmp_path_factory) -> dict[str, tuple[Path, bool]]:
    root = tmp_path_factory.mktemp("chunk-fuzz")
    return {k: (S.copy_fixture(rel, root) / "model_params", z) for k, (rel, z) in ITEMS.items()}


# -- edits ---------------------------------------------------------------------------------
DIMS = st.sampled_from([-1, 0, 1, 2, 3, 16, 32, 48, 1 << 20, 1 << 40, 1 << 63, True, 1.5, "3"])
SHAPES = st.one_of(st.lists(DIMS, max_size=4), st.none(), st.just("16"), st.just({}))
DTYPES = st.sampled_from(
    ["<f4", ">f4", "<f8", "<i4", "<u4", "|u1", "<f2", "bfloat16", "float32", "int32", "uint32",
     "|O", "|V4", "|S4", "<U2", "<M8", "x", "", 5, None, [["a", "<f4"]], [["a", "<f4", [1 << 20]]]]
)  # fmt: skip
ZARR2_KEYS = {
    "shape": SHAPES,
    "chunks": SHAPES,
    "dtype": DTYPES,
    "compressor": st.sampled_from(
        [None, {"id": "zstd"}, {"id": "zstd", "level": 22}, {"id": "blosc"}, {"id": "zlib"}, 7]
    ),
    "filters": st.sampled_from([None, [], [{"id": "delta", "dtype": "<f4"}], "x"]),
    "order": st.sampled_from(["C", "F", "X", None]),
    "dimension_separator": st.sampled_from([".", "/", "", None]),
    "fill_value": st.sampled_from([None, 0, "NaN", [1, 2], 1e308]),
    "zarr_format": st.sampled_from([2, 3, None]),
}
INNER = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}]
ZARR3_KEYS = {
    "shape": SHAPES,
    "data_type": DTYPES,
    "grid": SHAPES,  # the chunk grid's chunk_shape (and, as Orbax writes, the inner chunk's)
    "inner": SHAPES,  # the inner chunk's alone
    "chunk_grid": st.sampled_from([None, {"name": "rectilinear"}, "x"]),
    "codecs": st.sampled_from(
        [None, [], INNER, INNER[:1], [INNER[0], {"name": "gzip"}], [{"name": "sharding_indexed"}]]
    ),
    "inner_codecs": st.sampled_from([INNER[:1], [INNER[0], {"name": "blosc"}], [], None]),
    "index_codecs": st.sampled_from([[INNER[0]], [{"name": "crc32c"}], None]),
    "index_location": st.sampled_from(["start", "end", "middle"]),
    "chunk_key_encoding": st.sampled_from([{"name": "v2"}, {"name": "default"}, None]),
    "node_type": st.sampled_from(["group", "array", None]),
}


def _edit_zarr3(meta: dict, key: str, value) -> None:
    shard = meta["codecs"][0].get("configuration", {}) if meta.get("codecs") else {}
    if key == "grid":
        meta["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": value}}
        shard["chunk_shape"] = value
    elif key == "inner":
        shard["chunk_shape"] = value
    elif key in ("inner_codecs", "index_codecs", "index_location"):
        shard[key.removeprefix("inner_")] = value
    else:
        meta[key] = value


@st.composite
def metadata_edits(draw, original: bytes, zarr3: bool) -> bytes:
    """The zarr metadata ``original`` with 1-3 members changed, or its text damaged."""
    if draw(st.integers(0, 4)) == 0:  # the text itself
        return draw(
            st.one_of(
                st.integers(0, len(original) - 1).map(lambda n: original[:n]),
                st.sampled_from([b"[]", b"null", b"3", b'"x"', b"{", b"\xff\xfe"]),
            )
        )
    meta = json.loads(original)
    keys = ZARR3_KEYS if zarr3 else ZARR2_KEYS
    for key in draw(st.lists(st.sampled_from(sorted(keys)), min_size=1, max_size=3)):
        value = draw(keys[key])
        if zarr3:
            _edit_zarr3(meta, key, value)
        else:
            meta[key] = value
    return json.dumps(meta).encode()


def _stream_edits(data: bytes):
    """``data`` truncated, bits flipped, or bytes (or a zstd frame) appended."""
    n = len(data)
    flips = st.lists(st.tuples(st.integers(0, n - 1), st.integers(1, 255)), min_size=1, max_size=4)
    return st.one_of(
        st.integers(0, n - 1).map(lambda k: data[:k]),
        flips.map(lambda fl: _flip(data, fl)),
        st.binary(min_size=1, max_size=64).map(lambda extra: data + extra),
        st.binary(max_size=64).map(lambda extra: data + zstandard.compress(extra)),
    )


def _flip(data: bytes, flips) -> bytes:
    b = bytearray(data)
    for i, x in flips:
        b[i] ^= x
    return bytes(b)


@st.composite
def chunk_edits(draw, original: bytes, sharded: bool) -> bytes:
    """A stored chunk edited; a shard: its bytes, or its frame under a rebuilt index."""
    if not sharded or draw(st.booleans()):
        return draw(_stream_edits(original))
    offset, length = struct.unpack("<QQ", original[-20:-4])
    frame = draw(_stream_edits(original[offset : offset + length]))
    index = struct.pack("<QQ", 0, len(frame))
    return frame + index + struct.pack("<I", crc32c(index))


# -- the run -------------------------------------------------------------------------------
def _collect(strategy, base: dict, original: bytes, cases: list[dict]) -> None:
    """Appends to ``cases`` each value ``strategy`` draws that differs from ``original``."""

    @SETTINGS
    @given(value=strategy)
    def draw(value):
        if value != original:
            cases.append({**base, "kind": "edit", "value": value.hex()})

    draw()


def _draw_cases(items: dict) -> list[dict]:
    """Every case, drawn here (the reads run in the child): first, per array, its stored
    values unchanged (the originals to compare with)."""
    cases: list[dict] = []
    for fixture, (item, zarr3) in items.items():
        kv = _kv(item)
        for array in (KERNEL, COUNT):
            meta_key = f"{array}/{'zarr.json' if zarr3 else '.zarray'}"
            stored = sorted(
                k.decode() for k in kv.list().result() if k.startswith(f"{array}/".encode())
            )
            chunk_key = next(k for k in stored if k != meta_key)
            for key in (meta_key, chunk_key):
                original = bytes(kv.read(key).result().value)
                base = {"fixture": fixture, "item": str(item), "array": array, "key": key}
                cases.append({**base, "kind": "original", "value": original.hex()})
                strategy = (
                    metadata_edits(original, zarr3)
                    if key == meta_key
                    else chunk_edits(original, zarr3)
                )

                _collect(strategy, base, original, cases)
    return cases


def _findings(cases: list[dict], results: list[dict]) -> list[str]:
    """Every read that escaped, or returned values neither original nor stock's."""
    original: dict[str, str] = {}
    bad = []
    for case, got in zip(cases, results, strict=True):
        value = bytes.fromhex(case["value"])
        shown = (
            value.decode("utf-8", "replace")
            if case["key"].endswith(("json", "zarray"))
            else (f"{len(value)} bytes")
        )
        where = f"{case['fixture']} {case['key']} = {shown}"
        if case["kind"] == "original":
            assert set(got.values()) - {None} == {got["whole/tensorstore"]}, (where, got)
            original[case["array"] + case["fixture"]] = got["whole/tensorstore"]
            continue
        ok = {"refused", original[case["array"] + case["fixture"]]}
        if got.get("stock") and not got["stock"].startswith("stock refused"):
            ok.add(got["stock"])
        for read, outcome in got.items():
            if read != "stock" and outcome not in ok:
                bad.append(f"{read}: {outcome} ({where}; stock: {got.get('stock')})")
    return bad


def test_chunk_reader_fuzz_in_a_capped_child(items, tmp_path):
    cases = _draw_cases(items)
    spec, out = tmp_path / "cases.json", tmp_path / "results.json"
    spec.write_text(json.dumps(cases))
    res = subprocess.run(
        [sys.executable, str(S.HERE / "rel_chunk_child.py"), str(CAP), str(spec), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=S.REPO,
        env={**os.environ, **S.child_env()},
    )
    results = json.loads(out.read_text()) if out.exists() else []
    assert res.returncode == 0, (
        f"the child ended with {res.returncode} after {len(results)} of {len(cases)} cases "
        f"(next: {cases[len(results)] if len(results) < len(cases) else None}): "
        f"{res.stderr[-3000:]}"
    )
    bad = _findings(cases, results)
    assert not bad, f"{len(bad)} of {len(cases)} reads:\n" + "\n".join(bad[:30])
    S.count("fuzzed", len(cases))
