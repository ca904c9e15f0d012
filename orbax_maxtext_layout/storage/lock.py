"""A per-step lock, so two converters never work on the same step at once."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

from etils import epath

from ..errors import ReadOnlyStepError, StepLocked
from .store import StepStore, alive, dead, read_only_error

LOCK_NAME = ".orbax-maxtext-layout.lock"
# Held on a directory of steps while one of them is renumbered (a short critical section).
RENUMBER_LOCK_NAME = ".orbax-maxtext-layout.renumber.lock"


@contextlib.contextmanager
def step_lock(
    step_dir: epath.Path, *, store: StepStore, name: str = LOCK_NAME, wait: float = 0.0
) -> Iterator[None]:
    """Holds ``<step>/.orbax-maxtext-layout.lock`` (an exclusive create, owner pid and host
    inside: ``O_EXCL`` on a disk, a conditional write on an object store).

    A lock left by a dead process on this host (a SIGKILLed converter) is broken;
    a live owner's lock raises `StepLocked`, and the caller skips the step, unless
    ``wait`` seconds (for a short critical section such as a renumbering) are given
    to wait for it. ``name`` is the lock file's name; ``store``, the store of the step's root
    (`store.store_for`, decided by the caller's entry point).
    """
    step_dir = epath.Path(step_dir)
    path = step_dir / name
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    deadline = time.monotonic() + wait
    tries = 0
    while not _create(store, path, me, step_dir):
        owner = store.read_owner(path) or {}
        if _stale(owner) and tries < 1:
            tries += 1
            store.remove(path)  # stale: its owner died mid-conversion
            continue
        if time.monotonic() < deadline:
            time.sleep(0.02)
            continue
        raise StepLocked(
            f"{step_dir}: being converted by pid {owner.get('pid')} on {owner.get('host')}"
        )
    store.sweep_lock_files(step_dir, name, dead)
    try:
        yield
    finally:
        store.remove(path)


def _create(store: StepStore, path: epath.Path, me: dict, step_dir: epath.Path) -> bool:
    """Creates the lock with its owner already inside; False if it already exists."""
    try:
        return store.create_exclusive(path, me)
    except OSError as e:
        if read_only_error(e):
            raise ReadOnlyStepError(
                f"{step_dir}: read-only ({e.strerror}); nothing was written. Convert to a "
                "separate destination instead (out= / --out DIR)."
            ) from e
        raise


def _stale(owner: dict) -> bool:
    """A lock to break: its owner died on this host, or it names no owner at all.

    Locks are created with their owner inside, so an owner-less lock is damage and
    cannot be anyone's to wait for.
    """
    if not owner.get("pid"):
        return True
    return owner.get("host") == socket.gethostname() and not alive(owner["pid"])


def holder(step_dir: epath.Path, *, store: StepStore, name: str = LOCK_NAME) -> str | None:
    """Who holds the lock of ``step_dir`` (a live owner), or None: the lock is free, or
    its owner died (`step_lock` would break it). Reads the lock file only."""
    owner = store.read_owner(epath.Path(step_dir) / name)
    if owner is None or _stale(owner):
        return None
    return f"{step_dir}: being converted by pid {owner.get('pid')} on {owner.get('host')}"


def break_stale_lock(step_dir: epath.Path, *, store: StepStore) -> bool:
    """Removes a lock whose owner died on this host (or that has no owner), and the private
    files of dead lockers; True if the lock was removed."""
    step_dir = epath.Path(step_dir)
    path = step_dir / LOCK_NAME
    store.sweep_lock_files(step_dir, LOCK_NAME, dead)
    owner = store.read_owner(path)
    if owner is None or not _stale(owner):
        return False
    store.remove(path)
    return True


def release_moved_lock(step_dir: epath.Path, *, store: StepStore) -> None:
    """Removes this process's lock that moved with a renamed step directory.

    A step is renumbered by renaming its directory while holding its lock; the lock
    file moves along, and `step_lock` then finds nothing to remove at the old path.
    """
    store.release_moved_lock(epath.Path(step_dir), LOCK_NAME, os.getpid())
