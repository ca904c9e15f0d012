"""A per-step lock, so two converters never work on the same step at once."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator

from etils import epath

from . import objstore
from .errors import ReadOnlyStepError, StepLocked

LOCK_NAME = ".orbax-maxtext-layout.lock"
# Held on a directory of steps while one of them is renumbered (a short critical section).
RENUMBER_LOCK_NAME = ".orbax-maxtext-layout.renumber.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


@contextlib.contextmanager
def step_lock(step_dir: epath.Path, *, name: str = LOCK_NAME, wait: float = 0.0) -> Iterator[None]:
    """Holds ``<step>/.orbax-maxtext-layout.lock`` (O_EXCL create, owner pid and host inside).

    A lock left by a dead process on this host (a SIGKILLed converter) is broken;
    a live owner's lock raises `StepLocked`, and the caller skips the step, unless
    ``wait`` seconds (for a short critical section such as a renumbering) are given
    to wait for it. ``name`` is the lock file's name.
    """
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    if objstore.is_remote(step_dir):
        yield from _object_store_lock(epath.Path(step_dir) / name, me)
        return
    path = os.path.join(str(step_dir), name)
    deadline = time.monotonic() + wait
    tries = 0
    while True:
        if _create(path, me, step_dir):
            break
        owner = _owner(path)
        if _stale(owner) and tries < 1:
            tries += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # stale: its owner died mid-conversion
            continue
        if time.monotonic() < deadline:
            time.sleep(0.02)
            continue
        raise StepLocked(
            f"{step_dir}: being converted by pid {owner.get('pid')} on {owner.get('host')}"
        )
    _sweep_tmps(str(step_dir), name)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _sweep_tmps(folder: str, name: str) -> None:
    """Removes the private files of `_create` (``<lock>.<host>.<pid>.tmp``) whose creator
    died on this host: a kill between writing one and linking it to the lock name leaves
    it behind. Older releases named it ``<lock>.<pid>.tmp`` (no host); those are removed
    when that pid is dead here. A live creator's file is left alone."""
    here = socket.gethostname()
    try:
        children = os.listdir(folder)
    except OSError:
        return
    for child in children:
        if not (child.startswith(name + ".") and child.endswith(".tmp")):
            continue
        host, _, pid = child[len(name) + 1 : -len(".tmp")].rpartition(".")
        if not pid.isdigit() or (host and host != here) or _alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, child))


def _create(path: str, me: dict, step_dir: epath.Path) -> bool:
    """Creates the lock with its owner already inside; False if it already exists.

    The owner is written to a private file that is then hard-linked to the lock
    name, so the lock never exists empty (a kill or a full disk between creating
    and writing it would otherwise leave a lock no one owns).
    """
    tmp = f"{path}.{me['host']}.{me['pid']}.tmp"  # parsed back by `_sweep_tmps`
    try:
        with open(tmp, "w") as f:
            json.dump(me, f)
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise ReadOnlyStepError(
                f"{step_dir}: read-only ({e.strerror}); nothing was written. Convert to a "
                "separate destination instead (out= / --out DIR)."
            ) from e
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return True


def _stale(owner: dict) -> bool:
    """A lock to break: its owner died on this host, or it names no owner at all.

    Locks are created with their owner inside, so an owner-less lock is damage and
    cannot be anyone's to wait for.
    """
    if not owner.get("pid"):
        return True
    return owner.get("host") == socket.gethostname() and not _alive(owner["pid"])


def _owner(path: str) -> dict:
    try:
        with open(path) as f:
            owner = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _object_store_lock(path: epath.Path, me: dict) -> Iterator[None]:
    # No O_EXCL on an object store: a conditional write (create only if absent) instead.
    data = json.dumps(me).encode()
    if not objstore.write_exclusive(path, data):
        owner = _remote_owner(path)
        if not _stale(owner):
            raise StepLocked(f"{path.parent}: being converted by {owner}")
        path.unlink(missing_ok=True)  # a dead owner's lock (this host) or an empty one
        if not objstore.write_exclusive(path, data):
            raise StepLocked(f"{path.parent}: lock contended")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        objstore.refresh(path)


def _remote_owner(path: epath.Path) -> dict:
    owner = {}
    with contextlib.suppress(Exception):
        owner = json.loads(path.read_text() or "{}")
    return owner if isinstance(owner, dict) else {}


def holder(step_dir: epath.Path, *, name: str = LOCK_NAME) -> str | None:
    """Who holds the lock of ``step_dir`` (a live owner), or None: the lock is free, or
    its owner died (`step_lock` would break it). Reads the lock file only."""
    if objstore.is_remote(step_dir):
        path = epath.Path(step_dir) / name
        if not path.exists():
            return None
        owner = _remote_owner(path)
    else:
        path = os.path.join(str(step_dir), name)
        if not os.path.exists(path):
            return None
        owner = _owner(path)
    if _stale(owner):
        return None
    return f"{step_dir}: being converted by pid {owner.get('pid')} on {owner.get('host')}"


def break_stale_lock(step_dir: epath.Path) -> bool:
    """Removes a lock whose owner died on this host (or that has no owner); True if removed."""
    if objstore.is_remote(step_dir):
        lock = epath.Path(step_dir) / LOCK_NAME
        if not lock.exists() or not _stale(_remote_owner(lock)):
            return False
        lock.unlink(missing_ok=True)
        objstore.refresh(lock)
        return True
    _sweep_tmps(str(step_dir), LOCK_NAME)
    path = os.path.join(str(step_dir), LOCK_NAME)
    if not os.path.exists(path):
        return False
    if _stale(_owner(path)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
    return False


def release_moved_lock(step_dir: epath.Path) -> None:
    """Removes this process's lock that moved with a renamed step directory.

    A step is renumbered by renaming its directory while holding its lock; the lock
    file moves along, and `step_lock` then finds nothing to remove at the old path.
    """
    path = os.path.join(str(step_dir), LOCK_NAME)
    if not objstore.is_remote(step_dir) and _owner(path).get("pid") == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
