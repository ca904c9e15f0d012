"""The step store: how a root's step directories are committed, moved, locked and filled,
chosen once from the root's path.

A disk has rename, hard links and ``O_EXCL``; an object store (``gs://``) has none of them,
but server-side copies, conditional creates and commit markers (see `objstore`). Everything
that differs between the two lives behind one `StepStore` interface with two
implementations, `LocalStore` and `ObjectStore`; `store_for` is the one place that tells
them apart (as Orbax picks its commit strategy once per path in ``path/atomicity``). The
modules above ask the store; they never ask what kind of path they hold.

The store takes names and paths, never plans: it knows files, not leaves.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import Container, Hashable
from typing import Any

from etils import epath

from . import objstore, pagecache, placement

TooLarge = objstore.TooLarge  # `StepStore.read_file`: a file past the reader's limit
TMP_SUFFIX = ".orbax-checkpoint-tmp-"  # Orbax's marker of a directory being written
COMMIT_MARKER = objstore.COMMIT_MARKER
logger = logging.getLogger(__name__)


def alive(pid: int) -> bool:
    """Whether process ``pid`` of this host is alive."""
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


def dead(host: str | None, pid: int) -> bool:
    """Whether process ``pid`` of ``host`` (None: this host, as older releases recorded it)
    is known to be dead: only this host's processes can be checked."""
    return host in (None, socket.gethostname()) and not alive(pid)


def _marker_text() -> str:
    return f"Checkpoint successfully committed at {time.time()}."


class StepStore:
    """What a step directory's life needs from the storage under it.

    Commit: a new item is written where `new_item_dir` says, sealed, then published by
    `publish_item` (the commit point). A separate destination step is built where
    `new_step_dir` says and appears at its name by `publish_step`. Moves, removal,
    exclusive creation (the lock's primitive), listings and the placement of data files
    complete the interface.
    """

    #: A separate destination is written where it will be read (no rename to publish it),
    #: so two writers must be kept apart by a lock.
    builds_in_place: bool = False
    #: Data files can be shared with the source (reflink or hard link), so a converted
    #: item's record of them can prove it holds the legacy bytes.
    shares_files: bool = False
    #: Stored values can be read straight from their data files (`os.pread`), not only
    #: through tensorstore's kvstore (whose reads copy each value piece by piece).
    reads_files: bool = False
    #: Several processes can write disjoint byte ranges of one file (a POSIX file system
    #: the processes share), so they can split the work of one file between them.
    writes_ranges: bool = False

    # -- reading (within `read_only`, an object store asks each question once) ---------------
    def exists(self, path: epath.Path) -> bool:
        return path.exists()

    def is_dir(self, path: epath.Path) -> bool:
        return path.is_dir()

    def list_dir(self, path: epath.Path) -> list[str]:
        """The names directly under ``path``, sorted; [] where there is no such directory."""
        return sorted(p.name for p in path.iterdir()) if path.is_dir() else []

    def read_file(self, path: epath.Path, limit: int) -> bytes:
        """The bytes of the small file ``path``: `TooLarge` past ``limit`` bytes (its size
        checked before it is read; the read stops one byte past the limit, for a file that
        grew meanwhile), `FileNotFoundError` if it is missing, other `OSError`s as raised."""
        if path.stat().length <= limit:
            with path.open("rb") as fh:
                data = fh.read(limit + 1)
            if len(data) <= limit:
                return data
        raise TooLarge(f"{path}: more than {limit} bytes")

    def prefetch(self, paths: list[epath.Path], limit: int) -> None:
        """Starts reading the small files ``paths`` together, for `read_file` within
        `read_only` (an object store; a disk reads each when asked)."""

    # -- commit ---------------------------------------------------------------------------
    def item_committed(self, item: epath.Path) -> bool:
        """Whether ``item`` is a complete, committed item directory."""
        raise NotImplementedError

    def step_committed(self, step_dir: epath.Path) -> bool:
        """Whether ``step_dir`` is a finished step (not a save, move or copy in progress)."""
        raise NotImplementedError

    def new_item_dir(self, step_dir: epath.Path, name: str) -> epath.Path:
        """Where a new item ``name`` of ``step_dir`` is written before its commit."""
        raise NotImplementedError

    def seal_item(self, tmp: epath.Path) -> None:
        """What must be in a written item before the step metadata names it."""

    def publish_item(self, tmp: epath.Path, item: epath.Path) -> None:
        """The commit point: ``tmp`` becomes the committed ``item``."""
        raise NotImplementedError

    def discard(self, path: epath.Path) -> None:
        """Removes an uncommitted item or a whole tree (missing is fine)."""
        raise NotImplementedError

    def clean_uncommitted_item(self, item: epath.Path) -> None:
        """Removes what a dead writer left of ``item`` (call under the step lock)."""

    def new_step_dir(self, dest: epath.Path) -> epath.Path:
        """Where a separate destination step is built before it appears at ``dest``."""
        raise NotImplementedError

    def publish_step(self, work: epath.Path, dest: epath.Path) -> bool:
        """Makes the step built in ``work`` appear at ``dest``; False if ``dest`` appeared
        meanwhile (``work`` is then discarded)."""
        raise NotImplementedError

    def discard_step_dir(self, work: epath.Path, *, keep: str) -> None:
        """Removes an unpublished destination step (but the entry ``keep``, a lock)."""
        raise NotImplementedError

    def sweep_dead_work(self, dest: epath.Path) -> list[str]:
        """Removes the places where dead processes of this host were building ``dest``
        (`new_step_dir`: a kill before `publish_step`); the names removed."""
        return []

    def dest_taken(self, dest: epath.Path) -> bool:
        """Whether a separate destination already holds something a write must not replace."""
        raise NotImplementedError

    # -- a directory of plain files published whole (export-hf) ------------------------------
    def staging_dir(self, work: epath.Path) -> epath.Path:
        """A local directory where files bound for ``work`` are written (``work`` itself on
        a disk; a local temporary directory for an object store, removed by `put_file`'s
        caller)."""
        raise NotImplementedError

    def put_file(self, local: epath.Path, dst: epath.Path) -> None:
        """Makes the complete local file ``local`` (from `staging_dir`) appear whole at
        ``dst``, and removes ``local``."""
        raise NotImplementedError

    def publish_dir(self, work: epath.Path, dest: epath.Path, *, last: str) -> None:
        """Makes the files in ``work`` appear at ``dest`` (absent or empty), the file named
        ``last`` after all the others, and removes ``work``."""
        raise NotImplementedError

    def dir_taken(self, dest: epath.Path, *, last: str) -> bool:
        """Whether ``dest`` holds files a `publish_dir` of it must not replace: a published
        directory (``last`` is there) or files of someone else."""
        raise NotImplementedError

    # -- files ----------------------------------------------------------------------------
    def replace_file(self, path: epath.Path, text: str) -> None:
        """Replaces (or creates) the small file ``path`` atomically."""
        raise NotImplementedError

    def version(self, path: epath.Path) -> Hashable | None:
        """A token that changes whenever ``path`` is replaced; None if it does not exist."""
        raise NotImplementedError

    def absolute(self, path: epath.PathLike) -> str:
        """``path`` as recorded in provenance: absolute, so a replay works from anywhere."""
        raise NotImplementedError

    def refresh(self, path: epath.PathLike) -> None:
        """Forgets what the client cached of listings (no-op where nothing is cached)."""

    def clone_tree(self, src: epath.Path, dst: epath.Path, *, share: bool) -> placement.Placement:
        """Places every file of the item directory ``src`` under ``dst``; returns how
        (`placement.Placement`). With ``share``, on a disk, each file is shared with the
        source (a reflink where the file system supports it, else a hard link, else a copy,
        counted with its reason): safe because Orbax never modifies a data file once
        written and the clone is only ever read; otherwise each file is a private copy. On
        an object store every object is copied server-side."""
        raise NotImplementedError

    def drop_written(self, folder: epath.Path) -> contextlib.AbstractContextManager:
        """A context in which the files written into ``folder`` leave the local page cache
        once on the disk (`pagecache.dropping`); an object store has none to leave."""
        return contextlib.nullcontext()

    def disk_usage(
        self, path: epath.Path, *, new_only: bool = False, shared: Container = ()
    ) -> int:
        """Bytes under ``path``; ``new_only`` skips files shared with others."""
        raise NotImplementedError

    def is_outside(self, root: epath.Path, path: epath.Path) -> bool:
        """Whether ``path`` reached through a symbolic link leads outside ``root``."""
        return False

    # -- moves and removal ----------------------------------------------------------------
    def relocate_step(self, src: epath.Path, dst: epath.Path, *, keep: str) -> None:
        """Moves the committed step directory ``src`` to its sibling ``dst`` (``keep``, this
        process's lock inside ``src``, is not carried along)."""
        raise NotImplementedError

    def relocation_in_progress(self, step_dir: epath.Path) -> bool:
        """Whether a killed move into ``step_dir`` waits to be finished or rolled back."""
        return False

    def finish_relocation(self, step_dir: epath.Path) -> str | None:
        """Completes or rolls back a killed move into ``step_dir``; what was done, or None."""
        return None

    def finish_relocations(self, folder: epath.Path) -> list[str]:
        """`finish_relocation` for every step directory directly in ``folder``."""
        return []

    def clear_for_move(self, dst: epath.Path) -> None:
        """Makes the free name ``dst`` ready to receive a move (debris of a dead client)."""

    def set_aside(self, item: epath.Path, marker: epath.Path) -> None:
        """Starts deleting ``item``: after this it no longer reads as an item, and
        `finish_set_aside` with the same ``marker`` deletes the rest."""
        raise NotImplementedError

    def finish_set_aside(self, marker: epath.Path, item: epath.Path) -> None:
        """Deletes what `set_aside` left of ``item`` and its ``marker``."""
        raise NotImplementedError

    # -- the lock's primitives ------------------------------------------------------------
    def create_exclusive(self, path: epath.Path, owner: dict[str, Any]) -> bool:
        """Creates ``path`` holding ``owner`` (JSON) only if it does not exist; False if it
        does. Never leaves ``path`` existing without its content."""
        raise NotImplementedError

    def read_owner(self, path: epath.Path) -> dict[str, Any] | None:
        """The owner recorded in the lock file ``path``; None if there is none; ``{}`` if
        it is unreadable."""
        raise NotImplementedError

    def remove(self, path: epath.Path) -> None:
        """Deletes the file ``path`` (missing is fine)."""
        raise NotImplementedError

    def sweep_lock_files(self, folder: epath.Path, name: str, dead: Any) -> None:
        """Removes the private files a killed `create_exclusive` of lock ``name`` left in
        ``folder``; ``dead(host, pid)`` tells whether their creator died."""

    def release_moved_lock(self, step_dir: epath.Path, name: str, pid: int) -> None:
        """Removes process ``pid``'s lock ``name`` that a move carried into ``step_dir``."""


def _remove_work_dir(path: str) -> bool:
    """Removes the dead run's work directory ``path``; True once gone. Anything else of that
    name in a shared folder (a symlink planted there, a file) is left as it is, never
    followed, with a warning naming it: ``shutil.rmtree`` walks by descriptors and refuses a
    link at the top, so a directory swapped for a link meanwhile is left too."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
            return True
        what = "a symlink" if os.path.islink(path) else "not a directory"
    except FileNotFoundError:
        return True
    except OSError as e:
        what = f"cannot be removed ({e.strerror or e})"
    logger.warning(
        "%s: named like a dead run's work directory, but %s: left as it is (never "
        "followed); remove it if it is no one's",
        path,
        what,
    )
    return False


class LocalStore(StepStore):
    """A POSIX file system: rename is the commit point; data files are shared."""

    shares_files = True
    reads_files = True
    writes_ranges = True

    def item_committed(self, item: epath.Path) -> bool:
        return item.is_dir()  # it appears whole, by a rename

    def step_committed(self, step_dir: epath.Path) -> bool:
        return True  # a step directory appears whole (Orbax renames it into place)

    def new_item_dir(self, step_dir: epath.Path, name: str) -> epath.Path:
        tmp = step_dir / f"{name}{TMP_SUFFIX}{uuid.uuid4().hex[:12]}"
        tmp.mkdir(parents=False)
        return tmp

    def seal_item(self, tmp: epath.Path) -> None:
        (tmp / COMMIT_MARKER).write_text(_marker_text())

    def publish_item(self, tmp: epath.Path, item: epath.Path) -> None:
        tmp.rename(item)

    def discard(self, path: epath.Path) -> None:
        path.rmtree(missing_ok=True)

    def new_step_dir(self, dest: epath.Path) -> epath.Path:
        # Named by its builder (parsed back by `sweep_dead_work`), so a killed build is
        # recognised as dead and removed by the next one.
        dest.parent.mkdir(parents=True, exist_ok=True)
        who = f"{uuid.uuid4().hex[:12]}.{socket.gethostname()}.{os.getpid()}"
        work = dest.parent / f"{dest.name}{TMP_SUFFIX}{who}"
        work.mkdir()
        return work

    def sweep_dead_work(self, dest: epath.Path) -> list[str]:
        prefix, removed = f"{dest.name}{TMP_SUFFIX}", []
        try:
            children = os.listdir(str(dest.parent))
        except OSError:
            return removed
        for child in children:
            host, _, pid = child.removeprefix(prefix)[13:].rpartition(".")
            if child.startswith(prefix) and host and pid.isdigit() and dead(host, int(pid)):
                if _remove_work_dir(os.path.join(str(dest.parent), child)):
                    removed.append(child)
        return removed

    def publish_step(self, work: epath.Path, dest: epath.Path) -> bool:
        (work / COMMIT_MARKER).write_text(_marker_text())
        try:
            os.rename(str(work), str(dest))  # refuses a non-empty existing directory
        except OSError:
            if not dest.exists():
                raise
            work.rmtree(missing_ok=True)
            return False
        return True

    def discard_step_dir(self, work: epath.Path, *, keep: str) -> None:
        work.rmtree(missing_ok=True)  # a temporary sibling: no one else's lock inside

    def dest_taken(self, dest: epath.Path) -> bool:
        return dest.exists() and any(dest.iterdir())

    def staging_dir(self, work: epath.Path) -> epath.Path:
        return work

    def put_file(self, local: epath.Path, dst: epath.Path) -> None:
        if str(local) != str(dst):
            os.replace(str(local), str(dst))  # the same directory: a rename

    def publish_dir(self, work: epath.Path, dest: epath.Path, *, last: str) -> None:
        if dest.exists():
            dest.rmdir()  # empty (`dir_taken`): a rename replaces only an empty directory
        os.rename(str(work), str(dest))  # every file appears at once

    def dir_taken(self, dest: epath.Path, *, last: str) -> bool:
        return dest.exists() and any(dest.iterdir())

    def replace_file(self, path: epath.Path, text: str) -> None:
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # e.g. a full disk: leave nothing behind
            raise

    def version(self, path: epath.Path) -> Hashable | None:
        try:
            st = os.stat(str(path))
        except FileNotFoundError:
            return None
        # A replace makes a new inode; the times tell a reused inode number apart.
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def absolute(self, path: epath.PathLike) -> str:
        return os.path.abspath(str(path))

    def drop_written(self, folder: epath.Path) -> contextlib.AbstractContextManager:
        return pagecache.dropping(folder)

    def clone_tree(self, src: epath.Path, dst: epath.Path, *, share: bool) -> placement.Placement:
        placed = placement.Placement(mode=placement.SHARE_MODE if share else placement.COPY_MODE)
        pairs = []
        for root, _, files in os.walk(str(src)):
            rel = os.path.relpath(root, str(src))
            out = os.path.normpath(os.path.join(str(dst), rel))
            os.makedirs(out, exist_ok=True)
            pairs += [(os.path.join(root, f), os.path.join(out, f)) for f in files]
        placement.Placer(placed, share=share).place_all(pairs)
        return placed

    def disk_usage(
        self, path: epath.Path, *, new_only: bool = False, shared: Container = ()
    ) -> int:
        total = 0
        for root, _, files in os.walk(str(path)):
            for f in files:
                st = os.stat(os.path.join(root, f))
                new = st.st_nlink == 1 and (st.st_dev, st.st_ino) not in shared
                total += st.st_size if not new_only or new else 0
        return total

    def is_outside(self, root: epath.Path, path: epath.Path) -> bool:
        real_root = os.path.realpath(str(root))
        real = os.path.realpath(str(path))
        return real != real_root and not real.startswith(real_root + os.sep)

    def relocate_step(self, src: epath.Path, dst: epath.Path, *, keep: str) -> None:
        src.rename(dst)  # atomic; ``keep`` moves along (`release_moved_lock`)

    def set_aside(self, item: epath.Path, marker: epath.Path) -> None:
        if os.path.islink(str(item)):
            os.unlink(str(item))  # the link only; its target is outside this step
        else:
            item.rename(marker)

    def finish_set_aside(self, marker: epath.Path, item: epath.Path) -> None:
        marker.rmtree()

    def create_exclusive(self, path: epath.Path, owner: dict[str, Any]) -> bool:
        # The owner goes to a private file that is then hard-linked to the lock name, so
        # the lock never exists empty (a kill or a full disk between creating and writing
        # it would otherwise leave a lock no one owns). Its name is parsed back by
        # `sweep_lock_files`.
        tmp = f"{path}.{owner['host']}.{owner['pid']}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(owner, f)
            os.link(tmp, str(path))
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return True

    def read_owner(self, path: epath.Path) -> dict[str, Any] | None:
        if not os.path.exists(str(path)):
            return None
        try:
            with open(str(path)) as f:
                owner = json.loads(f.read() or "{}")
        except (OSError, ValueError):
            return {}
        return owner if isinstance(owner, dict) else {}

    def remove(self, path: epath.Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(str(path))

    def sweep_lock_files(self, folder: epath.Path, name: str, dead: Any) -> None:
        # ``<lock>.<host>.<pid>.tmp``; older releases named it ``<lock>.<pid>.tmp`` (no host).
        try:
            children = os.listdir(str(folder))
        except OSError:
            return
        for child in children:
            if not (child.startswith(name + ".") and child.endswith(".tmp")):
                continue
            host, _, pid = child[len(name) + 1 : -len(".tmp")].rpartition(".")
            if pid.isdigit() and dead(host or None, int(pid)):
                self.remove(folder / child)

    def release_moved_lock(self, step_dir: epath.Path, name: str, pid: int) -> None:
        if (self.read_owner(step_dir / name) or {}).get("pid") == pid:
            self.remove(step_dir / name)


class ObjectStore(StepStore):
    """An object store (``gs://``): no rename, so commit markers written last, ordered
    server-side copies for moves, and conditional creates for the lock (see `objstore`)."""

    builds_in_place = True

    def exists(self, path: epath.Path) -> bool:
        return objstore.exists(path)

    def is_dir(self, path: epath.Path) -> bool:
        return objstore.is_dir(path)

    def list_dir(self, path: epath.Path) -> list[str]:
        return objstore.list_dir(path)

    def read_file(self, path: epath.Path, limit: int) -> bytes:
        return objstore.read_file(path, limit)

    def prefetch(self, paths: list[epath.Path], limit: int) -> None:
        objstore.prefetch(paths, limit)

    def item_committed(self, item: epath.Path) -> bool:
        # Written in place: it exists, incomplete, until its commit marker (its last object).
        return objstore.exists(item / COMMIT_MARKER)

    def step_committed(self, step_dir: epath.Path) -> bool:
        return objstore.exists(step_dir / COMMIT_MARKER)  # as for Orbax

    def new_item_dir(self, step_dir: epath.Path, name: str) -> epath.Path:
        item = step_dir / name
        objstore.remove_tree(item)  # an incomplete item of a dead run (under the lock)
        return item

    def publish_item(self, tmp: epath.Path, item: epath.Path) -> None:
        (tmp / COMMIT_MARKER).write_text(_marker_text())
        objstore.refresh(tmp.parent)

    def discard(self, path: epath.Path) -> None:
        objstore.remove_tree(path)

    def clean_uncommitted_item(self, item: epath.Path) -> None:
        if not self.item_committed(item):
            objstore.remove_tree(item)  # written in place by a dead run, never committed

    def new_step_dir(self, dest: epath.Path) -> epath.Path:
        return dest  # listed only once its commit marker exists (`publish_step`)

    def publish_step(self, work: epath.Path, dest: epath.Path) -> bool:
        (work / COMMIT_MARKER).write_text(_marker_text())
        objstore.refresh(dest)
        return True

    def discard_step_dir(self, work: epath.Path, *, keep: str) -> None:
        for child in work.iterdir():  # all but the lock, which its holder removes
            if child.name != keep:
                objstore.remove_tree(child) if child.is_dir() else child.unlink(missing_ok=True)

    def dest_taken(self, dest: epath.Path) -> bool:
        return self.step_committed(dest)

    def staging_dir(self, work: epath.Path) -> epath.Path:
        return epath.Path(tempfile.mkdtemp(prefix="orbax-maxtext-layout-staging-"))

    def put_file(self, local: epath.Path, dst: epath.Path) -> None:
        objstore.upload(local, dst)  # one object, whole once its upload completes
        local.unlink()

    def publish_dir(self, work: epath.Path, dest: epath.Path, *, last: str) -> None:
        # No rename: server-side copies, ``last`` after the others (a reader of the
        # directory starts from it), then the work objects go. A copy cut short leaves
        # ``dest`` without ``last``, and the work objects for a rerun to publish again.
        objstore.copy_tree(work, dest, skip=(last,))
        objstore.copy_tree(work, dest, only=(last,))
        objstore.remove_tree(work)

    def dir_taken(self, dest: epath.Path, *, last: str) -> bool:
        objstore.refresh(dest)
        if (dest / last).exists():
            return True
        work = dest.parent / f"{dest.name}{EXPORT_WORK_SUFFIX}"
        # Files without ``last`` beside a work directory: a publish cut short, redone.
        return dest.exists() and any(dest.iterdir()) and not work.exists()

    def replace_file(self, path: epath.Path, text: str) -> None:
        path.write_text(text)  # one object write replaces it atomically
        objstore.refresh(path)

    def version(self, path: epath.Path) -> Hashable | None:
        return objstore.generation(path)

    def absolute(self, path: epath.PathLike) -> str:
        return str(path)

    def refresh(self, path: epath.PathLike) -> None:
        objstore.refresh(path)

    def clone_tree(self, src: epath.Path, dst: epath.Path, *, share: bool) -> placement.Placement:
        objstore.copy_tree(src, dst)  # server-side copies: no data through the client
        return placement.Placement(mode=placement.SERVER_SIDE)

    def disk_usage(
        self, path: epath.Path, *, new_only: bool = False, shared: Container = ()
    ) -> int:
        # walks with iterdir: epath forbids recursive globs on GCS
        return sum(
            self.disk_usage(c) if c.is_dir() else c.stat().length
            for c in epath.Path(path).iterdir()
        )

    def relocate_step(self, src: epath.Path, dst: epath.Path, *, keep: str) -> None:
        objstore.move_dir(src, dst, skip=(keep,))  # copies, markers ordered

    def relocation_in_progress(self, step_dir: epath.Path) -> bool:
        return (step_dir / objstore.MOVING).exists()

    def finish_relocation(self, step_dir: epath.Path) -> str | None:
        return objstore.finish_move(step_dir)

    def finish_relocations(self, folder: epath.Path) -> list[str]:
        return objstore.finish_moves(folder)

    def clear_for_move(self, dst: epath.Path) -> None:
        objstore.finish_move(dst)  # a killed move into it
        if not self.step_committed(dst):
            objstore.remove_tree(dst)  # what a dead client's requests left

    def set_aside(self, item: epath.Path, marker: epath.Path) -> None:
        marker.write_text("")  # no rename: a marker says the deletion has begun

    def finish_set_aside(self, marker: epath.Path, item: epath.Path) -> None:
        objstore.remove_tree(item)
        marker.unlink()
        objstore.refresh(marker.parent)

    def create_exclusive(self, path: epath.Path, owner: dict[str, Any]) -> bool:
        # A conditional write (create only if absent), not check-then-write.
        return objstore.write_exclusive(path, json.dumps(owner).encode())

    def read_owner(self, path: epath.Path) -> dict[str, Any] | None:
        if not path.exists():
            return None
        owner: Any = {}
        with contextlib.suppress(Exception):
            owner = json.loads(path.read_text() or "{}")
        return owner if isinstance(owner, dict) else {}

    def remove(self, path: epath.Path) -> None:
        path.unlink(missing_ok=True)
        objstore.refresh(path)


_LOCAL, _OBJECT = LocalStore(), ObjectStore()


EXPORT_WORK_SUFFIX = ".export-hf-tmp"  # where export-hf builds <out>, beside it


def read_only() -> contextlib.AbstractContextManager:
    """A context for an operation that writes nothing (a restore), whatever its stores: on an
    object store each existence check, listing and small file read within it is asked once
    (`objstore.read_only`); on a disk, where each costs a system call, nothing is kept."""
    return objstore.read_only()


def store_for(path: epath.PathLike) -> StepStore:
    """The store of ``path``'s root: `ObjectStore` for a URL (``gs://``), else `LocalStore`.

    The one place that tells the two apart; the stores hold no state, so one of each
    serves every root."""
    return _OBJECT if objstore.is_remote(path) else _LOCAL


def read_only_error(e: OSError) -> bool:
    """Whether ``e`` says the file system refuses writes (the step is read-only)."""
    return e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
