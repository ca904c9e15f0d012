"""The one chunk-aware reader: every stored chunk of an array decoded once, in pieces.

Orbax stores an array as a grid of chunks: one chunk for an array saved from one host,
one per device shard for a multi-device save (an fsdp save cuts every layer of a scanned
param into per-device chunks that each span all the layers; tensor parallelism cuts heads
or MLP columns). Reading a layer, or any box, that cuts across chunks decodes each chunk
it touches: read layer by layer, a 32-layer param is decoded 32 times.

`pieces` turns that around: it walks the stored chunks (zarr2 chunks, zarr3 chunks, and
the inner chunks of zarr3 shards, Orbax v1's layout) in storage order, decodes each once
(zstandard streams a plain zstd chunk, the layout Orbax writes; tensorstore reads any
other chunk as its own box) and hands out what it holds as `Piece`s: boxes of the array
with their values. A chunk larger than ``max_bytes`` (a 3.7 GiB kernel saved as one zstd
frame) is streamed in pieces of whole rows and never held whole. Consumers route each
piece to its destinations (a layer's Hugging Face tensor, an unrolled layer, a merged
weight) and drop it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from ..errors import CheckpointReadError
from ..storage.scratch import scratch_buffer
from . import tskv
from .orbax_files import CheckpointRefusedError, count, parse_zarr_metadata

# Below this an array is read whole by tensorstore: it decodes each chunk once too, and
# for small arrays its one call costs less than the chunk walk.
SMALL = 1 << 20
# A zstd frame header's content size when the frame does not declare one.
_UNKNOWN_SIZE = (1 << 64) - 1


class Piece(NamedTuple):
    """Values of the box of an array starting at ``start`` (``data.shape`` long)."""

    start: tuple[int, ...]
    data: np.ndarray

    @property
    def box(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + n) for s, n in zip(self.start, self.data.shape, strict=True))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How an array is stored: its shape and dtype, its chunk grid, and whether
    zstandard can decode its chunks (``plain``: little-endian bytes, zstd, nothing else)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunk: tuple[int, ...]  # a stored chunk (a shard's inner chunk)
    shard: tuple[int, ...] | None  # a zarr3 shard (outer chunk), or None
    index_bytes: int  # a shard's index at its end: 16 bytes per inner chunk, + 4 (crc32c)
    sep: str
    zarr3: bool
    plain: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunk) * self.dtype.itemsize

    @property
    def streamed(self) -> bool:
        """Whether `pieces` walks the chunks itself (else tensorstore reads them)."""
        return bool(self.shape) and self.plain and self.nbytes > SMALL and 0 not in self.shape

    def rows(self, max_bytes: int) -> tuple[int, int]:
        """``(k, run)``: a chunk over ``max_bytes`` is streamed in runs of ``run`` rows on
        axis ``k`` (single indices before it, whole axes after it). ``run`` divides the
        chunk's extent on ``k``, so pieces tile every chunk alike."""
        chunk, item = self.chunk, self.dtype.itemsize
        k = next(
            (a for a in range(len(chunk)) if math.prod(chunk[a + 1 :]) * item <= max_bytes),
            len(chunk) - 1,
        )
        most = max(1, max_bytes // max(1, math.prod(chunk[k + 1 :]) * item))
        return k, max(d for d in range(1, min(most, chunk[k]) + 1) if chunk[k] % d == 0)

    def piece_shape(self, max_bytes: int) -> tuple[int, ...]:
        """The shape of the pieces `pieces` yields (before an edge crops them)."""
        if not self.streamed:  # `_tensorstore_pieces`: small arrays whole, else by chunk
            return (
                self.shape
                if not self.shape or self.nbytes <= SMALL or 0 in self.shape
                else self.chunk
            )
        if self.chunk_bytes <= max_bytes:
            return self.chunk
        k, run = self.rows(max_bytes)
        return (1,) * k + (run,) + self.chunk[k + 1 :]

    def grid(self, outer: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        return itertools.product(
            *(range(-(-n // c)) for n, c in zip(self.shape, outer, strict=False))
        )

    def key(self, cell: tuple[int, ...]) -> str:
        if self.zarr3:
            return self.sep.join(["c", *map(str, cell)])
        return self.sep.join(map(str, cell)) or "0"


def layout(src: tskv.SourceItem, name: str) -> Layout | None:
    """The stored layout of array ``name`` from its zarr metadata (None: none is stored),
    read once per item: a writer, its routing and its walk all ask for it."""
    if name not in src._layouts:
        src._layouts[name] = _read_layout(src, name)
    return src._layouts[name]


def _read_layout(src: tskv.SourceItem, name: str) -> Layout | None:
    meta_key = f"{name}/zarr.json" if src.use_zarr3 else f"{name}/.zarray"
    got = src.kv.read(meta_key).result()
    if got.state != "value":
        return None
    where = f"{src.dir}/{meta_key}"
    meta = parse_zarr_metadata(bytes(got.value), where)
    files = src.files  # its JSON files, where the item was opened with them
    check_zarr_metadata(
        meta,
        where,
        use_zarr3=src.use_zarr3,
        value_meta=(getattr(files, "value_meta", None) or {}).get(name),
        array_meta=(getattr(files, "array_meta", None) or {}).get(name),
    )
    shape = tuple(meta["shape"])
    if src.use_zarr3:
        return _zarr3_layout(meta, shape)
    comp = meta.get("compressor") or {}
    dtype = tskv._np_dtype(meta.get("dtype"))
    plain = (
        comp.get("id") == "zstd"
        and not meta.get("filters")
        and meta.get("order", "C") == "C"
        and dtype is not None
        and dtype.byteorder != ">"
    )
    return Layout(
        shape,
        np.dtype(dtype) if dtype is not None else np.dtype("V1"),
        tuple(meta.get("chunks", shape)),
        None,
        0,
        meta.get("dimension_separator", "."),
        False,
        plain and tskv._zstd is not None,
    )


def _zarr3_layout(meta: dict, shape: tuple[int, ...]) -> Layout:
    grid = tuple((meta.get("chunk_grid", {}).get("configuration") or {}).get("chunk_shape", shape))
    codecs = meta.get("codecs", [])
    enc = meta.get("chunk_key_encoding", {"name": "default"})
    sep = (enc.get("configuration") or {}).get("separator", "/")
    dtype = tskv._np_dtype(meta.get("data_type"))
    chunk, shard, index = grid, None, 0
    if [c.get("name") for c in codecs] == ["sharding_indexed"]:
        conf = codecs[0].get("configuration") or {}
        inner = tuple(conf.get("chunk_shape") or grid)
        per_shard = math.prod(-(-g // i) for g, i in zip(grid, inner, strict=False))
        tail = tskv._shard_index_bytes(conf)
        exact = all(g % i == 0 for g, i in zip(grid, inner, strict=False))
        chunk, shard, codecs = inner, grid, conf.get("codecs", [])
        index = 0 if tail is None or not exact else 16 * per_shard + (tail - 16)
    plain = (
        tskv._plain_zstd(codecs)
        and enc.get("name") == "default"
        and dtype is not None
        and (shard is None or index > 0)
        and tskv._zstd is not None
    )
    return Layout(
        shape,
        np.dtype(dtype) if dtype is not None else np.dtype("V1"),
        chunk,
        shard,
        index,
        sep,
        True,
        plain,
    )


# -- zarr metadata checked before anything is allocated from it (issue 46) ----------------
def check_zarr_metadata(
    meta: dict,
    where: str,
    *,
    use_zarr3: bool,
    value_meta: Any = None,
    array_meta: Any = None,
) -> None:
    """Refuses (`orbax_files.CheckpointRefusedError`, a `CheckpointReadError`, naming
    ``where``: the array's metadata key) zarr metadata that disagrees with itself or with
    the item's JSON files: what tensorstore or numpy is asked to allocate comes from it,
    and checkpoints are untrusted input (issue 46).

    What every writer of these checkpoints keeps (Orbax 0.12's zarr2 and sharded zarr3,
    Orbax v1's, Pathways', this library's own), checked against every fixture:

    - the shape: integers >= 0; the chunk grid (zarr2 ``chunks``, zarr3 ``chunk_grid``, a
      ``regular`` one): one integer >= 1 per axis, none larger than its axis
      (``max(n, 1)``);
    - a zarr3 shard's inner chunk (``sharding_indexed`` first): one per axis, each dividing
      the shard (tensorstore's own rule);
    - a dtype numpy (or ml_dtypes) names, of booleans or numbers (`tskv._np_dtype`);
    - ``write_shape`` of ``_METADATA`` (``value_meta``) and of ``array_metadatas``
      (``array_meta``): one integer per axis, none larger than its axis; the latter's
      ``chunk_shape``: one per axis, none larger than ``max(n, 1)``.

    Not required: that ``write_shape`` or ``chunk_shape`` equals the stored chunk (a
    per-device chunk is a shard's shape; this library records the whole shape for an
    array it copied in per-device chunks), nor anything of an empty one (``[]``: this
    library kept a scalar's for the array of layers it stacked from it)."""
    shape = _dims(meta.get("shape"), where, "shape", 0)
    if use_zarr3:
        grid = _member(meta, "chunk_grid", "configuration", "chunk_shape")
        if _member(meta, "chunk_grid", "name") != "regular":
            raise CheckpointRefusedError(f"{where}: not a regular chunk grid; refused.")
        dtype = meta.get("data_type")
    else:
        grid, dtype = meta.get("chunks"), meta.get("dtype")
    grid = _dims(grid, where, "chunk shape", 1, shape)
    if tskv._np_dtype(dtype) is None:
        raise CheckpointRefusedError(f"{where}: unsupported dtype {_short(dtype)}; refused.")
    codecs = _check_encoding(meta, where, use_zarr3=use_zarr3)
    if codecs and codecs[0]["name"] == "sharding_indexed":
        inner = _member(codecs[0], "configuration", "chunk_shape")
        inner = _dims(inner, where, "inner chunk shape", 1, grid)
        if any(g % i for g, i in zip(grid, inner, strict=True)):
            raise CheckpointRefusedError(
                f"{where}: inner chunk {list(inner)} does not divide the shard {list(grid)}; "
                "refused."
            )
    # ``[]``: none (this library recorded a scalar's for the layers of it it stacked).
    if isinstance(value_meta, dict) and value_meta.get("write_shape") not in (None, []):
        _dims(value_meta["write_shape"], where, "_METADATA write_shape", 0, shape, empty=0)
    if isinstance(array_meta, dict):
        for key, empty in (("write_shape", 0), ("chunk_shape", 1)):
            if array_meta.get(key) not in (None, []):
                _dims(array_meta[key], where, f"array_metadatas {key}", 0, shape, empty=empty)


def _dims(
    value: Any, where: str, what: str, least: int, bound: tuple | None = None, *, empty: int = 1
) -> tuple[int, ...]:
    """``value`` as a tuple of integers >= ``least`` (JSON integers, not booleans or
    floats, below 2**63), as many as ``bound`` has and none larger than its axis (at least
    ``empty``: an axis of 0 has chunks of 1); else `CheckpointRefusedError`."""
    ok = isinstance(value, list) and all(type(d) is int and least <= d < (1 << 63) for d in value)
    if ok and bound is not None:
        ok = len(value) == len(bound) and all(
            d <= max(n, empty) for d, n in zip(value, bound, strict=True)
        )
    if not ok:
        against = "" if bound is None else f" for {list(bound)}"
        raise CheckpointRefusedError(
            f"{where}: invalid {what} {_short(value)}{against} (damaged or forged); refused."
        )
    return tuple(value)


def _check_encoding(meta: dict, where: str, *, use_zarr3: bool) -> list[dict]:
    """Refuses the members that say how chunks are encoded and named when they are not of
    the JSON types zarr gives them (every reader assumes those; tensorstore refuses them
    too); returns zarr3's codecs (zarr2: ``[]``)."""
    ok = True
    if use_zarr3:
        codecs = meta.get("codecs")
        ok = _codecs_ok(codecs)
        shard = _member(codecs[0], "configuration") if ok and codecs else None
        if ok and codecs[0]["name"] == "sharding_indexed":
            ok = isinstance(shard, dict) and all(
                _codecs_ok(shard.get(k, [])) for k in ("codecs", "index_codecs")
            )
        enc = meta.get("chunk_key_encoding", {"name": "default"})
        sep = _member(enc, "configuration", "separator")
        ok = ok and _member(enc, "name") in ("default", "v2") and sep in (None, "/", ".")
        ok = ok and isinstance(enc.get("configuration", {}), dict)
    else:
        codecs = []
        comp = meta.get("compressor")
        ok = comp is None or isinstance(_member(comp, "id"), str)
        ok = ok and isinstance(meta.get("filters"), list | type(None))
        ok = ok and meta.get("order", "C") in ("C", "F")
        ok = ok and meta.get("dimension_separator", ".") in (".", "/")
    if not ok:
        raise CheckpointRefusedError(f"{where}: invalid codecs or chunk key encoding; refused.")
    return codecs


def _codecs_ok(codecs: Any) -> bool:
    """A zarr3 codec list: JSON objects, each with a name and an object of configuration."""
    return isinstance(codecs, list) and all(
        isinstance(c, dict)
        and isinstance(c.get("name"), str)
        and isinstance(c.get("configuration", {}), dict)
        for c in codecs
    )


def _member(obj: Any, *keys: str) -> Any:
    """``obj[k0][k1]...``, None where a level is not a JSON object."""
    for k in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(k)
    return obj


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@functools.cache
def host_memory() -> int:
    """This machine's physical memory in bytes: the most an array read whole
    (`read_whole`), or one chunk tensorstore decodes, may hold. Anything larger cannot be
    held anyway; its zarr metadata is damaged or forged (a 2**40-element shape), and it is
    refused before numpy or tensorstore allocates it."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not a POSIX host
        return 1 << 40


def _check_fits(what: str, nbytes: int, held: str) -> None:
    """Refuses to hold ``nbytes`` (``held``: what they are) past `host_memory`."""
    if nbytes > host_memory():
        raise CheckpointRefusedError(
            f"{what}: {held} of {nbytes:,} bytes is more than this machine's memory "
            f"({host_memory():,} bytes); its zarr metadata is damaged or forged. Refused."
        )


def pieces(
    src: tskv.SourceItem, name: str, ctx: ts.Context, *, max_bytes: int, reuse: bool = False
) -> Iterator[Piece]:
    """Every stored chunk of array ``name`` decoded once, as pieces of at most ``max_bytes``
    (a chunk over it: runs of whole rows, streamed), cropped to the array.

    ``reuse``: the pieces of a chunk are decoded into one buffer, so a piece is valid only
    until the next is asked for. Fresh memory costs more than the decode on this kind of
    machine (the kernel zeroes every page on first touch: 2.3 GiB/s here, 0.6 GiB/s in
    transparent huge pages, against 9 GiB/s to rewrite a buffer).

    Raises `CheckpointReadError` naming the array for a chunk that is missing (Orbax
    stores every chunk: a missing one is damage, never the fill value) or undecodable.
    """
    return _pieces(src, name, ctx, max_bytes, "decode" if reuse else None)


def _pieces(
    src: tskv.SourceItem, name: str, ctx: ts.Context, max_bytes: int, scratch_kind: str | None
) -> Iterator[Piece]:
    """`pieces`, decoded into this thread's scratch buffer ``scratch_kind`` (None: fresh
    arrays). Each reader that may run while another's piece is held has its own kind."""
    lay = layout(src, name)
    what = f"{src.dir}: cannot read {name}"
    if lay is None:
        raise CheckpointReadError(f"{what}: no zarr metadata (truncated or damaged item).")
    if not lay.streamed:
        _check_fits(what, lay.chunk_bytes, "a chunk")  # tensorstore decodes whole chunks
        yield from _tensorstore_pieces(src, name, lay, ctx, what)
        return
    for origin, frame in _frames(src, name, lay, what, scratch=scratch_kind):
        yield from _decode(what, frame, lay, origin, max_bytes, scratch_kind)


def read_chunk(
    src: tskv.SourceItem, name: str, start: tuple[int, ...], shape: tuple[int, ...]
) -> np.ndarray | None:
    """The box of array ``name`` at ``start`` (``shape``), when it is exactly one stored
    chunk (cropped at the array's edge) that zstandard decodes: decoded alone, into a
    buffer of this thread that the next call reuses. None for any other box (read it
    through tensorstore). `verify` reads back each chunk a writer wrote this way."""
    lay = layout(src, name)
    if lay is None or not lay.plain or not lay.shape or 0 in lay.shape:
        return None
    if len(start) != len(lay.shape):
        return None
    cell = tuple(s // c for s, c in zip(start, lay.chunk, strict=True))
    origin = tuple(c * n for c, n in zip(cell, lay.chunk, strict=True))
    whole = tuple(min(c, d - o) for c, d, o in zip(lay.chunk, lay.shape, origin, strict=True))
    if tuple(start) != origin or tuple(shape) != whole:
        return None
    what = f"{src.dir}: cannot read {name}"
    _check_fits(what, lay.chunk_bytes, "a chunk")  # decoded whole, into one buffer
    for _, frame in _frames(src, name, lay, what, only=cell, scratch="check"):
        got = list(_decode(what, frame, lay, origin, lay.chunk_bytes, "check"))
        return got[0].data
    return None


def _frames(src: tskv.SourceItem, name: str, lay: Layout, what: str, *, only=None, scratch=None):
    """``(origin, frame)`` of each stored chunk in storage order, each counted as decoded
    (``only``: the chunk at that grid cell alone), read into this thread's buffer
    ``<scratch>-read`` (None: each frame its own). Raises `CheckpointReadError` for a
    chunk or a shard index that is not stored."""
    scratch = None if scratch is None else f"{scratch}-read"
    if lay.shard is None:
        for cell in [only] if only is not None else lay.grid(lay.chunk):
            origin = tuple(c * n for c, n in zip(cell, lay.chunk, strict=False))
            value = tskv._stored_value(src, f"{name}/{lay.key(cell)}", scratch)
            if value is None:
                raise CheckpointReadError(f"{what}: chunk {lay.key(cell)} is not stored.")
            with value:
                count("chunk decoded", f"{src.dir}/{name}/{lay.key(cell)}")
                yield origin, value
        return
    inner = tuple(s // c for s, c in zip(lay.shard, lay.chunk, strict=False))
    shards = lay.grid(lay.shard)
    want = None  # the inner chunk ``only`` is, in its shard
    if only is not None:
        shards = [tuple(c // i for c, i in zip(only, inner, strict=False))]
        want = tuple(c % i for c, i in zip(only, inner, strict=False))
    for cell in shards:
        key = f"{name}/{lay.key(cell)}"
        value = tskv._stored_value(src, key, scratch)
        if value is None:
            raise CheckpointReadError(f"{what}: shard {lay.key(cell)} is not stored.")
        with value:
            tail = _shard_index(value, lay, f"{what}: shard {lay.key(cell)}")
            for k, sub in enumerate(itertools.product(*(range(n) for n in inner))):
                origin = tuple(
                    c * s + i * n
                    for c, s, i, n in zip(cell, lay.shard, sub, lay.chunk, strict=False)
                )
                if any(o >= n for o, n in zip(origin, lay.shape, strict=False)):
                    continue  # an inner chunk wholly past the array's edge
                if only is not None and sub != want:
                    continue
                offset, size = struct.unpack_from("<QQ", tail, 16 * k)
                if offset == tskv._MISSING:
                    raise CheckpointReadError(
                        f"{what}: shard {lay.key(cell)} lacks inner chunk {sub}."
                    )
                if offset + size >= 1 << 63:  # past any file (a damaged index)
                    raise CheckpointReadError(
                        f"{what}: shard {lay.key(cell)} places inner chunk {sub} at "
                        f"{offset}+{size}, past its end."
                    )
                count("chunk decoded", f"{src.dir}/{key}#{k}")
                yield origin, value.part(offset, size)


def _shard_index(value, lay: Layout, where: str) -> bytes:
    """The index at the end of a shard (``value``), its crc32c checked where it has one
    (Orbax's index codecs), as tensorstore does (issue 46); else `CheckpointReadError`."""
    try:
        tail = value.suffix(lay.index_bytes)
    except ValueError:  # tensorstore's: the value is shorter than its index
        tail = None
    if tail is None:
        raise CheckpointReadError(f"{where} has no index.")
    if lay.index_bytes % 16 == 4 and _crc32c(tail[:-4]) != struct.unpack("<I", tail[-4:])[0]:
        raise CheckpointReadError(f"{where}: its index fails its checksum (damaged).")
    return tail


@functools.cache
def _crc32c_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 & -(c & 1))  # CRC-32C (Castagnoli), reflected
        table.append(c)
    return tuple(table)


def _crc32c(data: bytes) -> int:
    """CRC-32C of ``data`` (a shard index: 16 bytes per inner chunk, so a table will do)."""
    table, crc = _crc32c_table(), 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _tensorstore_pieces(src, name, lay: Layout, ctx, what: str) -> Iterator[Piece]:
    """Chunk by chunk through tensorstore (a box on the chunk grid decodes that chunk
    once): for small arrays, scalars and codecs zstandard does not take."""
    driver = "zarr3" if src.use_zarr3 else "zarr"
    spec = {"driver": driver, "kvstore": tskv.sub_kv(src.kv.spec().to_json(), name)}
    spec["fill_missing_data_reads"] = False  # a missing chunk must fail, not read as zeros
    try:
        store = ts.open(spec, open=True, context=ctx).result()
        if lay.piece_shape(0) == lay.shape:
            count("chunk decoded", f"{src.dir}/{name}")
            yield Piece((0,) * len(lay.shape), np.asarray(store.read().result()))
            return
        for cell in lay.grid(lay.chunk):
            start = tuple(c * n for c, n in zip(cell, lay.chunk, strict=False))
            stop = tuple(
                min(s + n, d) for s, n, d in zip(start, lay.chunk, lay.shape, strict=False)
            )
            box = tuple(slice(a, b) for a, b in zip(start, stop, strict=False))
            count("chunk decoded", f"{src.dir}/{name}/{lay.key(cell)}")
            yield Piece(start, np.asarray(store[box].read().result()))
    except ValueError as e:
        raise CheckpointReadError(f"{what}: {e}") from e


def _decode(what: str, frame, lay: Layout, origin, max_bytes: int, scratch_kind: str | None):
    """The pieces of one stored chunk at ``origin``: its zstd frame streamed, in runs of
    whole rows of at most ``max_bytes`` (rows: on the first axis whose rows fit), each
    decoded into this thread's scratch buffer ``scratch_kind`` (None: fresh arrays)."""
    chunk, item = lay.chunk, lay.dtype.itemsize
    k, run = lay.rows(max_bytes) if lay.chunk_bytes > max_bytes else (0, chunk[0])
    size = math.prod(chunk[k + 1 :]) * min(run, chunk[k])
    scratch = None
    if scratch_kind is not None:
        scratch = scratch_buffer(scratch_kind, size * item).view(lay.dtype)[:size]
    # The stream must hold exactly the chunk (issue 46; as tensorstore requires): a frame
    # that declares another size is refused before it is decoded (`_Framed`), and one that
    # decodes past the chunk's last row (more frames, or a frame that declares no size) too.
    stream = _Framed(frame, lay.chunk_bytes)
    where = f"{what}: {_chunk_name(lay, origin)} at {origin}"
    try:
        with tskv._zstd.ZstdDecompressor().stream_reader(
            stream, read_size=tskv._PIECE, read_across_frames=True
        ) as r:
            for lead in itertools.product(*(range(n) for n in chunk[:k])):
                for r0 in range(0, chunk[k], run):
                    shape = (1,) * k + (min(run, chunk[k] - r0),) + chunk[k + 1 :]
                    if scratch is None:
                        buf = np.empty(shape, lay.dtype)
                    else:
                        buf = scratch[: math.prod(shape)].reshape(shape)
                    tskv._read_exactly(r, buf)
                    start = tuple(o + i for o, i in zip(origin, (*lead, r0), strict=False))
                    got = _crop(start + origin[k + 1 :], buf, lay.shape)
                    if got is not None:
                        yield got
            if r.read(1):
                raise _Long
    except (tskv._zstd.ZstdError, OSError, ValueError, MemoryError) as e:
        raise CheckpointReadError(f"{where}: {e}") from e
    except tskv._Short as e:
        raise CheckpointReadError(f"{where} decodes to fewer bytes than it holds ({e}).") from e
    except _Long as e:
        raise CheckpointReadError(
            f"{where} decodes to more bytes than it holds ({lay.chunk_bytes}): damaged or forged."
        ) from e
    except _Declared as e:
        raise CheckpointReadError(
            f"{where}: its zstd frame declares {e.size} bytes, the chunk holds "
            f"{lay.chunk_bytes}: damaged or forged."
        ) from e


class _Long(Exception):
    """A stream went on past the end of its chunk."""


class _Declared(Exception):
    """A zstd frame declares a content size other than its chunk's."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class _Framed:
    """A stored chunk's bytes (``value``, read as a file is) as zstandard reads them, the
    zstd frame header checked on the first read: a declared content size must be ``want``,
    the chunk's decoded size (`_Declared`). One more small read per chunk, no copy."""

    def __init__(self, value: Any, want: int) -> None:
        self.value, self.want, self.first = value, want, True

    def read(self, n: int = -1):
        got = self.value.read(n)
        if self.first:
            self.first = False
            size = tskv._zstd.get_frame_parameters(bytes(got[:18])).content_size
            if size not in (_UNKNOWN_SIZE, self.want):
                raise _Declared(size)
        return got


def _chunk_name(lay: Layout, origin: tuple[int, ...]) -> str:
    """The stored key of the chunk at ``origin`` (a shard's: with the inner chunk's cell)."""
    cell = tuple(o // c for o, c in zip(origin, lay.chunk, strict=False))
    if lay.shard is None:
        return f"chunk {lay.key(cell)}"
    outer = tuple(o // s for o, s in zip(origin, lay.shard, strict=False))
    sub = tuple(c % (s // n) for c, s, n in zip(cell, lay.shard, lay.chunk, strict=False))
    return f"chunk {lay.key(outer)} (inner chunk {sub})"


def _crop(start: tuple[int, ...], buf: np.ndarray, shape: tuple[int, ...]) -> Piece | None:
    """``buf`` at ``start`` without what lies past the array's edge (an edge chunk is
    stored whole); None when nothing is left."""
    stop = [min(s + n, d) for s, n, d in zip(start, buf.shape, shape, strict=False)]
    if any(b <= a for a, b in zip(start, stop, strict=False)):
        return None
    if all(b - a == n for a, b, n in zip(start, stop, buf.shape, strict=False)):
        return Piece(start, buf)
    return Piece(start, buf[tuple(slice(0, b - a) for a, b in zip(start, stop, strict=False))])


def read_whole(src: tskv.SourceItem, name: str, ctx: ts.Context) -> np.ndarray:
    """Array ``name`` decoded whole, each chunk once, holding the array and one piece.

    A merge reads its LoRA factors this way while a piece of its base (`pieces`, ``reuse``)
    is held: the pieces here go through a buffer of their own (``whole``), never the
    base's."""
    lay = layout(src, name)
    what = f"{src.dir}: cannot read {name}"
    if lay is None:
        raise CheckpointReadError(f"{what}: no zarr metadata.")
    _check_fits(what, lay.nbytes, f"the array {list(lay.shape)} {lay.dtype}")
    out: np.ndarray | None = None
    try:
        for p in _pieces(src, name, ctx, tskv._PIECE * 4, "whole"):
            if out is None:
                out = np.empty(lay.shape, p.data.dtype)
            out[p.box] = p.data
        if out is None:
            out = np.empty(lay.shape, lay.dtype)
    except MemoryError as e:  # under the machine's memory, over what this process may hold
        raise CheckpointReadError(f"{what}: out of memory ({lay.nbytes:,} bytes).") from e
    return out
