"""Streamed output leaves the page cache once it is on the disk.

A conversion, a merge or an export writes each output byte once and reads none of it back.
Kept in the page cache, a 16 GB output evicts what the machine had cached (the source being
read among it), and every byte of it takes a freshly allocated page. On this project's VM
that was the largest single cost of ``convert --unroll``: 27 to 45% of its CPU time was the
kernel copying written bytes into new page-cache pages (``copy_folio_from_iter_atomic``),
and 3 GB written as 2 MB files, each synced, took 13 to 33 s kept in the cache against 2.8
to 3.4 s dropped from it as each file was synced (docs/performance.md). ``dd
oflag=nocache`` and ``rsync --drop-cache`` do the same for the same reason.

Two shapes of writer, one rule (evict only what is durable: the kernel evicts clean pages
only, and starts writing back the dirty ones it is asked to drop):

* `dropping`: tensorstore writes an OCDBT database's data files (``d/``), each to
  ``<name>.__lock``, synced, then renamed: a file under its final name is on the disk. A
  thread evicts each one as it appears, and once more when the block ends.
* `RangeDropper`: a file written in place (a safetensors shard) is evicted range by range as
  the writer reports each range complete: the first request starts its writeback, a later
  one evicts it.

Only local files have a page cache: the store decides (`store.StepStore.drop_written`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_FADVISE = getattr(os, "posix_fadvise", None)  # Linux and most POSIX systems; else a no-op
POLL_S = 0.2  # how often `dropping` looks for finished files


def _sync_file_range():
    """Linux's ``sync_file_range(2)`` through libc, or None (Python's ``os`` lacks it)."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_RANGE = _sync_file_range()
# SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER: the range written back, now
_WRITTEN_BACK = 1 | 2 | 4


def evict(fd: int, offset: int = 0, length: int = 0) -> None:
    """Asks the kernel to drop ``[offset, offset + length)`` of ``fd`` (0: to the end) from
    the page cache: clean pages go, dirty ones start their writeback."""
    if _FADVISE is not None:
        _FADVISE(fd, offset, length, os.POSIX_FADV_DONTNEED)


def written_back(fd: int, offset: int, length: int) -> None:
    """Waits until ``[offset, offset + length)`` of ``fd`` is written back (its pages
    clean, so `evict` drops them; not a durability guarantee: the file's metadata is not
    synced). A no-op where the call is missing: `evict` then drops what is clean."""
    if _SYNC_RANGE is not None and length > 0:
        _SYNC_RANGE(fd, offset, length, _WRITTEN_BACK)


def evict_file(path: str) -> None:
    """`evict` of a whole file, if it still exists."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # removed meanwhile (a discarded write): nothing to drop
        return
    try:
        evict(fd)
    finally:
        os.close(fd)


class _Sweeper:
    """Evicts each file of ``folder`` whose name is final, once."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.done: set[str] = set()

    def sweep(self) -> None:
        try:
            entries = list(os.scandir(self.folder))
        except OSError:  # not created yet, or removed
            return
        for e in entries:
            if e.name not in self.done and "." not in e.name and e.is_file():
                self.done.add(e.name)
                evict_file(e.path)


@contextlib.contextmanager
def dropping(folder: os.PathLike | str) -> Iterator[None]:
    """While the block runs, every file of ``folder`` written under its final name (a
    name without a dot: tensorstore's data files) is dropped from the page cache; the
    block's end sweeps ``folder`` once more."""
    if _FADVISE is None:
        yield
        return
    sweeper, stop = _Sweeper(os.fspath(folder)), threading.Event()

    def run() -> None:
        while not stop.wait(POLL_S):
            sweeper.sweep()

    thread = threading.Thread(target=run, name="omtl-pagecache", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sweeper.sweep()


class RangeDropper:
    """Evicts ranges of one open file as they are complete (`done`): the first request
    starts a range's writeback; at the next `done` (the writer's next piece: the writeback
    had that long), the range is waited on until written back (`written_back`), then
    evicted. Only asked again, a range still being written back stayed cached until
    `close`: with pieces a few tenths of a second apart, most did."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pending: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def done(self, offset: int, length: int) -> None:
        with self._lock:
            ranges, self._pending = self._pending, [(offset, length)]
        for r in ranges:
            written_back(self.fd, *r)
            evict(self.fd, *r)
        evict(self.fd, offset, length)  # starts the writeback

    def close(self) -> None:
        """After the file is synced: drops it all."""
        evict(self.fd)
