"""Data files of a new item: shared with the legacy item (reflink, hard link) or copied.

Orbax never modifies a committed data file (an OCDBT data file or a zarr chunk is
written once and only ever read), so a converted item may hold the legacy item's
data files themselves instead of copies. On a local file system each file is, in
this order:

1. **reflinked** (the ``FICLONE`` ioctl): a copy-on-write clone, a separate inode
   whose extents are the source's. No data is written, and the two names can never
   diverge: writing, truncating or deleting one leaves the other as it was. XFS
   (``reflink=1``, its default since xfsprogs 5.1), btrfs, bcachefs, OCFS2, some
   NFS servers.
2. **hard-linked**: the same inode under a second name. No data is written; a
   change made to the file in place later (a truncation, a flipped bit) shows
   under both names. ext4, tmpfs and most other file systems.
3. **copied** (a streaming copy) when neither works, and the reason is counted:
   another file system (``EXDEV``, also across bind mounts), a file system without
   links (``EPERM``, ``EOPNOTSUPP``, ``ENOSYS``: many FUSE mounts), too many links
   to one file (``EMLINK``), a file system that "links" by copying (a new inode).

Reflink comes first because it is the safer way to share: the clone is a file of its
own (nothing done to the legacy file later can reach it), yet costs no more than a link.
A failure that holds for a whole pair of file systems (``EXDEV``, ``EOPNOTSUPP``,
``ENOTTY``, ``EINVAL``, ``ENOSYS``, ``EPERM``) is remembered for that pair, so each
kind is probed once per pair of file systems, not tried and failed once per file.
``copy=True`` (``--copy``) skips sharing: every file is a private, physical copy
(never a clone: see `Placer.copy`).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..base.futures import results
from . import memory

REFLINK, HARDLINK, COPY = "reflink", "hardlink", "copy"
KINDS = (REFLINK, HARDLINK, COPY)
SHARE_MODE, COPY_MODE, SERVER_SIDE = "share", "copy", "server-side"
ASKED = "asked for private copies (copy=True, --copy)"
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)

# Failures that say "not on this pair of file systems" rather than "not this file".
_FS_WIDE = {
    errno.EXDEV,
    errno.EOPNOTSUPP,
    errno.ENOTSUP,
    errno.ENOTTY,
    errno.EINVAL,
    errno.ENOSYS,
    errno.EPERM,
}
_REASONS = {
    errno.EXDEV: "another file system",
    errno.EPERM: "the file system does not permit hard links",
    errno.EOPNOTSUPP: "the file system does not support hard links",
    errno.ENOSYS: "the file system does not implement hard links",
    errno.EMLINK: "too many links to the file",
    errno.EACCES: "a hard link was refused",
}
COPIED_ON_LINK = "the file system made a new file for the hard link"


@dataclasses.dataclass
class Placement:
    """How the data files of a new item were placed: counts per kind, and why any was copied.

    ``mode`` is ``"share"`` (reflink, else hard link, else copy), ``"copy"`` (asked) or
    ``"server-side"`` (an object store: every object copied by the server, not counted).
    """

    mode: str = SHARE_MODE
    files: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bytes: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    why: dict[str, int] = dataclasses.field(default_factory=dict)  # copy reason -> files
    reflinked: set[tuple[int, int]] = dataclasses.field(default_factory=set, repr=False)

    def add(self, kind: str, size: int, why: str | None = None) -> None:
        self.files[kind] += 1
        self.bytes[kind] += size
        if why is not None:
            self.why[why] = self.why.get(why, 0) + 1

    def merge(self, other: Placement) -> None:
        if other.mode != self.mode and other.mode == SERVER_SIDE:
            self.mode = SERVER_SIDE
        for kind in KINDS:
            self.files[kind] += other.files[kind]
            self.bytes[kind] += other.bytes[kind]
        for why, n in other.why.items():
            self.why[why] = self.why.get(why, 0) + n
        self.reflinked |= other.reflinked

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode}
        for kind in KINDS:
            out[kind] = {"files": self.files[kind], "bytes": self.bytes[kind]}
        out[COPY]["why"] = dict(self.why)
        return out


def describe(data_files: dict[str, Any]) -> str | None:
    """One line for a report: how many data files were shared and how, how many copied
    and why (None when the item has no data file of a source)."""
    if data_files.get("mode") == SERVER_SIDE:
        return "data files: server-side copies (object store)"
    parts = []
    for kind, verb in ((REFLINK, "reflinked"), (HARDLINK, "hard-linked"), (COPY, "copied")):
        d = data_files.get(kind) or {}
        if d.get("files"):
            parts.append(f"{d['files']} {verb} ({d['bytes']:,} bytes)")
    if not parts:
        return None
    why = (data_files.get(COPY) or {}).get("why") or {}
    line = "data files: " + ", ".join(parts)
    if why:
        line += "; copied because: " + "; ".join(f"{w} ({n})" for w, n in why.items())
    return line


def _why(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0, str(e.errno))
    return f"{name}: {_REASONS.get(e.errno or 0, e.strerror or 'failed')}"


def _reflink(a: str, b: str) -> None:
    """Creates ``b`` as a copy-on-write clone of ``a``; on failure nothing is left at ``b``."""
    import fcntl

    with open(a, "rb") as src:
        fd = os.open(b, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            fcntl.ioctl(fd, FICLONE, src.fileno())
        except BaseException:
            os.close(fd)
            os.unlink(b)
            raise
        os.close(fd)


class Placer:
    """Places files one at a time (`place`), remembering per pair of file systems which
    kinds of sharing failed for good, and counting into ``placed``.

    A copy is always a physical one: ``copy_file_range`` (what ``cp`` uses; in the
    kernel, no bytes through this process) only where the pair of file systems is known
    not to reflink (the kernel would clone instead, as ``cp`` does by default); else a
    ``sendfile`` copy (`shutil.copyfile`). With ``share=False`` the first file of each
    pair probes that once (a clone made and removed again).
    """

    def __init__(self, placed: Placement, *, share: bool = True):
        self.placed = placed
        self.share = share
        self._failed: dict[str, dict[tuple[int, int], str]] = {REFLINK: {}, HARDLINK: {}}
        self._reflink = sys.platform == "linux"  # FICLONE is Linux's; elsewhere: links
        self._in_kernel = hasattr(os, "copy_file_range")
        self._no_kernel_copy: set[tuple[int, int]] = set()
        self._probed: set[tuple[int, int]] = set()
        self._dirs: dict[str, int] = {}
        self._lock = threading.Lock()  # the counts, when files are copied in parallel

    def _add(self, kind: str, size: int, why: str | None = None) -> None:
        with self._lock:
            self.placed.add(kind, size, why)

    def place_all(self, pairs: Sequence[tuple[str, str]], *, workers: int = 0) -> None:
        """`place` for each ``(a, b)``. Once a file has been copied, the rest are placed by
        ``workers`` threads (default: one per core, at most 4): a copy is in the kernel
        (``copy_file_range``, ``sendfile``), which runs without the GIL, so copies overlap
        where one stream leaves the disk or the cores idle; links are placed in order."""
        workers = workers or memory.COPY.count()
        for i, (a, b) in enumerate(pairs):
            copied = self.placed.files[COPY]
            self.place(a, b)
            rest = pairs[i + 1 :]
            if self.placed.files[COPY] > copied and len(rest) > 1 and workers > 1:
                with ThreadPoolExecutor(workers, thread_name_prefix="omtl-copy") as pool:
                    results(pool.submit(self.place, *pair) for pair in rest)
                return

    def _dev(self, directory: str) -> int:
        if directory not in self._dirs:
            self._dirs[directory] = os.stat(directory).st_dev
        return self._dirs[directory]

    def _try_reflink(self, a: str, b: str, pair: tuple[int, int]) -> bool:
        if not self._reflink or pair in self._failed[REFLINK]:
            return False
        try:
            _reflink(a, b)
        except OSError as e:
            if e.errno in _FS_WIDE:
                self._failed[REFLINK][pair] = _why(e)
            return False
        return True

    def place(self, a: str, b: str) -> None:
        """``b`` becomes ``a``'s data: shared if possible, else a private copy."""
        st = os.stat(a)
        pair = (st.st_dev, self._dev(os.path.dirname(b)))
        if not self.share:
            if pair not in self._probed:  # once per pair
                self._probed.add(pair)
                if self._try_reflink(a, b, pair):
                    os.unlink(b)  # it clones: copies of this pair go through sendfile
            self.copy(a, b, st.st_size, ASKED, pair)
            return
        if self._try_reflink(a, b, pair):
            self._add(REFLINK, st.st_size)
            clone = os.stat(b)
            self.placed.reflinked.add((clone.st_dev, clone.st_ino))
            return
        why = self._failed[HARDLINK].get(pair)
        if why is None:
            try:
                os.link(a, b)
            except OSError as e:
                why = _why(e)
                if e.errno in _FS_WIDE:
                    self._failed[HARDLINK][pair] = why
            else:
                if os.stat(b).st_ino == st.st_ino:
                    self._add(HARDLINK, st.st_size)
                    return
                # Some FUSE file systems "link" by copying: a new file, not to be trusted
                # as the same bytes.
                self._add(COPY, st.st_size, COPIED_ON_LINK)
                return
        self.copy(a, b, st.st_size, why, pair)

    def copy(self, a: str, b: str, size: int, why: str, pair: tuple[int, int]) -> None:
        """A physical streaming copy (no file held in memory), counted with its reason."""
        no_clone = pair in self._failed[REFLINK] or not self._reflink
        if self._in_kernel and no_clone and pair not in self._no_kernel_copy:
            if _copy_in_kernel(a, b):
                self._add(COPY, size, why)
                return
            self._no_kernel_copy.add(pair)
        shutil.copyfile(a, b)  # sendfile on Linux
        self._add(COPY, size, why)


def _copy_in_kernel(a: str, b: str) -> bool:
    """Copies ``a`` to ``b`` with ``copy_file_range``; False if the kernel refuses it before
    any byte is copied (another file system, not supported); other errors are raised."""
    with open(a, "rb") as src, open(b, "wb") as dst:
        size, done = os.fstat(src.fileno()).st_size, 0
        while done < size:
            try:
                n = os.copy_file_range(src.fileno(), dst.fileno(), size - done)
            except OSError as e:
                if done == 0 and e.errno in _FS_WIDE:
                    return False
                raise
            if n == 0:  # the source ended early (it shrank): what is there is copied
                break
            done += n
    return True
