"""The one rule for paths a checkpoint names itself: they stay inside it.

An OCDBT database names its data files in its manifest and B-tree nodes as (base path,
relative path) strings, and the format allows any relative path. Tensorstore's file
kvstore refuses a key that is absolute or has an empty, ``.`` or ``..`` component
("Invalid key"), so stock Orbax never reads outside an item. Everything in this package
that opens a file or an object by a name taken from a checkpoint's own bytes checks the
name here first, with that same rule, on a disk and on ``gs://`` alike (an object store
has no ``..``, but a name that means "outside" on a disk is refused everywhere, so a
checkpoint reads the same wherever it lies). Symlinks inside a checkpoint are followed,
as stock follows them.

`open_beneath` opens a file a directory names (a Hugging Face directory's shards) by a walk
from the directory's descriptor, one component at a time with ``O_NOFOLLOW``, each symlink
read and walked by the walk itself: resolving a path and then opening it by name leaves a
window in which an intermediate folder swapped for a link leads the open outside
(``O_NOFOLLOW`` guards only the last component). A pure ``openat`` walk, not ``openat2``'s
``RESOLVE_BENEATH``: it holds on every kernel (gVisor included), and the walk must see each
link anyway, to end only where the caller allows.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

from ..errors import CheckpointReadError

LEAVES = "data file path leaves the checkpoint"


def escape(rel: str) -> str | None:
    """Why ``rel`` (a path relative to a checkpoint's item, ``/``-separated) would leave
    it, or None when it stays inside: tensorstore's file kvstore's rule for keys."""
    if not rel:
        return "an empty path"
    if "\0" in rel:
        return "a NUL byte"
    if rel.startswith("/"):
        return "an absolute path"
    for part in rel.split("/"):
        if not part:
            return "an empty component"
        if part in (".", ".."):
            return f"a {part!r} component"
    return None


def check_inside(item: object, key: str, rel: str) -> str:
    """``rel`` unchanged when it stays inside ``item``; else a `CheckpointReadError`
    naming the item, the key that names it, and the path. Call before opening anything."""
    why = escape(rel)
    if why is not None:
        raise CheckpointReadError(
            f"{item}: {key}: {LEAVES}: {rel!r} ({why}). Nothing outside the checkpoint is "
            "read, and nothing was written; the checkpoint is damaged or crafted."
        )
    return rel


# -- opening a file beneath a directory, one component at a time -------------------------
MAX_LINKS = 40  # the kernel's own limit of symlinks followed in one path (MAXSYMLINKS)
# Directories are walked without being read (O_PATH: search permission is enough).
_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LinkLeaves(Exception):
    """A path whose symlinks lead outside the directory it is opened beneath (or to a
    place there a walk may not end). ``target``: where it leads (an absolute path, shown
    to say where, never opened); ``link``: the symlink that leads there."""

    def __init__(self, target: str, link: str) -> None:
        super().__init__(f"{link} leads to {target}")
        self.target, self.link = target, link


def open_beneath(
    top: int,
    top_path: str,
    rel: str,
    allowed: Callable[[tuple[str, ...]], bool] = lambda parts: True,
) -> int:
    """A descriptor of the file ``rel`` (a ``/``-separated path) opened beneath the
    directory ``top`` (a descriptor of it; ``top_path``, its real path, names places in
    errors), read-only and never blocking (a FIFO opens at once), walked one component at
    a time: each directory opened from its parent's descriptor with ``O_NOFOLLOW``, so
    nothing swapped in between a check and an open is ever followed.

    A symlink met on the way is read and its target walked the same way from the
    directory it lies in (an absolute target only when it names a place beneath
    ``top_path``). A target that would leave ``top`` is `LinkLeaves`, nothing opened
    outside; so is a file whose directory (its components from ``top``) ``allowed``
    refuses. Raises `OSError` as ``open`` would: ``FileNotFoundError``, ``ELOOP`` past
    `MAX_LINKS` links (a loop), ``ENOTDIR``, ``EISDIR`` for a path naming ``top``."""
    fds: list[int] = []  # the directories walked, ``top``'s child first
    at: list[str] = []  # their names: where the walk stands beneath ``top``
    todo, links, via = _parts(rel), 0, ""
    try:
        while todo:
            name = todo.pop(0)
            if name == "..":  # only from a link's target: the real parent of where it lies
                if not at:
                    raise LinkLeaves(_shown(top_path, at, [name, *todo]), via)
                at.pop()
                os.close(fds.pop())
                continue
            last, parent = not todo, fds[-1] if fds else top
            try:
                fd = os.open(name, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=parent)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR) or not _is_link(name, parent):
                    raise
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), rel) from None
                via = _shown(top_path, at, [name])
                todo[:0] = _follow(top_path, at, fds, name=name, parent=parent, todo=todo, link=via)
                continue
            if not last:
                fds.append(fd)
                at.append(name)
            elif allowed(tuple(at)):
                return fd
            else:  # a place beneath ``top`` a walk may not end: nothing read from it
                os.close(fd)
                raise LinkLeaves(_shown(top_path, at, [name]), via)
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), rel)
    finally:
        for fd in fds:
            os.close(fd)


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _is_link(name: str, parent: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _follow(
    top_path: str,
    at: list[str],
    fds: list[int],
    *,
    name: str,
    parent: int,
    todo: list[str],
    link: str,
) -> list[str]:
    """The components symlink ``name`` (``link``, in the directory ``parent``, where ``at``
    stands) stands for, walked next; an absolute target restarts the walk at ``top``
    (``at`` and ``fds`` emptied), or is `LinkLeaves` when it names no place beneath
    ``top_path``."""
    try:
        target = os.readlink(name, dir_fd=parent)
    except OSError:  # swapped back meanwhile: the name is walked again
        return [name]
    if not target.startswith("/"):
        return _parts(target)
    top = top_path.rstrip("/")
    if target != top and not target.startswith(top + "/"):
        raise LinkLeaves(_shown(target, [], todo), link)
    while fds:
        os.close(fds.pop())
    at.clear()
    return _parts(target[len(top) :])


def _shown(base: str, at: list[str], rest: list[str]) -> str:
    """Where a walk at ``at`` beneath ``base``, with ``rest`` to go, leads (normalized)."""
    return os.path.normpath(os.path.join(base, *at, *rest))
