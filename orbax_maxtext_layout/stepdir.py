"""A step directory as a unit of work: temporary item, atomic commit, step metadata, removal.

Everything that changes a step directory's entries lives here (the lock is in
`lock`): the Orbax-style temporary directory for a new ``items``, the single
commit point, the step's ``_CHECKPOINT_METADATA`` replaced atomically, and the
legacy items removed only once the new ``items`` verifies.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Container

import orbax.checkpoint as ocp
from etils import epath

from . import objstore, sharing, tskv
from .errors import OrbaxMaxTextLayoutError, StepExistsError
from .layout import (
    MAXTEXT_ITEM,
    PROVENANCE_KEY,
    STEP_METADATA,
    TUNIX_OPT_ITEM,
    TUNIX_PARAMS_ITEM,
    Layout,
    detect_layout,
    read_provenance,
    read_step_metadata,
    tunix_step_number,
    with_tunix_step,
)
from .lock import LOCK_NAME, release_moved_lock, step_lock
from .verify import verify_step

TMP_SUFFIX = ".orbax-checkpoint-tmp-"  # the marker Orbax and `find_steps` skip
REMOVING = ".orbax-maxtext-layout-removing"  # a verified legacy item being deleted


def new_tmp_dir(step_dir: epath.Path) -> epath.Path:
    """Where a new ``items`` is written before its commit.

    On a disk: an Orbax-style temporary directory (ignored by readers and `find_steps`),
    renamed at the commit. On an object store (no rename): ``items/`` itself, written in
    place; it counts as written only once its commit marker exists (`commit`).
    """
    if objstore.is_remote(step_dir):
        items = step_dir / MAXTEXT_ITEM
        objstore.remove_tree(items)  # an incomplete items/ of a dead run (under the lock)
        return items
    tmp = step_dir / f"{MAXTEXT_ITEM}{TMP_SUFFIX}{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=False)
    return tmp


def discard(tmp: epath.Path) -> None:
    """Removes an uncommitted ``items`` (after a failure)."""
    if objstore.is_remote(tmp):
        objstore.remove_tree(tmp)
    else:
        tmp.rmtree(missing_ok=True)


def _marker_text() -> str:
    return f"Checkpoint successfully committed at {time.time()}."


def commit(step_dir: epath.Path, tmp: epath.Path, provenance: dict) -> None:
    """The single commit point of a new ``items``, with the provenance in step metadata.

    On a disk: ``commit_success.txt`` into ``tmp``, the provenance into the step
    metadata, then one rename of ``tmp`` to ``items`` (a crash before it leaves only an
    ignored temporary directory; the metadata is rolled back if the rename fails). On an
    object store: the step metadata, then ``items/commit_success.txt``, the last object:
    until it exists the item is incomplete (`layout.detect_layout`), and stock Orbax reads
    nothing missing (``_METADATA`` was written after the files it relies on).
    """
    old_meta = read_step_metadata(step_dir)
    if objstore.is_remote(step_dir):
        _write_step_metadata(step_dir, old_meta, provenance)
        try:
            (tmp / objstore.COMMIT_MARKER).write_text(_marker_text())
        except BaseException:
            _restore_step_metadata(step_dir, old_meta)
            raise
        objstore.refresh(step_dir)
        return
    (tmp / objstore.COMMIT_MARKER).write_text(_marker_text())
    _write_step_metadata(step_dir, old_meta, provenance)
    try:
        tmp.rename(step_dir / MAXTEXT_ITEM)
    except BaseException:
        _restore_step_metadata(step_dir, old_meta)
        raise


def _write_step_metadata(step_dir: epath.Path, old: dict, provenance: dict) -> None:
    meta = dict(old) or {"item_handlers": {}, "metrics": {}, "performance_metrics": {}}
    handlers = dict(meta.get("item_handlers") or {})
    handlers[MAXTEXT_ITEM] = ocp.PyTreeCheckpointHandler.typestr()
    meta["item_handlers"] = handlers
    custom = dict(meta.get("custom_metadata") or {})
    custom[PROVENANCE_KEY] = provenance
    meta["custom_metadata"] = custom
    _replace_json(step_dir / STEP_METADATA, meta)


def update_step_metadata(step_dir: epath.Path, change: Callable[[dict], dict]) -> None:
    """Replaces the step's ``_CHECKPOINT_METADATA`` with ``change(current)``, atomically."""
    _replace_json(step_dir / STEP_METADATA, change(read_step_metadata(step_dir)))


def _restore_step_metadata(step_dir: epath.Path, old: dict) -> None:
    if old:
        _replace_json(step_dir / STEP_METADATA, old)
    else:
        (step_dir / STEP_METADATA).unlink(missing_ok=True)


def _replace_json(path: epath.Path, data: dict) -> None:
    if objstore.is_remote(path):  # one object write replaces it atomically
        path.write_text(json.dumps(data))
        objstore.refresh(path)
        return
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: leave nothing behind
        raise


def renumber_refusal(src: epath.Path, dst: epath.Path) -> StepExistsError:
    """The error for renumbering ``src`` into ``dst``, a directory that stays taken."""
    what = "a step of the same run in MaxText's numbering?"
    try:
        if detect_layout(dst) is Layout.TUNIX and tunix_step_number(dst) == 0:
            what = "Tunix's initial state (0 updates), which has no MaxText number"
    except OrbaxMaxTextLayoutError:  # moved or damaged meanwhile: the generic guess
        pass
    return StepExistsError(
        f"{src}: cannot renumber it to {dst.name}: {dst} already exists ({what}). Nothing "
        "was moved. Move that directory out of the run, or convert with "
        "--keep-step-numbers (renumber=False)."
    )


def move_step(src: epath.Path, dst: epath.Path, tunix_step: int) -> None:
    """Renumbers a legacy Tunix step: records its update count, then renames it (atomic;
    on an object store, `objstore.move_dir`).

    The recorded count keeps the step's meaning wherever it lives (`tunix_step_number`).
    Refused if ``dst`` exists: nothing is moved or overwritten.
    """
    if dst.exists():
        raise renumber_refusal(src, dst)
    with step_lock(src):
        update_step_metadata(src, lambda meta: with_tunix_step(meta, tunix_step))
        if objstore.is_remote(src):  # no rename: copies, markers ordered (`objstore.move_dir`)
            objstore.move_dir(src, dst, skip=(LOCK_NAME,))
            return
        src.rename(dst)
        release_moved_lock(dst)


def disk_usage(
    path: epath.Path, *, new_only: bool = False, shared: Container[tuple[int, int]] = ()
) -> int:
    """Bytes under ``path``; ``new_only`` skips files hard-linked from elsewhere and the
    files in ``shared`` (``(st_dev, st_ino)``: reflinks, one link but the source's extents)."""
    if objstore.is_remote(path):  # walks with iterdir: epath forbids recursive globs on GCS
        return sum(
            disk_usage(c) if c.is_dir() else c.stat().length for c in epath.Path(path).iterdir()
        )
    total = 0
    for root, _, files in os.walk(str(path)):
        for f in files:
            st = os.stat(os.path.join(root, f))
            new = st.st_nlink == 1 and (st.st_dev, st.st_ino) not in shared
            total += st.st_size if not new_only or new else 0
    return total


def new_step_dir(dest: epath.Path) -> epath.Path:
    """Where a separate destination step is built before it appears at ``dest``.

    On a disk: a temporary sibling (``<dest>.orbax-checkpoint-tmp-<hex>``, which Orbax
    and `find_steps` ignore), renamed to ``dest`` by `publish_step`. On an object store:
    ``dest`` itself; Orbax lists a step there only once its ``commit_success.txt``
    exists, which `publish_step` writes last. Either way a failed conversion leaves no
    step a stock manager would list.
    """
    if objstore.is_remote(dest):
        clean_stale_tmp(dest)  # an uncommitted items/ of a dead run (call under the lock)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = dest.parent / f"{dest.name}{TMP_SUFFIX}{uuid.uuid4().hex[:12]}"
    work.mkdir()
    return work


def seed_destination(step_dir: epath.Path, dest: epath.Path, tunix_step: int | None) -> None:
    """A separate destination step starts with the source's step metadata (recording
    its Tunix step number when it is renumbered)."""
    meta = read_step_metadata(step_dir)
    if meta or tunix_step is not None:
        if tunix_step is not None:
            meta = with_tunix_step(meta, tunix_step)
        _replace_json(dest / STEP_METADATA, meta)


def publish_step(work: epath.Path, dest: epath.Path) -> bool:
    """Makes a destination step built in ``work`` (`new_step_dir`) appear at ``dest``:
    its ``commit_success.txt`` last, then (on a disk) one rename. False if ``dest``
    appeared meanwhile (another converter): ``work`` is then discarded."""
    (work / objstore.COMMIT_MARKER).write_text(_marker_text())
    if objstore.is_remote(dest):
        objstore.refresh(dest)
        return True
    try:
        os.rename(str(work), str(dest))  # refuses a non-empty existing directory
    except OSError:
        if not dest.exists():
            raise
        work.rmtree(missing_ok=True)
        return False
    return True


def discard_step_dir(work: epath.Path) -> None:
    """Removes an unpublished destination step (after a failure)."""
    if objstore.is_remote(work):
        for child in work.iterdir():  # all but the lock, which its holder removes
            if child.name != LOCK_NAME:
                objstore.remove_tree(child) if child.is_dir() else child.unlink(missing_ok=True)
    else:
        work.rmtree(missing_ok=True)


def clean_stale_tmp(step_dir: epath.Path) -> None:
    """Removes what a dead run left (call under the step lock): an items temporary
    directory, or the temporary file of a step-metadata replace."""
    items = step_dir / MAXTEXT_ITEM
    if objstore.is_remote(step_dir) and not (items / objstore.COMMIT_MARKER).exists():
        objstore.remove_tree(items)  # written in place by a dead run, never committed
    for child in step_dir.iterdir():
        if child.name.startswith(MAXTEXT_ITEM + TMP_SUFFIX):
            child.rmtree()
        elif child.name.startswith(f".{STEP_METADATA}.") and child.name.endswith(".tmp"):
            child.unlink()


# Ops whose arrays the writer computes from a scalar or from nothing (the step counter,
# fresh RNG state): no stored array byte passes through it.
SCALAR_OPS = frozenset({"cast", "constant", "fresh"})


def removal_check(step_dir: epath.Path) -> tuple[bool, str]:
    """Whether a quick verification (metadata and stored-data presence) is enough before
    the legacy items of a converted step are deleted, and why.

    Quick when every array byte of ``items`` is the legacy items' own: each data file of
    the grafted databases shared with its legacy file (a hard link, still the same inode
    now, or a reflink: a copy-on-write clone, exact by construction) and no array copied
    chunk by chunk or computed from stored data by this writer. A data file that fell back
    to a copy (another file system, no links), ``copy=True``, a scan change or a zarr
    format change: every value is compared. Steps converted before this record existed,
    and steps on an object store: quick after ``in_place``, full otherwise (as before).
    """
    prov = read_provenance(step_dir) or {}
    files = prov.get("data_files")
    if objstore.is_remote(step_dir) or not isinstance(files, dict):
        if prov.get("in_place"):
            return True, "converted in place"
        return False, "converted by copying"
    copied = (files.get(sharing.COPY) or {}).get("files", 0)
    if copied:
        return False, f"{copied} data file(s) were copied, not shared"
    arrays = prov.get("arrays_written") or {}
    if arrays.get("chunks_copied"):
        return False, f"{arrays['chunks_copied']} array(s) were copied chunk by chunk"
    computed = {op: n for op, n in (arrays.get("computed") or {}).items() if op not in SCALAR_OPS}
    if computed:
        return False, "arrays were computed from stored data (" + ", ".join(sorted(computed)) + ")"
    reflinks = (files.get(sharing.REFLINK) or {}).get("files", 0)
    unproven = _not_shared_now(step_dir, reflinks)
    if unproven:
        return False, unproven
    return True, "every data file is shared with the legacy items"


def _not_shared_now(step_dir: epath.Path, reflinks: int) -> str | None:
    """Why the cloned data files of ``items`` are not (all) the legacy files any more, or None.

    A hard link is checked now (the same inode); a file of another inode counts as one of
    the ``reflinks`` recorded (a clone is its own inode) if its size is the legacy file's.
    """
    items, other = step_dir / MAXTEXT_ITEM, 0
    for child in items.iterdir():
        if not child.name.startswith(tskv.CHILD_PREFIX) or not child.is_dir():
            continue
        legacy = step_dir / child.name.removeprefix(tskv.CHILD_PREFIX)
        for root, _, names in os.walk(str(child)):
            rel = os.path.relpath(root, str(child))
            for name in names:
                a = os.stat(os.path.join(root, name))
                try:
                    b = os.stat(os.path.join(str(legacy), rel, name))
                except OSError:
                    return f"{legacy}/{rel}/{name}: missing from the legacy item"
                if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                    continue
                if a.st_size != b.st_size:
                    return f"{child}/{rel}/{name}: not the legacy file's size"
                other += 1
    if other > reflinks:
        return f"{other} data file(s) are no longer the legacy files (hard links replaced)"
    return None


def remove_legacy(step_dir: epath.Path, *, specs: dict | None = None) -> list[str]:
    """Deletes the legacy items of a converted step, only once ``items`` verifies.

    When every array byte of ``items`` is the legacy items' own (its data files shared
    with them: hard links or reflinks, see `removal_check`), the check is metadata plus
    stored-data presence; otherwise every value is compared. A verified item is first
    renamed aside (atomic), then deleted, so a kill mid-deletion never leaves a
    half-deleted legacy item that reads as a checkpoint; a rerun finishes the deletion.
    The shared data files stay readable through ``items``
    (a hard link keeps the inode, a reflink its extents). A symlinked legacy item loses
    only its link: nothing outside the step is ever deleted. ``specs``: the legacy items'
    specs if the caller read them (`verify_step`'s ``source_specs``).
    """
    notes = _finish_removal(step_dir)
    present = [n for n in (TUNIX_PARAMS_ITEM, TUNIX_OPT_ITEM) if _exists(step_dir / n)]
    if not present:
        _forget_item_handlers(step_dir)  # also after a run killed right after the removal
        return notes
    linked, why = removal_check(step_dir)
    how = f"{'quick' if linked else 'full'} verification: {why}"
    result = verify_step(step_dir, quick=linked, source_specs=specs)
    if not result.ok:
        return [*notes, f"legacy items kept: verification failed ({how}): {result.problems[:3]}"]
    for name in present:
        item = step_dir / name
        if objstore.is_remote(item):  # no rename: a marker says the deletion has begun
            (step_dir / f"{name}{REMOVING}").write_text("")
        elif os.path.islink(str(item)):
            os.unlink(str(item))  # the link only; its target is outside this step
        else:
            item.rename(step_dir / f"{name}{REMOVING}")
    _finish_removal(step_dir)
    _forget_item_handlers(step_dir)
    return [*notes, f"removed legacy {', '.join(present)} after verifying items ({how})"]


def _forget_item_handlers(step_dir: epath.Path) -> None:
    """Drops the step metadata's handler entries of items no longer on disk, so that
    readers that resolve handlers from it (a no-args restore) see what is there."""

    meta = read_step_metadata(step_dir)
    handlers = meta.get("item_handlers")
    if not isinstance(handlers, dict):
        return
    kept = {k: v for k, v in handlers.items() if _exists(step_dir / k)}
    if kept != handlers:
        _replace_json(step_dir / STEP_METADATA, {**meta, "item_handlers": kept})


def _exists(p: epath.Path) -> bool:
    return p.exists() or os.path.islink(str(p))


def _finish_removal(step_dir: epath.Path) -> list[str]:
    done = []
    for child in step_dir.iterdir():
        if child.name.endswith(REMOVING):
            name = child.name.removesuffix(REMOVING)
            if objstore.is_remote(child):  # the marker of an item deleted in place
                objstore.remove_tree(step_dir / name)
                child.unlink()
                objstore.refresh(step_dir)
            else:
                child.rmtree()
            done.append(name)
    return [f"finished removing verified legacy {', '.join(done)}"] if done else []
