"""A step directory as a unit of work: temporary item, atomic commit, moves, destinations.

Everything that changes a step directory's entries goes through here (the lock is in
`lock`, the step metadata in `stepmeta`, the legacy removal in `legacy_removal`): the temporary
directory for a new ``items``, the single commit point, the renumbering move, and the
separate destination step that appears only once complete. How each is done on a disk or
an object store is the root's `store.StepStore`'s business: each function is handed the
store its caller decided for the root (``store``), and decides nothing itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import orbax.checkpoint as ocp
from etils import epath

from ..errors import OrbaxMaxTextLayoutError, StepExistsError
from ..storage.lock import LOCK_NAME, release_moved_lock, step_lock
from ..storage.store import TMP_SUFFIX, StepStore
from . import stepmeta
from .layout import MAXTEXT_ITEM, Layout, detect_layout, tunix_step_number


def new_tmp_dir(step_dir: epath.Path, *, store: StepStore, item: str = MAXTEXT_ITEM) -> epath.Path:
    """Where a new ``items`` (or another ``item``: ``model_params``) is written before its
    commit.

    On a disk: an Orbax-style temporary directory (ignored by readers and `find_steps`),
    renamed at the commit. On an object store (no rename): ``items/`` itself, written in
    place; it counts as written only once its commit marker exists (`commit`).
    """
    return store.new_item_dir(step_dir, item)


def discard(tmp: epath.Path, *, store: StepStore) -> None:
    """Removes an uncommitted ``items`` (after a failure)."""
    store.discard(tmp)


def commit(
    step_dir: epath.Path,
    tmp: epath.Path,
    provenance: dict,
    *,
    store: StepStore,
    meta: dict | None = None,
    custom: dict | None = None,
    item: str = MAXTEXT_ITEM,
) -> None:
    """The single commit point of a new ``items`` (or ``item``), with the provenance in step
    metadata.

    The item is sealed (on a disk its ``commit_success.txt``), the step metadata names it
    and records the provenance, then the store publishes it: on a disk one rename of
    ``tmp`` to ``items`` (a crash before it leaves only an ignored temporary directory);
    on an object store ``items/commit_success.txt``, the last object: until it exists the
    item is incomplete (`layout.detect_layout`), and stock Orbax reads nothing missing
    (``_METADATA`` was written after the files it relies on). The metadata is rolled back
    if publishing fails. ``meta``: the step metadata as this operation read it; ``custom``:
    entries for its custom metadata beside the provenance (MaxText's ``scan_layers``).
    """
    old = stepmeta.read(step_dir, store=store) if meta is None else meta
    store.seal_item(tmp)
    typestr = ocp.PyTreeCheckpointHandler.typestr()
    new = stepmeta.with_item(old, item, typestr, provenance, custom)
    stepmeta.write(step_dir, new, store=store)
    try:
        store.publish_item(tmp, step_dir / item)
    except BaseException:
        stepmeta.restore(step_dir, old, store=store)
        raise


def renumber_refusal(src: epath.Path, dst: epath.Path, *, store: StepStore) -> StepExistsError:
    """The error for renumbering ``src`` into ``dst``, a directory that stays taken."""
    what = "a step of the same run in MaxText's numbering?"
    try:
        if detect_layout(dst, store=store) is Layout.TUNIX and tunix_step_number(dst) == 0:
            what = "Tunix's initial state (0 updates), which has no MaxText number"
    except OrbaxMaxTextLayoutError:  # moved or damaged meanwhile: the generic guess
        pass
    return StepExistsError(
        f"{src}: cannot renumber it to {dst.name}: {dst} already exists ({what}). Nothing "
        "was moved. Move that directory out of the run, or convert with "
        "--keep-step-numbers (renumber=False)."
    )


def renumber_step(src: epath.Path, dst: epath.Path, tunix_step: int, *, store: StepStore) -> None:
    """Renumbers a legacy Tunix step: records its update count, then moves it (a rename on
    a disk; ordered copies and markers on an object store: `store.StepStore.relocate_step`).

    The recorded count keeps the step's meaning wherever it lives (`tunix_step_number`).
    Refused if ``dst`` exists: nothing is moved or overwritten.
    """
    if dst.exists():
        raise renumber_refusal(src, dst, store=store)
    with step_lock(src, store=store):
        stepmeta.update(src, lambda m: stepmeta.with_tunix_step(m, tunix_step), store=store)
        store.relocate_step(src, dst, keep=LOCK_NAME)
        stepmeta.moved(src, dst, store=store)
        release_moved_lock(dst, store=store)


def new_step_dir(dest: epath.Path, *, store: StepStore) -> epath.Path:
    """Where a separate destination step is built before it appears at ``dest``.

    On a disk: a temporary sibling (``<dest>.orbax-checkpoint-tmp-<hex>``, which Orbax
    and `find_steps` ignore), renamed to ``dest`` by `publish_step`. On an object store:
    ``dest`` itself (cleared of a dead run's uncommitted items: call under the lock);
    Orbax lists a step there only once its ``commit_success.txt`` exists, which
    `publish_step` writes last. Either way a failed conversion leaves no step a stock
    manager would list.
    """
    store.sweep_dead_work(dest)
    work = store.new_step_dir(dest)
    clean_stale_tmp(work, store=store)
    return work


def sweep_dead_work(dest: epath.Path, *, store: StepStore) -> list[str]:
    """Removes what killed builds of the separate destination ``dest`` left (a merge or an
    ``--out`` conversion killed before its publication); notes for a report."""
    return [f"removed {n}, left by a dead run" for n in store.sweep_dead_work(dest)]


def seed_destination(
    step_dir: epath.Path,
    dest: epath.Path,
    tunix_step: int | None,
    *,
    store: StepStore,
    meta: dict | None = None,
) -> None:
    """A separate destination step starts with the source's step metadata (recording
    its Tunix step number when it is renumbered). ``meta``: the source's, if read; ``store``:
    the destination's (the source's is read only where ``meta`` is not given)."""
    meta = stepmeta.read(step_dir) if meta is None else meta
    if meta or tunix_step is not None:
        if tunix_step is not None:
            meta = stepmeta.with_tunix_step(meta, tunix_step)
        stepmeta.write(dest, meta, store=store)


def publish_step(work: epath.Path, dest: epath.Path, *, store: StepStore) -> bool:
    """Makes a destination step built in ``work`` (`new_step_dir`) appear at ``dest``:
    its ``commit_success.txt`` last, then (on a disk) one rename. False if ``dest``
    appeared meanwhile (another converter): ``work`` is then discarded."""
    return store.publish_step(work, dest)


@contextlib.contextmanager
def building_step(
    dest: epath.Path, *, store: StepStore, taken: str = "pass another --out"
) -> Iterator[epath.Path]:
    """The frame a new separate step is built in (an import, an adapter step, a merge):
    yields the directory to build it in (`new_step_dir`) and, when the block ends, publishes
    it at ``dest`` (`publish_step`).

    On an object store, where the step is built in place, all of it runs under ``dest``'s
    lock. Refused (`StepExistsError`, ``taken`` says what to do) if ``dest`` exists, or
    appears meanwhile. On any failure the work directory goes, and so does ``dest``'s
    parent if this call made it: nothing is left that a stock manager would list.
    """
    made_parent = not dest.parent.exists()
    try:
        with step_lock(dest, store=store) if store.builds_in_place else contextlib.nullcontext():
            if store.dest_taken(dest):
                raise StepExistsError(f"{dest} exists; nothing was written: {taken}.")
            work = new_step_dir(dest, store=store)
            try:
                yield work
                if not publish_step(work, dest, store=store):
                    raise StepExistsError(f"{dest} appeared meanwhile; nothing replaced.")
            except BaseException:
                discard_step_dir(work, store=store)
                raise
    except BaseException:
        if made_parent:
            dest.parent.rmtree(missing_ok=True)
        raise


def discard_step_dir(work: epath.Path, *, store: StepStore) -> None:
    """Removes an unpublished destination step (after a failure; but the lock)."""
    store.discard_step_dir(work, keep=LOCK_NAME)


def clean_stale_tmp(step_dir: epath.Path, *, store: StepStore) -> None:
    """Removes what a dead run left (call under the step lock): an uncommitted ``items``,
    an items temporary directory, or the temporary file of a step-metadata replace."""
    store.clean_uncommitted_item(step_dir / MAXTEXT_ITEM)
    for child in step_dir.iterdir():
        if child.name.startswith(MAXTEXT_ITEM + TMP_SUFFIX):
            child.rmtree()
        elif child.name.startswith(f".{stepmeta.STEP_METADATA}.") and child.name.endswith(".tmp"):
            child.unlink()
