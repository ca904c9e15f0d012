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

import contextlib
import functools
import itertools
import math
import os
import struct
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from ..errors import CheckpointReadError
from ..storage.scratch import scratch_buffer
from . import stored_values
from .orbax_files import CheckpointRefusedError, count, sub_kv
from .stored_values import Short, Stored, read_exactly
from .zarr import MISSING, ChunkLayout, zstd

# A zstd frame header's content size when the frame does not declare one.
_UNKNOWN_SIZE = (1 << 64) - 1


class Piece(NamedTuple):
    """Values of the box of an array starting at ``start`` (``data.shape`` long)."""

    start: tuple[int, ...]
    data: np.ndarray

    @property
    def box(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + n) for s, n in zip(self.start, self.data.shape, strict=True))


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
    src: Stored, name: str, ctx: ts.Context, *, max_bytes: int, reuse: bool = False
) -> Iterator[Piece]:
    """Every stored chunk of array ``name`` decoded once, as pieces of at most ``max_bytes``
    (a chunk over it: runs of whole rows, streamed), cropped to the array.

    ``reuse``: the pieces of a chunk are decoded into one buffer, so a piece is valid only
    until the next is asked for. Fresh memory costs more than the decode on this kind of
    machine (the kernel zeroes every page on first touch: 2.3 GiB/s here, 0.6 GiB/s in
    transparent huge pages, against 9 GiB/s to rewrite a buffer).

    Raises `CheckpointReadError` naming the array for a chunk that is missing (Orbax 0.12
    stores every chunk) or undecodable. A missing chunk of a step that does not say so
    (`ItemFiles.fills_missing`: older Orbax) is the array's fill value, as stock reads it.
    """
    return _pieces(src, name, ctx, max_bytes, "decode" if reuse else None)


def _pieces(
    src: Stored, name: str, ctx: ts.Context, max_bytes: int, scratch_kind: str | None
) -> Iterator[Piece]:
    """`pieces`, decoded into this thread's scratch buffer ``scratch_kind`` (None: fresh
    arrays). Each reader that may run while another's piece is held has its own kind."""
    lay = src.layout(name)
    what = f"{src.dir}: cannot read {name}"
    if lay is None:
        raise CheckpointReadError(f"{what}: no zarr metadata (truncated or damaged item).")
    if not lay.streamed:
        _check_fits(what, lay.chunk_bytes, "a chunk")  # tensorstore decodes whole chunks
        yield from _tensorstore_pieces(src, name, lay, ctx, what)
        return
    fill = functools.partial(src.fill_value, name)
    for origin, frame in _frames(src, name, lay, what, scratch=scratch_kind):
        yield from _decode(
            what, frame, lay, origin, max_bytes, scratch_kind=scratch_kind, fill=fill
        )


def read_chunk(
    src: Stored, name: str, start: tuple[int, ...], shape: tuple[int, ...]
) -> np.ndarray | None:
    """The box of array ``name`` at ``start`` (``shape``), when it is exactly one stored
    chunk (cropped at the array's edge) that zstandard decodes: decoded alone, into a
    buffer of this thread that the next call reuses. None for any other box (read it
    through tensorstore). `verify` reads back each chunk a writer wrote this way."""
    lay = src.layout(name)
    if lay is None or not lay.plain or not lay.shape or 0 in lay.shape:
        return None
    if len(start) != len(lay.shape):
        return None
    cell = tuple(s // c for s, c in zip(start, lay.chunk, strict=True))
    origin = cell_origin(lay, cell)
    whole = tuple(min(c, d - o) for c, d, o in zip(lay.chunk, lay.shape, origin, strict=True))
    if tuple(start) != origin or tuple(shape) != whole:
        return None
    what = f"{src.dir}: cannot read {name}"
    _check_fits(what, lay.chunk_bytes, "a chunk")  # decoded whole, into one buffer
    for _, frame in _frames(src, name, lay, what, only=cell, scratch="check"):
        fill = functools.partial(src.fill_value, name)
        got = list(
            _decode(what, frame, lay, origin, lay.chunk_bytes, scratch_kind="check", fill=fill)
        )
        return got[0].data
    return None


def _frames(src: Stored, name: str, lay: ChunkLayout, what: str, *, only=None, scratch=None):
    """``(origin, frame)`` of each stored chunk in storage order, each counted as decoded
    (``only``: the chunk at that grid cell alone), read into this thread's buffer
    ``<scratch>-read`` (None: each frame its own). A chunk, a shard or a shard's inner
    chunk that is not stored is ``(origin, None)`` where the step reads it as the fill value
    (`ItemFiles.fills_missing`); else `CheckpointReadError`."""
    scratch = None if scratch is None else f"{scratch}-read"
    fills = src.files.fills_missing
    if lay.shard is None:
        for cell in [only] if only is not None else lay.grid(lay.chunk):
            origin = cell_origin(lay, cell)
            value = src.stored_value(f"{name}/{lay.key(cell)}", scratch)
            if value is None and fills:
                yield origin, None
                continue
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
        value = src.stored_value(key, scratch)
        if value is None and fills:  # every inner chunk of it is the fill value
            for sub in itertools.product(*(range(n) for n in inner)):
                origin = _inner_origin(lay, cell, sub)
                past = any(o >= n for o, n in zip(origin, lay.shape, strict=False))
                if not past and (only is None or sub == want):
                    yield origin, None
            continue
        if value is None:
            raise CheckpointReadError(f"{what}: shard {lay.key(cell)} is not stored.")
        with value:
            tail = _shard_index(value, lay, f"{what}: shard {lay.key(cell)}")
            for k, sub in enumerate(itertools.product(*(range(n) for n in inner))):
                origin = _inner_origin(lay, cell, sub)
                if any(o >= n for o, n in zip(origin, lay.shape, strict=False)):
                    continue  # an inner chunk wholly past the array's edge
                if only is not None and sub != want:
                    continue
                offset, size = struct.unpack_from("<QQ", tail, 16 * k)
                if offset == MISSING and fills:
                    yield origin, None
                    continue
                if offset == MISSING:
                    raise CheckpointReadError(
                        f"{what}: shard {lay.key(cell)} lacks inner chunk {sub}."
                    )
                if offset + size >= 1 << 63:  # past any file (a damaged index)
                    raise CheckpointReadError(
                        f"{what}: shard {lay.key(cell)} places inner chunk {sub} at "
                        f"{offset}+{size}, past its end."
                    )
                count("chunk decoded", f"{src.dir}/{key}#{k}")
                with value.part(offset, size) as part:
                    yield origin, part


def _inner_origin(lay: ChunkLayout, cell: tuple[int, ...], sub: tuple[int, ...]) -> tuple[int, ...]:
    """Where inner chunk ``sub`` of the shard at grid ``cell`` starts in the array."""
    return tuple(c * s + i * n for c, s, i, n in zip(cell, lay.shard, sub, lay.chunk, strict=False))


def _shard_index(value, lay: ChunkLayout, where: str) -> bytes:
    """The index at the end of a shard (``value``), its crc32c checked where it has one
    (Orbax's index codecs), as tensorstore does (issue 46); else `CheckpointReadError`."""
    try:
        tail = value.suffix(lay.index_bytes)
    except CheckpointReadError as e:  # its data file cut short (`stored_values.FileValue`)
        raise CheckpointReadError(f"{where}: {e}") from e
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


def _tensorstore_pieces(src, name, lay: ChunkLayout, ctx, what: str) -> Iterator[Piece]:
    """Chunk by chunk through tensorstore (a box on the chunk grid decodes that chunk
    once): for small arrays, scalars and codecs zstandard does not take."""
    driver = "zarr3" if src.use_zarr3 else "zarr"
    spec = {"driver": driver, "kvstore": sub_kv(src.kv.spec().to_json(), name)}
    # a missing chunk fails, unless the step says it is the fill value (as stock reads it)
    spec["fill_missing_data_reads"] = src.files.fills_missing
    try:
        store = ts.open(spec, open=True, context=ctx).result()
        if lay.piece_shape(0) == lay.shape:
            count("chunk decoded", f"{src.dir}/{name}")
            yield Piece((0,) * len(lay.shape), np.asarray(store.read().result()))
            return
        for cell in lay.grid(lay.chunk):
            start = cell_origin(lay, cell)
            stop = tuple(
                min(s + n, d) for s, n, d in zip(start, lay.chunk, lay.shape, strict=False)
            )
            box = tuple(slice(a, b) for a, b in zip(start, stop, strict=False))
            count("chunk decoded", f"{src.dir}/{name}/{lay.key(cell)}")
            yield Piece(start, np.asarray(store[box].read().result()))
    except ValueError as e:
        raise src.read_error(name, e) from e


def _decode(
    what: str,
    frame,
    lay: ChunkLayout,
    origin,
    max_bytes: int,
    *,
    scratch_kind: str | None,
    fill: Callable[[], np.ndarray] | None = None,
):
    """The pieces of one stored chunk at ``origin``: its zstd frame streamed, in runs of
    whole rows of at most ``max_bytes`` (rows: on the first axis whose rows fit), each
    decoded into this thread's scratch buffer ``scratch_kind`` (None: fresh arrays).
    ``frame`` None: a chunk not stored, whose pieces hold ``fill()`` (`_frames`)."""
    if frame is None:
        value = fill()
        yield from _runs(lay, origin, max_bytes, scratch_kind, lambda buf: np.copyto(buf, value))
        return
    # The stream must hold exactly the chunk (issue 46; as tensorstore requires): a frame
    # that declares another size is refused before it is decoded (`_Framed`), and one that
    # decodes past the chunk's last row (more frames, or a frame that declares no size) too.
    stream = _Framed(frame, lay.chunk_bytes)
    with _decoding(f"{what}: {_chunk_name(lay, origin)} at {origin}", lay, frame):
        with zstd.ZstdDecompressor().stream_reader(
            stream, read_size=stored_values.PIECE, read_across_frames=True
        ) as r:
            yield from _runs(lay, origin, max_bytes, scratch_kind, lambda buf: read_exactly(r, buf))
            if r.read(1):
                raise _Long


def _runs(
    lay: ChunkLayout, origin, max_bytes: int, scratch_kind: str | None, put
) -> Iterator[Piece]:
    """The chunk at ``origin`` as pieces of runs of whole rows (`_decode`), each written by
    ``put(buf)``, cropped to the array."""
    chunk, item = lay.chunk, lay.dtype.itemsize
    if not chunk:  # a 0-d array: its one value (written through a 1-d view of it)
        if scratch_kind is None:
            one = np.empty((1,), lay.dtype)
        else:
            one = scratch_buffer(scratch_kind, item).view(lay.dtype)[:1]
        put(one)
        yield Piece((), one.reshape(()))
        return
    k, run = lay.rows(max_bytes) if lay.chunk_bytes > max_bytes else (0, chunk[0])
    size = math.prod(chunk[k + 1 :]) * min(run, chunk[k])
    scratch = None
    if scratch_kind is not None:
        scratch = scratch_buffer(scratch_kind, size * item).view(lay.dtype)[:size]
    for lead in itertools.product(*(range(n) for n in chunk[:k])):
        for r0 in range(0, chunk[k], run):
            shape = (1,) * k + (min(run, chunk[k] - r0),) + chunk[k + 1 :]
            if scratch is None:
                buf = np.empty(shape, lay.dtype)
            else:
                buf = scratch[: math.prod(shape)].reshape(shape)
            put(buf)
            start = tuple(o + i for o, i in zip(origin, (*lead, r0), strict=False))
            got = _crop(start + origin[k + 1 :], buf, lay.shape)
            if got is not None:
                yield got


@contextlib.contextmanager
def _decoding(where: str, lay: ChunkLayout, frame: Any = None) -> Iterator[None]:
    """Every way a stored chunk fails to decode as a `CheckpointReadError` naming it and the
    data file it was read from (``frame``: a `stored_values.FileValue`), or that file cut
    short while this read it (`FileValue.cut_meanwhile`)."""
    try:
        yield
    except (zstd.ZstdError, OSError, ValueError, MemoryError, Short, _Long, _Declared) as e:
        if isinstance(frame, stored_values.FileValue) and not isinstance(e, CheckpointReadError):
            cut = frame.cut_meanwhile()
            if cut is not None:
                raise CheckpointReadError(f"{where}: {cut}") from e
            where += f" in data file {frame.path}"
        raise _undecodable(where, lay, e) from e


def _undecodable(where: str, lay: ChunkLayout, e: BaseException) -> CheckpointReadError:
    if isinstance(e, Short):
        return CheckpointReadError(f"{where} decodes to fewer bytes than it holds ({e}).")
    if isinstance(e, _Long):
        return CheckpointReadError(
            f"{where} decodes to more bytes than it holds ({lay.chunk_bytes}): damaged or forged."
        )
    if isinstance(e, _Declared):
        return CheckpointReadError(
            f"{where}: its zstd frame declares {e.size} bytes, the chunk holds "
            f"{lay.chunk_bytes}: damaged or forged."
        )
    return CheckpointReadError(f"{where}: {e}")


# -- one stored chunk at a time (the restore engine's tasks) -----------------------------
def cells(
    lay: ChunkLayout, start: tuple[int, ...], stop: tuple[int, ...]
) -> Iterator[tuple[int, ...]]:
    """The grid cells of the stored chunks that hold any of the box ``[start, stop)``."""
    return itertools.product(
        *(range(a // c, -(-b // c)) for a, b, c in zip(start, stop, lay.chunk, strict=True))
    )


def stored_key(lay: ChunkLayout, name: str, cell: tuple[int, ...]) -> str:
    """The key of the stored value holding the chunk at grid ``cell`` of array ``name``: the
    chunk's own, or its shard's (what `decode_cell` reads)."""
    if lay.shard is None:
        return f"{name}/{lay.key(cell)}"
    inner = tuple(s // c for s, c in zip(lay.shard, lay.chunk, strict=False))
    return f"{name}/{lay.key(tuple(c // i for c, i in zip(cell, inner, strict=False)))}"


def cell_origin(lay: ChunkLayout, cell: tuple[int, ...]) -> tuple[int, ...]:
    """Where the stored chunk at grid ``cell`` starts in the array."""
    return tuple(c * n for c, n in zip(cell, lay.chunk, strict=False))


def decode_cell(
    src: Stored, name: str, cell: tuple[int, ...], *, max_bytes: int
) -> Iterator[Piece]:
    """The stored chunk at grid ``cell`` of a plain-zstd array (`ChunkLayout.plain`) decoded once,
    as pieces of at most ``max_bytes`` in this thread's scratch buffer ``engine`` (valid
    until the next piece), cropped to the array."""
    lay = src.layout(name)
    what = f"{src.dir}: cannot read {name}"
    fill = functools.partial(src.fill_value, name)
    for origin, frame in _frames(src, name, lay, what, only=cell, scratch="engine"):
        yield from _decode(what, frame, lay, origin, max_bytes, scratch_kind="engine", fill=fill)


def decode_cell_into(
    src: Stored,
    name: str,
    cell: tuple[int, ...],
    out: np.ndarray,
    *,
    before: Callable[[int, int], None] | None = None,
) -> None:
    """The stored chunk at grid ``cell`` decoded straight into ``out`` (C-contiguous, the
    chunk's whole stored shape and dtype): no piece is held, nothing copied. ``before(a, b)``
    is called before bytes ``[a, b)`` of ``out`` are written (in steps of `stored_values.PIECE`)."""
    lay = src.layout(name)
    what = f"{src.dir}: cannot read {name}"
    flat = out.reshape(-1).view(np.uint8)
    for origin, frame in _frames(src, name, lay, what, only=cell, scratch="engine"):
        if frame is None:  # not stored: the fill value, as stock reads it (`_frames`)
            if before is not None:
                before(0, flat.nbytes)
            np.copyto(out, src.fill_value(name))  # an array: a NaN's payload kept
            continue
        with _decoding(f"{what}: {_chunk_name(lay, origin)} at {origin}", lay, frame):
            stream = _Framed(frame, lay.chunk_bytes)
            with zstd.ZstdDecompressor().stream_reader(
                stream, read_size=stored_values.PIECE, read_across_frames=True
            ) as r:
                step = flat.nbytes if before is None else 2 * stored_values.PIECE
                for start in range(0, flat.nbytes, step):
                    stop = min(start + step, flat.nbytes)
                    if before is not None:
                        before(start, stop)
                    read_exactly(r, flat[start:stop])
                if r.read(1):
                    raise _Long


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
            size = zstd.get_frame_parameters(bytes(got[:18])).content_size
            if size not in (_UNKNOWN_SIZE, self.want):
                raise _Declared(size)
        return got


def _chunk_name(lay: ChunkLayout, origin: tuple[int, ...]) -> str:
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


def read_whole(src: Stored, name: str, ctx: ts.Context) -> np.ndarray:
    """Array ``name`` decoded whole, each chunk once, holding the array and one piece.

    A merge reads its LoRA factors this way while a piece of its base (`pieces`, ``reuse``)
    is held: the pieces here go through a buffer of their own (``whole``), never the
    base's."""
    lay = src.layout(name)
    what = f"{src.dir}: cannot read {name}"
    if lay is None:
        raise CheckpointReadError(f"{what}: no zarr metadata.")
    _check_fits(what, lay.nbytes, f"the array {list(lay.shape)} {lay.dtype}")
    out: np.ndarray | None = None
    try:
        for p in _pieces(src, name, ctx, stored_values.PIECE * 4, "whole"):
            if out is None:
                out = np.empty(lay.shape, p.data.dtype)
            out[p.box] = p.data
        if out is None:
            out = np.empty(lay.shape, lay.dtype)
    except MemoryError as e:  # under the machine's memory, over what this process may hold
        raise CheckpointReadError(f"{what}: out of memory ({lay.nbytes:,} bytes).") from e
    return out
