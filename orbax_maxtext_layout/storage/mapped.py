"""Read-only mappings of local files, shared by the threads that read them.

Reading a stored value with ``os.preadv`` makes the kernel copy every byte from the page
cache into the process: 13% of the CPU of a restore on this project's VM
(``_copy_to_iter``). A mapping hands the decoder the page cache's own pages instead. A range
is mapped in one call before it is read (`POPULATE_READ`; otherwise each 64 KiB faults in
on its own). Once decoded, it is dropped from the process (`release`): the pages stay in
the page cache, but the mapped bytes never add up in the process's RSS.

Files are mapped only where the kernel maps a range in one call (``MADV_POPULATE_READ``,
Linux 5.14 and later), probed once per process. Elsewhere every value is read with
``os.preadv``. One such place is gVisor, which the TPU machine runs: there a mapped range
stayed in the process after it was released, 1 to 2 GiB more peak RSS on a 2.5 GiB
restore.

A file cut short while it is mapped raises SIGBUS on access, as it does for the safetensors
library. Orbax never rewrites a data file. A range that lies past the file's end when the
file is mapped is never given out, so the caller reads it with ``os.preadv``, which reports
it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading

POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14
MAX_FILES = 128  # files one owner maps (each mapping holds a file descriptor); then None


def advise(m: mmap.mmap, advice: int, start: int, n: int) -> None:
    """``madvise`` on the pages holding ``[start, start + n)`` of ``m``. If the kernel
    refuses the advice, nothing changes: pages then fault in, or stay, as they would."""
    lo = start - start % mmap.PAGESIZE
    with contextlib.suppress(OSError, ValueError):
        m.madvise(advice, lo, start + n - lo)


def release(m: mmap.mmap, start: int, n: int) -> None:
    """Pages of ``[start, start + n)`` out of the process; a later read maps them again."""
    if n > 0:
        advise(m, mmap.MADV_DONTNEED, start, n)


class MappedFiles:
    """Each local file mapped read-only once, for an owner's threads to share (a reader
    of one item). A mapping is unmapped when the owner and the last view of it are gone."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap | None] = {}
        self._lock = threading.Lock()

    def covering(self, path: str, end: int) -> mmap.mmap | None:
        """The mapping of ``path`` if the file holds bytes up to ``end``; else None. None
        also where it cannot be mapped: the kernel refuses or cannot populate a range in
        one call (`populates`), or `MAX_FILES` are mapped."""
        with self._lock:
            if path not in self._maps:
                self._maps[path] = _map(path) if len(self._maps) < MAX_FILES else None
            m = self._maps[path]
        return m if m is not None and end <= len(m) else None


def populates(m: mmap.mmap) -> bool:
    """Whether this kernel populates a mapped range in one call (asked once, on ``m``)."""
    global _POPULATES
    if _POPULATES is None:
        try:
            m.madvise(POPULATE_READ, 0, min(len(m), mmap.PAGESIZE))
            _POPULATES = True
        except (OSError, ValueError):  # EINVAL: Linux before 5.14, gVisor
            _POPULATES = False
    return _POPULATES


_POPULATES: bool | None = None


def may_map() -> bool:
    """False once `populates` said no in this process: no file is mapped only to be
    closed again."""
    return _POPULATES is not False


def map_readonly(fd: int, size: int) -> mmap.mmap | None:
    """The first ``size`` bytes of open file ``fd`` mapped read-only, where files are mapped
    here: None where the kernel refuses, or cannot populate a range in one call
    (`populates`; once it said no, nothing is mapped only to be closed again)."""
    if not size or not may_map():
        return None
    try:
        m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    if populates(m):
        return m
    m.close()
    return None


def _map(path: str) -> mmap.mmap | None:
    if not may_map():  # not even opened
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return map_readonly(fd, os.fstat(fd).st_size)
    except OSError:
        return None
    finally:
        os.close(fd)  # the mapping keeps its own descriptor
