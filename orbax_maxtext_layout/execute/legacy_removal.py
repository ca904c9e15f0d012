"""The legacy items of a converted step: when they may go, and their verified removal.

The policy (`removal_check`: is a quick verification enough?) reads the conversion's
record; the removal (`remove_legacy`) verifies ``items`` first (`verify`) and deletes each
legacy item so that a kill mid-deletion never leaves a half-deleted item that reads as a
checkpoint. This sits above the conversion machinery it judges (`verify`, `item_writer`), where
conversions are driven (`convert`, the managers).
"""

from __future__ import annotations

import os

from etils import epath

from ..base.step_entries import MAXTEXT_ITEM, TUNIX_OPT_ITEM, TUNIX_PARAMS_ITEM
from ..orbax_io import item_writer, stepmeta
from ..storage import placement
from ..storage.store import StepStore
from .verify import verify_step

REMOVING = ".orbax-maxtext-layout-removing"  # a verified legacy item being deleted


# Ops whose arrays the writer computes from a scalar or from nothing (the step counter,
# fresh RNG state): no stored array byte passes through it.
SCALAR_OPS = frozenset({"cast", "constant", "fresh"})


def removal_check(step_dir: epath.Path, *, store: StepStore) -> tuple[bool, str]:
    """Whether a quick verification (metadata and stored-data presence) is enough before
    the legacy items of a converted step are deleted, and why.

    Quick when every array byte of ``items`` is the legacy items' own: each data file of
    the grafted databases shared with its legacy file (a hard link, still the same inode
    now, or a reflink: a copy-on-write clone, exact by construction) and no array copied
    chunk by chunk or computed from stored data by this writer. A data file that fell back
    to a copy (another file system, no links), ``copy=True``, a scan change or a zarr
    format change: every value is compared. Steps converted before this record existed,
    and steps on an object store: quick after ``in_place``, full otherwise (as before).
    ``store``: the step's root's, where the caller decided it.
    """
    prov = stepmeta.read_provenance(step_dir) or {}
    files = prov.get("data_files")
    if not store.shares_files or not isinstance(files, dict):
        if prov.get("in_place"):
            return True, "converted in place"
        return False, "converted by copying"
    copied = (files.get(placement.COPY) or {}).get("files", 0)
    if copied:
        return False, f"{copied} data file(s) were copied, not shared"
    arrays = prov.get("arrays_written") or {}
    if arrays.get("chunks_copied"):
        return False, f"{arrays['chunks_copied']} array(s) were copied chunk by chunk"
    computed = {op: n for op, n in (arrays.get("computed") or {}).items() if op not in SCALAR_OPS}
    if computed:
        return False, "arrays were computed from stored data (" + ", ".join(sorted(computed)) + ")"
    reflinks = (files.get(placement.REFLINK) or {}).get("files", 0)
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
        if not child.name.startswith(item_writer.CHILD_PREFIX) or not child.is_dir():
            continue
        legacy = step_dir / child.name.removeprefix(item_writer.CHILD_PREFIX)
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


def remove_legacy(
    step_dir: epath.Path, *, store: StepStore, specs: dict | None = None
) -> list[str]:
    """Deletes the legacy items of a converted step, only once ``items`` verifies.

    When every array byte of ``items`` is the legacy items' own (its data files shared
    with them: hard links or reflinks, see `removal_check`), the check is metadata plus
    stored-data presence; otherwise every value is compared. A verified item is first
    renamed aside (atomic), then deleted, so a kill mid-deletion never leaves a
    half-deleted legacy item that reads as a checkpoint; a rerun finishes the deletion.
    The shared data files stay readable through ``items``
    (a hard link keeps the inode, a reflink its extents). A symlinked legacy item loses
    only its link: nothing outside the step is ever deleted. ``specs``: the legacy items'
    specs if the caller read them (`verify_step`'s ``source_specs``); ``store``: the step's
    root's, as the caller decided it.
    """
    notes = _finish_removal(step_dir, store)
    present = [n for n in (TUNIX_PARAMS_ITEM, TUNIX_OPT_ITEM) if _exists(step_dir / n)]
    if not present:
        _forget_item_handlers(step_dir, store)  # also after a run killed right after the removal
        return notes
    if notes:
        # A removal cut short between two set-asides: every legacy item was verified before
        # the first was set aside, and the one gone can no longer be verified against.
        how = "verified before an interrupted removal"
    else:
        linked, why = removal_check(step_dir, store=store)
        how = f"{'quick' if linked else 'full'} verification: {why}"
        result = verify_step(step_dir, quick=linked, source_specs=specs)
        if not result.ok:
            return [f"legacy items kept: verification failed ({how}): {result.problems[:3]}"]
    for name in present:  # set aside first: no longer an item, not yet deleted
        store.set_aside(step_dir / name, step_dir / f"{name}{REMOVING}")
    _finish_removal(step_dir, store)
    _forget_item_handlers(step_dir, store)
    return [*notes, f"removed legacy {', '.join(present)} after verifying items ({how})"]


def _forget_item_handlers(step_dir: epath.Path, store: StepStore) -> None:
    """Drops the step metadata's handler entries of items no longer on disk, so that
    readers that resolve handlers from it (a no-args restore) see what is there."""

    meta = stepmeta.read(step_dir, store=store)
    handlers = meta.get("item_handlers")
    if not isinstance(handlers, dict):
        return
    kept = {k: v for k, v in handlers.items() if _exists(step_dir / k)}
    if kept != handlers:
        stepmeta.write(step_dir, {**meta, "item_handlers": kept}, store=store)


def _exists(p: epath.Path) -> bool:
    return p.exists() or os.path.islink(str(p))


def _finish_removal(step_dir: epath.Path, store: StepStore) -> list[str]:
    done = []
    for child in step_dir.iterdir():
        if child.name.endswith(REMOVING):
            name = child.name.removesuffix(REMOVING)
            store.finish_set_aside(child, step_dir / name)
            done.append(name)
    return [f"finished removing verified legacy {', '.join(done)}"] if done else []
