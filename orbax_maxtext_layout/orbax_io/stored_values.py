"""A stored value (one chunk, or one zarr3 shard) read piece by piece, as a file is read:
from its data file (with `os.preadv`) where it lies in one on a local disk, from
the B-tree where OCDBT stored it inline (a small value), else through the kvstore; and two
stored values compared without decoding them.

`Stored` is what the decoder (`chunks`) and the layout reader (`zarr`) need of an item; the
item reader (`reader.ItemReader`) is the one object that provides it.
"""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np
import tensorstore as ts
from etils import epath

from ..errors import CheckpointReadError
from ..storage.scratch import scratch_buffer
from .orbax_files import ItemFiles


class Stored(Protocol):
    """An item whose stored values can be read (`reader.ItemReader`)."""

    files: ItemFiles
    kv: ts.KvStore

    @property
    def dir(self) -> epath.Path: ...

    @property
    def use_zarr3(self) -> bool: ...

    def stored_value(
        self, key: str, scratch: str | None = None
    ) -> FileValue | KvValue | InlineValue | None: ...

    def small_value(self, key: str) -> bytes | None: ...

    def layout(self, name: str): ...

    def fill_value(self, name: str) -> np.ndarray: ...

    def read_error(self, what: str, e: Exception) -> CheckpointReadError: ...


class Short(Exception):
    """A stream ended before the bytes it should hold."""


def read_exactly(r, out: np.ndarray) -> None:
    """Fills ``out`` (C-contiguous) from the stream ``r``."""
    view = memoryview(out.reshape(-1).view(np.uint8))
    done = 0
    while done < len(view):
        n = r.readinto(view[done:])
        if not n:
            raise Short(f"{done} of {len(view)} bytes")
        done += n


# A stored value is read in pieces of this size, so a decode holds one piece of the stored
# chunk at a time, not all of it (and the kvstore's copies of it).
PIECE = 8 << 20
# A local data file is read in pieces of at most this size (`FileValue.read`): a piece the
# size of a core's L2 cache is still there when the decoder reads it after the kernel's
# copy. On the 2-core VM (1 MiB of L2 a core) a restore cost the CPU time of the mapped
# reads it replaced with 1 MiB pieces, and 5 to 10% more with 8 MiB (docs/performance.md).
FILE_PIECE = 1 << 20


def same_pieces(va: FileValue, vb: FileValue, length: int) -> bool | None:
    """`same_stored`'s comparison of two open values of ``length`` bytes, piece by piece."""
    left = length
    while left > 0:
        try:
            x, y = va.read(), vb.read()
        except CheckpointReadError:
            return None  # a file cut short: the kvstore's read reports it
        if len(x) != len(y) or not len(x):
            return None
        if not np.array_equal(np.frombuffer(x, np.uint8), np.frombuffer(y, np.uint8)):
            return False
        left -= len(x)
    return True


class FileValue:
    """Bytes ``[start, end)`` of a data file, read (``read``, as a file is) with `os.preadv`
    into one reused buffer: this thread's ``scratch`` buffer, or one of the value's own.

    Read, never mapped: a mapped page past the end of a file that another process cut
    short meanwhile (a ``max_to_keep`` deleting the step in place, a copy landing over
    it) raises SIGBUS, which ends the process; a read past it returns short, which `read`
    reports as a `CheckpointReadError` naming the file. (Mapping saved the copy from the
    page cache: 13% of a restore's CPU on this project's VM; docs/performance.md has what
    reading costs instead.) An open file that is unlinked meanwhile reads on, whole.

    zstandard's stream reader asks for more input only once it has used all it was given,
    so one buffer serves a whole stream. A fresh ``bytes`` per read cost a fresh mapping
    each time (the command line has glibc map buffers over 1 MiB: `cli.common.owned_process`),
    whose pages the kernel zeroes on first touch: 8% of the CPU of an 8B ``export-hf``."""

    def __init__(
        self,
        path: str,
        start: int,
        end: int,
        fd: int | None = None,
        *,
        scratch: str | None = None,
    ):
        self.path, self.pos, self.end = path, start, end
        self.fd = os.open(path, os.O_RDONLY) if fd is None else fd
        self.owns = fd is None
        self.scratch = scratch
        self._buf: np.ndarray | None = None

    def __enter__(self) -> FileValue:
        return self

    def __exit__(self, *exc) -> None:
        if self.owns:
            os.close(self.fd)

    def suffix(self, n: int) -> bytes | None:
        """The last ``n`` bytes of the value; None where it holds fewer; `CheckpointReadError`
        where the file ends before the value does."""
        if self.end - n < self.pos:
            return None
        got = os.pread(self.fd, n, self.end - n)
        if len(got) < n:
            raise self._cut(self.end - n + len(got))
        return got

    def part(self, offset: int, size: int) -> FileValue:
        """Bytes ``[offset, offset + size)`` of this value (the same open file)."""
        start = self.pos + offset
        end = min(self.end, start + size)
        return FileValue(self.path, start, end, self.fd, scratch=self.scratch)

    def read(self, n: int = -1) -> memoryview | bytes:
        """The next ``n`` bytes (at most `PIECE`; all that is left of the value where
        fewer), valid until the next read; `CheckpointReadError` where the file ends
        before them."""
        n = min(PIECE if n is None or n < 0 else n, FILE_PIECE, self.end - self.pos)
        if n <= 0:
            return b""
        if self.scratch is not None:
            buf = scratch_buffer(self.scratch, n)[:n]
        else:
            if self._buf is None or self._buf.nbytes < n:
                self._buf = np.empty(n, np.uint8)
            buf = self._buf[:n]
        done = 0
        while done < n:  # a short read short of the end: a network file system may give one
            got = os.preadv(self.fd, [buf[done:]], self.pos + done)
            if got <= 0:
                raise self._cut(self.pos + done)
            done += got
        self.pos += n
        return memoryview(buf)

    def cut_meanwhile(self) -> CheckpointReadError | None:
        """The error naming this data file where it now ends before the value does: cut
        short while it was read. A read racing the truncation can copy the cut pages as
        zeros instead of returning short (the kernel checked the size before the cut), so
        the value then fails to decode rather than to read (`chunks._decoding`)."""
        try:
            size = os.fstat(self.fd).st_size
        except OSError:
            return None
        return self._cut(size) if size < self.end else None

    def _cut(self, at: int) -> CheckpointReadError:
        return CheckpointReadError(
            f"{self.path}: the data file ends at byte {at}, before the end of the stored "
            f"value it holds (byte {self.end}): it was cut short, maybe while this read it "
            "(another process deleting or rewriting the step in place, a copy still "
            "landing). Read the step once it is complete, or another step."
        )


class InlineValue:
    """A value stored inline in an OCDBT B-tree (a small one), whose bytes the item's walk of
    the B-tree has read already (`ocdbt.value_locations`): read as a file is, with no
    kvstore read. An unconverted Tunix step of many small leaves is mostly such values: two
    or three kvstore reads each cost 9 of 11 s of a restore of 4,626 leaves."""

    def __init__(self, data: bytes, start: int = 0, end: int | None = None):
        self.data = memoryview(data)
        self.pos, self.end = start, len(data) if end is None else min(end, len(data))

    def __enter__(self) -> InlineValue:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def suffix(self, n: int) -> bytes | None:
        return bytes(self.data[self.end - n : self.end]) if self.end - n >= self.pos else None

    def part(self, offset: int, size: int) -> InlineValue:
        """Bytes ``[offset, offset + size)`` of this value."""
        start = self.pos + offset
        return InlineValue(self.data.obj, start, min(self.end, start + size))

    def read(self, n: int = -1) -> memoryview:
        n = min(PIECE if n is None or n < 0 else n, self.end - self.pos)
        if n <= 0:
            return memoryview(b"")
        self.pos += n
        return self.data[self.pos - n : self.pos]


class KvValue:
    """A stored value read through the kvstore, piece by piece (``read``, as a file is)."""

    def __init__(self, kv: ts.KvStore, key: str, start: int = 0, end: int | None = None):
        self.kv, self.key, self.pos, self.end, self.done = kv, key, start, end, False

    def __enter__(self) -> KvValue:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def exists(self) -> bool:
        return self.kv.read(self.key, byte_range=slice(0, 0)).result().state == "value"

    def suffix(self, n: int) -> bytes | None:
        got = self.kv.read(self.key, byte_range=slice(-n, None)).result()
        return bytes(got.value) if got.state == "value" and len(got.value) == n else None

    def part(self, offset: int, size: int) -> KvValue:
        """Bytes ``[offset, offset + size)`` of this value."""
        return KvValue(self.kv, self.key, offset, offset + size)

    def read(self, n: int = -1) -> bytes:
        if self.done:
            return b""
        n = PIECE if n is None or n < 0 else n
        stop = self.pos + n if self.end is None else min(self.end, self.pos + n)
        if stop <= self.pos:
            self.done = True
            return b""
        try:
            data = self.kv.read(self.key, byte_range=slice(self.pos, stop)).result().value
        except ValueError as e:  # past the end of a value of unknown size: the rest
            if "OUT_OF_RANGE" not in str(e):
                raise
            data = self.kv.read(self.key, byte_range=slice(self.pos, None)).result().value
            self.done = True
        self.pos += len(data)
        return data
