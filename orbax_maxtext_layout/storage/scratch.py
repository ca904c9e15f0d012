"""Reusable per-thread buffers for the streaming operations.

Fresh memory is dear on a VM: the kernel zeroes every page on first touch, and the host
backs it (measured here: 2.3 GiB/s, 0.6 GiB/s in transparent huge pages, against 9 GiB/s to
rewrite a buffer already touched). A streaming worker decodes piece after piece of the same
size, so it keeps one buffer per use and rewrites it.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

_SCRATCH = threading.local()


def scratch_buffer(kind: str, nbytes: int) -> np.ndarray:
    """This thread's reusable bytes ``kind``, at least ``nbytes`` long (grown, never shrunk
    while the thread lives; a pool's threads free theirs when the pool shuts down)."""
    have = getattr(_SCRATCH, kind, None)
    if have is None or have.nbytes < nbytes:
        setattr(_SCRATCH, kind, None)  # the old buffer goes before the new one is made
        have = np.empty(nbytes, np.uint8)
        setattr(_SCRATCH, kind, have)
    return have


def release() -> None:
    """Frees this thread's buffers."""
    _SCRATCH.__dict__.clear()


# -- fresh memory, faulted in ahead of its writer -------------------------------------------
ALIGN = 64  # XLA's alignment for a host buffer it may use in place
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, without touching data
_madvise = None


def aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` fresh bytes at an `ALIGN`-byte boundary, in small pages (`small_pages`)."""
    raw = small_pages(nbytes + ALIGN)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + nbytes]


def small_pages(nbytes: int) -> np.ndarray:
    """A new uint8 buffer in small pages.

    NumPy asks for transparent huge pages for an array of 4 MiB or more, and on a VM whose
    free memory goes back to the host (virtio-balloon free page reporting, as here) a huge
    page's first touch waits for the host to back 2 MiB: 0.5 GB/s here, against 2.6 GB/s in
    small pages (a trainer's first restore gets such memory; a huge page the process itself
    freed a moment ago comes back at 10 GB/s, which only a benchmark that repeats in one
    process sees). Small pages cost the same whatever the memory's history.

    Such a buffer is a mapping of its own, advised against huge pages (``MADV_NOHUGEPAGE``,
    this mapping only), never NumPy's switch, which is the whole process's (issue 57: a
    library call leaves process settings alone). It is unmapped when the array goes."""
    if nbytes < _NUMPY_HUGE_FROM:
        return np.empty(nbytes, np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:  # pragma: no cover - a kernel without transparent huge pages
            pass
    return np.frombuffer(m, np.uint8)


_NUMPY_HUGE_FROM = 4 << 20  # NumPy advises huge pages for arrays this large and larger


def small_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A new array of zeros in small pages (`small_pages`: a fresh mapping reads as zeros,
    and each page costs only its first touch, in small pages)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes < _NUMPY_HUGE_FROM:
        return np.zeros(shape, dtype)
    return small_pages(nbytes).view(dtype).reshape(shape)


def populate(buf: np.ndarray, start: int, stop: int) -> bool:
    """Faults bytes ``[start, stop)`` of ``buf`` in (whole pages inside the range) with
    ``madvise(MADV_POPULATE_WRITE)``, which never changes what a page holds. False where the
    kernel does not offer it (Linux before 5.14, gVisor): then nothing was done."""
    global _madvise
    if _madvise is None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _madvise = libc.madvise
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            _madvise = False
    if not _madvise:
        return False
    base = buf.ctypes.data
    lo = (base + start + 4095) & ~4095
    hi = (base + stop) & ~4095
    if hi <= lo:
        return True
    if _madvise(lo, hi - lo, _MADV_POPULATE_WRITE) != 0:
        _madvise = False  # an older kernel: EINVAL, once
        return False
    return True


class Ahead:
    """A fresh buffer faulted in by other threads ahead of its writers, range by range.

    The kernel zeroes a fresh page on first touch (0.9 GB/s on one core of a TPU host, as
    slow as decoding into it). `touch` (on a helper thread, ranges in order) faults a range
    in; a writer calls `claim` before writing bytes. A range is touched or written first by
    exactly one side: a writer waits for a range being touched, and takes a range not yet
    reached (the helper then skips it), so it never waits for an idle helper.
    """

    def __init__(self, buf: np.ndarray, step: int, *, madvise: bool = True) -> None:
        self.buf, self.step, self.madvise = buf, step, madvise
        self.state = [0] * (-(-buf.nbytes // step))  # 0 free, 1 touching, 2 done
        self.cond = threading.Condition()

    def touch(self, i: int) -> None:
        with self.cond:
            if self.state[i]:
                return
            self.state[i] = 1
        start, stop = i * self.step, min((i + 1) * self.step, self.buf.nbytes)
        try:
            if not (self.madvise and populate(self.buf, start, stop)):
                # No madvise: write one byte per page. The range is this thread's alone (the
                # writer waits for it), so a zero written here is overwritten later.
                self.buf[start:stop:4096] = 0
        finally:
            with self.cond:
                self.state[i] = 2
                self.cond.notify_all()

    def claim(self, start: int, stop: int) -> None:
        """Before a writer writes bytes ``[start, stop)``: every range they touch is the
        writers' (taken now, or touched: waited for while it is being touched)."""
        with self.cond:
            for i in range(start // self.step, min(len(self.state), -(-stop // self.step))):
                if self.state[i] == 0:
                    self.state[i] = 2
                while self.state[i] == 1:
                    self.cond.wait()


# -- the allocator -------------------------------------------------------------------------
def _libc():
    """The C library's functions (``ctypes.CDLL(None)``), or None where none can be loaded."""
    try:
        import ctypes

        return ctypes.CDLL(None)
    except OSError:  # pragma: no cover - no C library to load
        return None


def trim() -> None:
    """Returns the heap's free memory to the OS now (glibc's ``malloc_trim(0)``, every arena).

    glibc raises its mmap threshold after freeing a large block (up to 32 MiB), so
    chunk-sized buffers (a copy's values, tensorstore's write buffers, on many threads'
    arenas) come from the heap, and what they free stays in the process: a copy of many
    multi-MiB chunks grew the RSS to 400 MiB past a 16 MiB budget. The command line fixes
    the threshold for its whole process (`tune_for_command`); a library call may not (issue
    57), so a streaming copy trims after each batch instead: an action on the allocator,
    which changes none of its settings. No-op off glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = getattr(_libc(), "malloc_trim", False)
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def tune_for_command() -> None:
    """The process-wide allocator settings a command, which owns its process, runs with; a
    library call never calls this (`cli.common.owned_process` does, issue 57).

    - glibc returns large freed buffers to the OS at once: it raises its mmap threshold
      after freeing a large block (up to 32 MiB), so later chunk-sized buffers would come
      from the heap and stay resident, and copying many multi-MiB chunks would grow the RSS
      far past the budget. A fixed 1 MiB threshold keeps every chunk buffer in its own
      mapping.
    - NumPy asks for no transparent huge pages: a huge page's first touch zeroes 2 MiB at a
      time, 4x slower than small pages on this kind of VM (0.6 vs 2.3 GiB/s).
    """
    try:
        np._core.multiarray._set_madvise_hugepage(False)
    except AttributeError:  # pragma: no cover - a NumPy without the switch
        pass
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is not None:
        mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
