"""What an array's zarr metadata says, checked before anything is allocated from it: its
stored `ChunkLayout` (shape, dtype, chunk grid, zarr3 shards, whether a chunk is a plain zstd
frame the decoder streams itself), zarr2 and zarr3 alike.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from .orbax_files import CheckpointRefusedError, parse_zarr_metadata
from .stored_values import Stored

try:  # decodes a stored chunk ~2.4x faster than tensorstore (`chunks`)
    import zstandard as zstd
except ImportError:  # pragma: no cover - a dependency; tensorstore reads without it
    zstd = None


# Below this an array is read whole by tensorstore: it decodes each chunk once too, and
# for small arrays its one call costs less than the chunk walk.
SMALL = 1 << 20

MISSING = (1 << 64) - 1  # a shard index's offset of a chunk never written

# A chunk grid is bounded by the array's bytes, not by what the metadata claims (issue 58):
# every reader plans per stored chunk (the restore engine: ~330 bytes of task a chunk), so a
# grid of [1, 1] chunks over a 4096 x 4096 array (16.7 M chunks) cost 2.5 GB and 81 s of
# planning before any data was read. Orbax's chunks are per-device shards, cut further only
# into chunks of ``chunk_byte_size`` (MiBs); the smallest legitimate ones are a small
# array's shards on a large slice (a [4096] norm scale in bfloat16 over 256 fsdp devices:
# 32-byte chunks), so the bound has two parts: any grid of up to ``GRID_FREE`` chunks (what
# a job of that many devices writes; its plan is a few MiB), and beyond that, chunks of at
# least ``GRID_MIN_CHUNK`` bytes on average (a grid of 2**20 chunks needs a 4 GiB array).
GRID_FREE = 1 << 16
GRID_MIN_CHUNK = 4096


def _plain_zstd(codecs: list) -> bool:
    """zarr3 codecs ``bytes`` (little-endian) then ``zstd``, nothing else."""
    if [c.get("name") for c in codecs] != ["bytes", "zstd"]:
        return False
    return (codecs[0].get("configuration") or {}).get("endian", "little") == "little"


def _shard_index_bytes(conf: dict) -> int | None:
    """Bytes of a one-chunk shard's index at its end (offset and size, little-endian, then
    an optional crc32c), or None for another index layout."""
    if conf.get("index_location", "end") != "end":
        return None
    names = [c.get("name") for c in conf.get("index_codecs", [])]
    if names == ["bytes"]:
        return 16
    if names == ["bytes", "crc32c"]:
        return 20
    return None


def np_dtype(name: object) -> np.dtype | None:
    """The numpy dtype of a zarr dtype name: numpy's (``<f4``, ``float32``, ``|b1``...) or
    ml_dtypes' (``bfloat16``, ``float8_e4m3fn``, ``int4``...), of booleans or numbers.
    None for any other (a structured, object, string or time dtype, or not a name): nothing
    Orbax stores, and nothing `chunks` may decode into (issue 46: an object dtype's buffer
    holds pointers)."""
    if not isinstance(name, str):
        return None
    import ml_dtypes

    extra = getattr(ml_dtypes, name.lstrip("<>|="), None)
    if isinstance(extra, type) and issubclass(extra, np.generic):
        return np.dtype(extra)
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError, OverflowError):
        return None
    return dtype if dtype.kind in "biufc" else None


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
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


def read_layout(src: Stored, name: str) -> ChunkLayout | None:
    meta_key = f"{name}/zarr.json" if src.use_zarr3 else f"{name}/.zarray"
    raw = src.small_value(meta_key)
    if raw is None:
        return None
    where = f"{src.dir}/{meta_key}"
    meta = parse_zarr_metadata(raw, where)
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
    dtype = np_dtype(meta.get("dtype"))
    plain = (
        comp.get("id") == "zstd"
        and not meta.get("filters")
        and meta.get("order", "C") == "C"
        and dtype is not None
        and dtype.byteorder != ">"
    )
    return ChunkLayout(
        shape,
        np.dtype(dtype) if dtype is not None else np.dtype("V1"),
        tuple(meta.get("chunks", shape)),
        None,
        0,
        meta.get("dimension_separator", "."),
        False,
        plain and zstd is not None,
    )


def _zarr3_layout(meta: dict, shape: tuple[int, ...]) -> ChunkLayout:
    grid = tuple((meta.get("chunk_grid", {}).get("configuration") or {}).get("chunk_shape", shape))
    codecs = meta.get("codecs", [])
    enc = meta.get("chunk_key_encoding", {"name": "default"})
    sep = (enc.get("configuration") or {}).get("separator", "/")
    dtype = np_dtype(meta.get("data_type"))
    chunk, shard, index = grid, None, 0
    if [c.get("name") for c in codecs] == ["sharding_indexed"]:
        conf = codecs[0].get("configuration") or {}
        inner = tuple(conf.get("chunk_shape") or grid)
        per_shard = math.prod(-(-g // i) for g, i in zip(grid, inner, strict=False))
        tail = _shard_index_bytes(conf)
        exact = all(g % i == 0 for g, i in zip(grid, inner, strict=False))
        chunk, shard, codecs = inner, grid, conf.get("codecs", [])
        index = 0 if tail is None or not exact else 16 * per_shard + (tail - 16)
    plain = (
        _plain_zstd(codecs)
        and enc.get("name") == "default"
        and dtype is not None
        and (shard is None or index > 0)
        and zstd is not None
    )
    return ChunkLayout(
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
    - a dtype numpy (or ml_dtypes) names, of booleans or numbers (`np_dtype`);
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
    if np_dtype(dtype) is None:
        raise CheckpointRefusedError(f"{where}: unsupported dtype {_short(dtype)}; refused.")
    codecs = _check_encoding(meta, where, use_zarr3=use_zarr3)
    finest = grid  # the chunks readers decode one by one: a shard's inner chunks
    if codecs and codecs[0]["name"] == "sharding_indexed":
        inner = _member(codecs[0], "configuration", "chunk_shape")
        inner = _dims(inner, where, "inner chunk shape", 1, grid)
        if any(g % i for g, i in zip(grid, inner, strict=True)):
            raise CheckpointRefusedError(
                f"{where}: inner chunk {list(inner)} does not divide the shard {list(grid)}; "
                "refused."
            )
        finest = inner
    _check_grid(where, shape, finest, np_dtype(dtype).itemsize)
    # ``[]``: none (this library recorded a scalar's for the layers of it it stacked).
    if isinstance(value_meta, dict) and value_meta.get("write_shape") not in (None, []):
        _dims(value_meta["write_shape"], where, "_METADATA write_shape", 0, shape, empty=0)
    if isinstance(array_meta, dict):
        for key, empty in (("write_shape", 0), ("chunk_shape", 1)):
            if array_meta.get(key) not in (None, []):
                _dims(array_meta[key], where, f"array_metadatas {key}", 0, shape, empty=empty)


def _check_grid(where: str, shape: tuple, chunk: tuple, itemsize: int) -> None:
    """Refuses a grid of more chunks than the array's bytes allow (`GRID_FREE`,
    `GRID_MIN_CHUNK`), before any reader plans a task per chunk."""
    if 0 in shape:
        return
    count = math.prod(-(-n // c) for n, c in zip(shape, chunk, strict=True))
    nbytes = math.prod(shape) * itemsize
    if count > max(GRID_FREE, nbytes // GRID_MIN_CHUNK):
        raise CheckpointRefusedError(
            f"{where}: a grid of {count:,} chunks of {list(chunk)} for an array of "
            f"{list(shape)} ({nbytes:,} bytes): more than {GRID_FREE:,} chunks of under "
            f"{GRID_MIN_CHUNK:,} bytes on average, which no Orbax writer makes (damaged or "
            "forged); refused. Restore from another copy of the step."
        )


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
