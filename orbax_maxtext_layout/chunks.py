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
import itertools
import json
import math
import struct
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import tensorstore as ts

from . import tskv
from .errors import CheckpointReadError
from .orbax_files import count
from .scratch import scratch_buffer

# Below this an array is read whole by tensorstore: it decodes each chunk once too, and
# for small arrays its one call costs less than the chunk walk.
SMALL = 1 << 20


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
    meta = json.loads(bytes(got.value))
    shape = tuple(meta.get("shape", ()))
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
            tail = value.suffix(lay.index_bytes)
            if tail is None:
                raise CheckpointReadError(f"{what}: shard {lay.key(cell)} has no index.")
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
                count("chunk decoded", f"{src.dir}/{key}#{k}")
                yield origin, value.part(offset, size)


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
    try:
        with tskv._zstd.ZstdDecompressor().stream_reader(frame, read_size=tskv._PIECE) as r:
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
    except (tskv._zstd.ZstdError, OSError) as e:
        raise CheckpointReadError(f"{what}: a chunk at {origin}: {e}") from e
    except tskv._Short as e:
        raise CheckpointReadError(
            f"{what}: a chunk at {origin} decodes to fewer bytes than it holds ({e})."
        ) from e


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
    if lay is None:
        raise CheckpointReadError(f"{src.dir}: cannot read {name}: no zarr metadata.")
    out: np.ndarray | None = None
    for p in _pieces(src, name, ctx, tskv._PIECE * 4, "whole"):
        if out is None:
            out = np.empty(lay.shape, p.data.dtype)
        out[p.box] = p.data
    if out is None:
        out = np.empty(lay.shape, lay.dtype)
    return out
