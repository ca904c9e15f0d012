"""Hugging Face safetensors files written in place, header first: `SafetensorsSink`, the
`sink.Sink` of `export_hf` and of the adapter export.

A safetensors file is an 8-byte little-endian header length, a JSON header (every
tensor's dtype, shape and byte range, plus ``__metadata__``) and the tensors' bytes. Every
shape and dtype of an export is known from metadata before a byte is computed, so the
whole layout (`layout_shards`: which tensor goes in which file, at which offset) is fixed
first, each file is created at its final size with its header, and each tensor is written
at its offset (`ShardFile.write`) as soon as it is computed, in any order, by any thread:
nothing is held until a file is complete.

Shards follow MaxText 0.2.5's ``shard_checkpoint``: tensors in sorted name order, a new
file when the next tensor would pass ``max_shard_size``; one file is
``model.safetensors``, several are ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json`` (``metadata.total_size`` and ``weight_map``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from ..storage import pagecache
from ..storage.scratch import scratch_buffer
from .sink import Part, PartWriter, Sink, Tensor

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 3 << 30  # MaxText's utils.DEFAULT_MAX_SHARD_SIZE (3 GiB)
FILE_METADATA = {"format": "pt"}  # what MaxText's numpy save_file writes in every file

_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def st_dtype(dtype: np.dtype | str) -> str:
    """The safetensors name of a numpy dtype (``float32`` -> ``F32``)."""
    name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"safetensors has no dtype for {name}")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class Shard(Part):
    """One file: its name, its tensors in file order, and each one's byte range."""

    header: bytes  # the length prefix and the JSON header, as written at offset 0
    offsets: dict[str, tuple[int, int]]  # tensor name -> (start, end) in the file

    @property
    def size(self) -> int:
        """The file's size in bytes."""
        return len(self.header) + self.data_bytes

    @property
    def signature(self) -> bytes:
        """The header: every tensor's dtype, shape and byte range, in file order."""
        return self.header


class SafetensorsSink(Sink):
    """Safetensors files (module docstring): ``weights_file`` for one file, split where
    the next tensor would pass ``max_shard_size``, with the index ``<weights_file>.index.json``."""

    def __init__(
        self, max_shard_size: int | None = None, *, weights_file: str = WEIGHTS_FILE
    ) -> None:
        self.max_shard_size = DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size
        self.weights_file = weights_file

    def layout(self, tensors: Iterable[Tensor]) -> list[Part]:
        return list(layout_shards(tensors, self.max_shard_size, weights_file=self.weights_file))

    def open(self, part: Part, path: str, *, shared: bool = False) -> ShardFile:
        assert isinstance(part, Shard), part  # laid out by this sink
        return ShardFile(path, part, shared=shared)

    def index(self, parts: Sequence[Part]) -> dict[str, str]:
        assert all(isinstance(p, Shard) for p in parts), parts  # laid out by this sink
        idx = index(parts)  # type: ignore[arg-type]  # the module's function
        if idx is None:
            return {}
        return {f"{self.weights_file}.index.json": json.dumps(idx, indent=2)}


def layout_shards(
    tensors: Iterable[Tensor],
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    *,
    weights_file: str = WEIGHTS_FILE,
) -> list[Shard]:
    """The files of ``tensors``: MaxText's greedy split over sorted names (module docstring)."""
    groups: list[list[Tensor]] = [[]]
    size = 0
    for t in sorted(tensors, key=lambda t: t.name):
        if groups[-1] and size + t.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    if len(groups) == 1:
        return [_shard(weights_file, groups[0])]
    n = len(groups)
    return [
        _shard(weights_file.replace(".safetensors", f"-{i:05d}-of-{n:05d}.safetensors"), g)
        for i, g in enumerate(groups, 1)
    ]


def _shard(name: str, tensors: Sequence[Tensor]) -> Shard:
    # Larger alignments first, then by name, as the safetensors library orders its files.
    ordered = sorted(tensors, key=lambda t: (-np.dtype(t.dtype).itemsize, t.name))
    header: dict[str, object] = {"__metadata__": dict(FILE_METADATA)}
    ranges: dict[str, tuple[int, int]] = {}
    at = 0
    for t in ordered:
        header[t.name] = {
            "dtype": st_dtype(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [at, at + t.nbytes],
        }
        ranges[t.name] = (at, at + t.nbytes)
        at += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    prefix = struct.pack("<Q", len(text)) + text
    offsets = {k: (len(prefix) + a, len(prefix) + b) for k, (a, b) in ranges.items()}
    return Shard(name, tuple(ordered), prefix, offsets)


def index(shards: Sequence[Shard]) -> dict | None:
    """``model.safetensors.index.json`` of a split export (None for a single file)."""
    if len(shards) == 1:
        return None
    return {
        "metadata": {"total_size": sum(s.data_bytes for s in shards)},
        "weight_map": {t.name: s.name for s in shards for t in sorted(s.tensors, key=_by_name)},
    }


def _by_name(t: Tensor) -> str:
    return t.name


class ShardFile(PartWriter):
    """A shard being written: created at its final size with its header; `write` puts a
    tensor's bytes at its offset (thread-safe: ``os.pwrite`` on disjoint ranges)."""

    def __init__(self, path: str, shard: Shard, *, shared: bool = False) -> None:
        """``shared``: several processes write this file, each its own tensors: it is
        opened as found (never truncated), and `close` checks none of them."""
        self.path = path
        self.shard = shard
        self.shared = shared
        flags = os.O_RDWR | os.O_CREAT | (0 if shared else os.O_TRUNC)
        self._fd = os.open(path, flags, 0o644)
        if os.fstat(self._fd).st_size != shard.size:
            os.ftruncate(self._fd, shard.size)
        os.pwrite(self._fd, shard.header, 0)
        self._left = {t.name: t for t in shard.tensors}
        # elements still to write of tensors written box by box (`write_box`)
        self._todo: dict[str, int] = {}
        self._lock = threading.Lock()
        # a tensor written whole leaves the page cache once on the disk (`pagecache`)
        self._drop = pagecache.RangeDropper(self._fd)

    def write(self, name: str, array: np.ndarray) -> None:
        t = self._left[name]
        a = np.ascontiguousarray(array)
        if a.shape != t.shape or a.dtype != np.dtype(t.dtype):
            raise ValueError(
                f"{self.shard.name}: {name} is {a.dtype}{list(a.shape)}, its header says "
                f"{np.dtype(t.dtype)}{list(t.shape)}"
            )
        start = self.shard.offsets[name][0]
        self._pwrite(memoryview(a.reshape(-1).view(np.uint8)), start)
        with self._lock:
            self._left.pop(name)
            self._todo.pop(name, None)
        self._drop.done(start, a.nbytes)

    def write_box(self, name: str, start: Sequence[int], data: np.ndarray) -> None:
        """Writes the box of tensor ``name`` at ``start`` (``data.shape`` long) in place.

        A box that is one run of the file, from contiguous data, is one ``pwrite``. Any
        other (a transposed piece: short runs a row apart) is copied tile by tile into a
        mapping of the bytes it spans, populated up front (a fault per page would cost more
        than the copy). Boxes of a tensor must not overlap; the tensor counts as written
        once they cover it."""
        t = self._left[name]
        if data.dtype != np.dtype(t.dtype) or len(start) != len(t.shape):
            raise ValueError(f"{self.shard.name}: {name}: a box of {data.dtype}, not {t.dtype}")
        if tuple(start) == (0,) * len(t.shape) and data.shape == tuple(t.shape):
            return self.write(name, data)
        if data.size:
            item = np.dtype(t.dtype).itemsize
            strides = [item * math.prod(t.shape[a + 1 :]) for a in range(len(t.shape))]
            lo = sum(s * st for s, st in zip(start, strides, strict=True))
            hi = sum((s + n - 1) * st for s, n, st in zip(start, data.shape, strides, strict=True))
            begin = self.shard.offsets[name][0]
            if hi + item - lo == data.nbytes:  # one run of the file
                if not data.flags.c_contiguous:  # a transposed piece: tile it into a buffer
                    raw = np.dtype(f"u{item}")
                    buf = scratch_buffer("write", data.nbytes).view(raw)[: data.size]
                    assign(buf.reshape(data.shape), data.view(raw))
                    data = buf
                self._pwrite(memoryview(data.reshape(-1).view(np.uint8)), begin + lo)
                # A run's pages are whole once written (no other box writes them, but for
                # its edge pages, which the kernel keeps): they leave the cache now, not
                # when the tensor is complete. A chunk that spans every layer completes its
                # tensors only with the param's last chunk, so they held a whole param
                # (3.7 GB for an 8B MLP kernel) in new page-cache pages (`pagecache`).
                self._drop.done(begin + lo, data.nbytes)
            else:
                self._copy_mapped(begin + lo, begin + hi + item, data, strides)
        with self._lock:
            left = self._todo.get(name, math.prod(t.shape)) - data.size
            if left <= 0:
                self._left.pop(name)
                self._todo.pop(name, None)
            else:
                self._todo[name] = left
        if left <= 0:
            begin, end = self.shard.offsets[name]
            self._drop.done(begin, end - begin)

    def _pwrite(self, view: memoryview, at: int) -> None:
        done = 0
        while done < len(view):  # pwrite may write less than asked
            done += os.pwrite(self._fd, view[done:], at + done)

    def _copy_mapped(self, lo: int, hi: int, data: np.ndarray, strides: list[int]) -> None:
        """``data`` into the file's bytes ``[lo, hi)`` as a strided view (``strides``)."""
        at = lo // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        raw = np.dtype(f"u{data.dtype.itemsize}")  # bfloat16 copies through a slow loop
        with mmap.mmap(self._fd, hi - at, flags=flags, offset=at) as mm:
            flat = np.frombuffer(mm, np.uint8, count=hi - lo, offset=lo - at)
            view = np.lib.stride_tricks.as_strided(
                flat.view(raw), shape=data.shape, strides=strides, writeable=True
            )
            assign(view, data.view(raw))
            del view, flat

    @property
    def missing(self) -> list[str]:
        return sorted(self._left)

    def close(self) -> None:
        """Flushes the file to disk (after every tensor was written) and closes it."""
        if self._left and not self.shared:
            raise ValueError(f"{self.shard.name}: tensors never written: {self.missing[:5]}")
        os.fsync(self._fd)
        self._drop.close()
        os.close(self._fd)

    def abandon(self) -> None:
        os.close(self._fd)


_TILE = 256  # a tile of a transposed copy: 256 x 256 elements stay in the CPU's caches


def assign(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``, tile by tile where ``src`` is transposed against ``dst`` (NumPy
    copies a transposed array element by element across rows: 0.24 GiB/s here, 1.75 in
    256 x 256 tiles)."""
    if src.ndim < 2 or src.strides[-1] == src.itemsize:
        dst[...] = src
        return
    for lead in np.ndindex(*src.shape[:-2]):
        d, s = dst[lead], src[lead]
        for r in range(0, s.shape[0], _TILE):
            for c in range(0, s.shape[1], _TILE):
                d[r : r + _TILE, c : c + _TILE] = s[r : r + _TILE, c : c + _TILE]
