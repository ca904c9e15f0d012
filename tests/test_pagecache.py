"""Streamed output leaves the page cache once durable (`pagecache`).

Residency is the kernel's own answer (``mincore(2)`` on a mapping of the file), so these
tests fail if a written file stays cached, or if a file not yet final is dropped."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from orbax_maxtext_layout.storage import pagecache

MIB = 1 << 20


@functools.cache
def page_cache_drops() -> bool:
    """Whether this kernel drops a synced file's pages on ``POSIX_FADV_DONTNEED``: Linux does;
    gVisor, the sandbox of the TPU host (issue 45), keeps every page resident."""
    if not sys.platform.startswith("linux"):
        return False
    with tempfile.TemporaryDirectory() as d:
        probe = Path(d) / "probe"
        _write(probe, 64 * mmap.PAGESIZE)
        fd = os.open(probe, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return resident(probe) < 32


def resident(path: Path) -> int:
    """Pages of ``path`` in the page cache."""
    size = path.stat().st_size
    if not size:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        try:
            assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def _write(path: Path, n: int = 2 * MIB) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.write(fd, os.urandom(n))
        os.fsync(fd)
    finally:
        os.close(fd)


DROPS = "this kernel keeps written pages cached whatever it is told (gVisor: the TPU host)"
pytestmark = pytest.mark.skipif(not page_cache_drops(), reason=DROPS)


def test_dropping_evicts_finished_files_only(tmp_path):
    """Files under a final name leave the cache, while the block runs and at its end; a
    file still being written (tensorstore's ``<name>.__lock``) and files outside the
    folder stay."""
    d = tmp_path / "d"
    d.mkdir()
    outside = tmp_path / "outside"
    _write(outside)
    with pagecache.dropping(d):
        _write(d / "early")
        import time

        deadline = time.monotonic() + 10
        while resident(d / "early") and time.monotonic() < deadline:
            time.sleep(pagecache.POLL_S / 2)
        assert resident(d / "early") == 0  # dropped while the block runs
        _write(d / "late")
        _write(d / "late.__lock")
    assert resident(d / "late") == 0  # the last sweep
    assert resident(d / "late.__lock") == 2 * MIB // mmap.PAGESIZE
    assert resident(outside) == 2 * MIB // mmap.PAGESIZE


def test_dropping_survives_a_folder_removed_or_never_made(tmp_path):
    with pagecache.dropping(tmp_path / "never"):
        pass
    d = tmp_path / "d"
    d.mkdir()
    with pagecache.dropping(d):
        _write(d / "f")
        shutil.rmtree(d)  # a discarded write
    assert not d.exists()


def test_range_dropper_evicts_complete_ranges_once_written_back(tmp_path):
    """A range reported done starts its writeback and stays; the next report evicts it
    (synced meanwhile); `close` drops the rest. (The kernel evicts whole folios: a range
    is dropped whole where its ends fall on folio bounds, as 4 MiB bounds do here.)"""
    path = tmp_path / "shard"
    r = 4 * MIB
    pages = r // mmap.PAGESIZE
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, os.urandom(3 * r), 0)
        drop = pagecache.RangeDropper(fd)
        drop.done(0, r)
        assert resident(path) == 3 * pages  # dirty: its writeback starts, nothing dropped
        os.fsync(fd)
        drop.done(r, r)  # evicts the first (synced since) and the second, clean as well
        assert resident(path) == pages  # the third, never reported
        drop.close()
        assert resident(path) == 0
    finally:
        os.close(fd)
    assert path.stat().st_size == 3 * r and path.read_bytes()[:8]
