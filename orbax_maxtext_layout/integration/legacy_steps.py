"""`LegacySteps`: the Tunix-layout steps a manager lists, and what it does with them.

The legacy-step logic of `manager.CheckpointManager`, and through it of
`training.Checkpointer` (whose inner v0 manager is one): which Tunix directories are listed
under which MaxText number and where each is now (`list_steps`, `where`, `held`),
restoring one as MaxText items (`restore_items`), moving legacy steps out of a save's way
(`make_room`, `release`), migrating the restored ones once a save has committed
(`after_save`), and finishing the legacy removals a killed run left (`finish_removals`).
The rules it implements are in `manager`'s module docstring. `load_requested` is what the
v0 ``restore`` and the v1 ``load_checkpointables`` do alike with a legacy step.

A manager owns one `LegacySteps` and calls it from its Orbax hooks; everything it needs of
the manager comes in as two callables: ``home(step)``, the directory Orbax saves ``step``
in, and ``is_primary()``. Only the primary process touches the file system.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.checkpoint_manager import CheckpointInfo, StepAlreadyExistsError

from ..errors import CheckpointReadError, LayoutMismatchError, UsageError
from ..execute import legacy_removal
from ..execute.convert import convert_step
from ..execute.legacy_removal import REMOVING
from ..execute.restore import RestoreRequest
from ..model.target import Target
from ..orbax_io import stepmeta
from ..orbax_io.layout import (
    MAXTEXT_ITEM,
    TUNIX_OPT_ITEM,
    TUNIX_PARAMS_ITEM,
    Layout,
    detect_layout,
    is_committed,
    tunix_step_number,
)
from ..orbax_io.stepmeta import read_provenance
from ..plan.step_plan import plan_step
from ..plan.steps import find_steps
from ..storage.lock import LOCK_NAME, break_stale_lock, step_lock
from ..storage.store import StepStore

__all__ = ["LegacySteps", "check_migrate", "load_requested"]

# The manager's logger: these records were always the manager's, and users (and the
# tests) set its level to see the moves and migrations.
logger = logging.getLogger("orbax_maxtext_layout.integration.manager")

Migrate = Literal["on_save", "off"]


def check_migrate(migrate: str) -> None:
    """Refuses a ``migrate=`` argument other than "on_save" or "off"."""
    if migrate not in ("on_save", "off"):
        raise UsageError(f"migrate must be 'on_save' or 'off', not {migrate!r}")


class LegacySteps:
    """The legacy (Tunix-layout) steps of one manager's directory (see the module docstring).

    Args:
      home: the directory a save of ``step`` writes (the manager's own step path).
      is_primary: whether this is the primary process.
      migrate, remove_legacy: the manager's arguments of the same names.

    Thread-safe: Orbax's save-finalize thread migrates while the training thread lists,
    restores and saves.
    """

    def __init__(
        self,
        home: Callable[[int], epath.Path],
        is_primary: Callable[[], bool],
        *,
        migrate: Migrate,
        remove_legacy: bool,
    ) -> None:
        check_migrate(migrate)
        self._home = home
        self._is_primary = is_primary
        self._migrate = migrate
        self._remove_legacy = remove_legacy
        self._lock = threading.RLock()  # the save-finalize thread migrates concurrently
        self._legacy: dict[int, epath.Path] = {}  # presented step -> directory holding it
        self._hidden: set[int] = set()  # numbers of Tunix directories not listed
        self._protected: frozenset[int] = frozenset()  # never removed by retention
        self._pending: dict[int, Target] = {}  # restored legacy steps awaiting migration
        self._store: StepStore  # the listed directory's (`list_steps`), handed down

    def finish_removals(self, directory: epath.Path, *, store: StepStore) -> None:
        """With ``remove_legacy``, on the primary process: finishes the legacy removals a
        killed run left in ``directory``: migrated steps (with this library's provenance)
        that still hold legacy items, or a half-deleted one; and the lock of a run killed
        after its removal, before releasing the lock."""
        if not (self._remove_legacy and self._is_primary()):
            return
        for info in find_steps(directory, roles=False):
            if info.layout is not Layout.MAXTEXT or read_provenance(info.path) is None:
                continue
            names = {c.name for c in info.path.iterdir()}
            if not names & {TUNIX_PARAMS_ITEM, TUNIX_OPT_ITEM} and not any(
                n.endswith(REMOVING) for n in names
            ):
                stale = any(n.startswith(LOCK_NAME) for n in names)
                if stale and break_stale_lock(info.path, store=store):
                    logger.info("Step %s: removed the lock of a dead run", info.path)
                continue
            try:
                with step_lock(info.path, store=store):  # verified as its record says
                    notes = legacy_removal.remove_legacy(info.path, store=store)
                logger.info("Step %s: %s", info.path, "; ".join(notes))
            except Exception as e:  # a failed removal leaves the step readable as it is
                logger.error("Step %s: legacy removal not finished: %s", info.path, e)

    # -- listing -----------------------------------------------------------------------
    def list_steps(
        self,
        directory: epath.Path,
        stock: Callable[[], list[CheckpointInfo]],
        *,
        store: StepStore,
    ) -> list[CheckpointInfo]:
        """The manager's listing of ``directory``: ``stock()`` (Orbax's own) without the
        Tunix-layout directories, plus each listable legacy step under its MaxText number.
        Forgets the previous listing (and so where its legacy steps were)."""
        with self._lock:
            self._legacy = {}  # the stock scan must read directories under their own names
            self._store = store  # the directory's, for the moves of the steps listed here
        infos = stock()  # reads from worker threads
        with self._lock:
            tunix = {
                s.step: s.path
                for s in find_steps(directory, roles=False)
                if s.layout is Layout.TUNIX
            }
            infos = [i for i in infos if i.step not in tunix]
            taken = {i.step for i in infos}
            self._hidden = set()
            for n, d in sorted(tunix.items()):
                try:
                    meta = stepmeta.read(d)
                    p = (tunix_step_number(d, meta) or 0) - 1
                except (CheckpointReadError, ValueError) as e:
                    meta, p, why = {}, -1, str(e)
                else:
                    why = "it would be step -1" if p < 0 else f"step {p} is a MaxText step"
                if p >= 0 and self._legacy.get(p) == self._home(p) != d:
                    # The source of a move into p's own directory, killed before its
                    # deletion (object stores): the moved copy is the step.
                    logger.info("%s: left by an unfinished move to %s.", d, self._home(p))
                    continue
                if p < 0 or p in taken:
                    logger.warning("Tunix-layout step %s is not listed: %s.", d, why)
                    self._hidden.add(n)
                    continue
                taken.add(p)
                self._legacy[p] = d
                infos.append(CheckpointInfo(p, _commit_time(meta), None))
            self._protected = frozenset(self._legacy)
            return sorted(infos, key=lambda i: i.step)

    def where(self, step: int) -> epath.Path | None:
        """The directory listed legacy step ``step`` is in now; None if ``step`` is not one."""
        with self._lock:
            return self._where(step) if step in self._legacy else None

    def held(self, step: int) -> epath.Path | None:
        """The directory of ``step`` if it is a listed step still in Tunix layout."""
        held = self.where(step)
        return held if held is not None and detect_layout(held) is Layout.TUNIX else None

    def held_everywhere(self, step: int, wait: Callable[[], None]) -> epath.Path | None:
        """`held`, one decision for every process: whether ``step`` is read as legacy items
        or the stock way (whose restore enters Orbax's barriers) must not differ between
        processes. Only the primary migrates, right after a save commits, so a process
        that looked for itself could still see the legacy items the primary has just
        migrated (the primary then waits at the stock restore's barrier, the others do not,
        and the job hangs). With several processes and legacy steps listed (the same on
        every process), each waits for its saves to finish (``wait``: the manager's
        ``wait_until_finished``; the primary's include its migrations), then takes the
        primary's decision."""
        if jax.process_count() == 1 or not self._legacy:
            return self.held(step)
        wait()
        mine = self.held(step)
        flag = np.int32(mine is not None)
        legacy = bool(ocp.multihost.broadcast_one_to_all(flag, is_source=self._is_primary()))
        if not legacy:
            return None
        return mine if mine is not None else self.where(step)

    def protects(self, step: int) -> bool:
        """Whether retention must keep ``step``: a legacy step found by the last listing."""
        return step in self._protected

    @property
    def pending(self) -> list[int]:
        """The restored legacy steps awaiting migration after the next committed save."""
        with self._lock:
            return sorted(self._pending)

    # -- restoring -----------------------------------------------------------------------
    def restore_items(
        self,
        step: int,
        held: epath.Path,
        item: Any,
        restore_args: Any = None,
        *,
        partial: bool = False,
        transforms: Any = None,
    ) -> Any:
        """Legacy step ``step`` (in ``held``) as the MaxText items ``item`` asks for.

        The one restore path of both managers: reads with a `RestoreRequest` and, when the
        request describes the whole model, queues the step for migration after the next
        committed save.
        """
        # A model-only step has no optimizer state: the caller's (fresh) one is kept.
        request = RestoreRequest.of(
            item, restore_args, partial_restore=partial, transforms=transforms, keep_missing=True
        )
        specs: dict[str, Any] = {}  # each item's metadata read once, for both plans
        out = request.restore(held, specs=specs)
        target, skipped = request.target, set(request.skipped)
        if self._migrate == "on_save" and _covers_step(
            held, target, skipped, partial=partial, transforms=transforms, specs=specs
        ):
            with self._lock:
                self._pending[step] = target
        logger.info(
            "Restored step %d from the Tunix-layout directory %s as MaxText items.", step, held
        )
        return out

    # -- saving and deleting -------------------------------------------------------------
    def make_room(self, step: int) -> None:
        """Called right before Orbax writes ``step``'s directory: gives the restored legacy
        steps their own number, then moves a legacy step out of that directory (or refuses
        to save over an unlisted one with `StepAlreadyExistsError`)."""
        with self._lock:
            for p in sorted(self._pending):  # give restored steps their own number now
                try:
                    self._place(p)
                except Exception as e:
                    logger.error("Legacy step %d will not be migrated: %s", p, e)
                    del self._pending[p]
            if step in self._hidden:
                raise StepAlreadyExistsError(
                    f"{self._home(step)} holds a Tunix-layout step that this manager does "
                    "not list (see the warning at start-up); it would be deleted by this save."
                )
            home = self._home(step)
            owner = next((p for p, d in self._legacy.items() if d == home), None)
            if owner is not None:
                self._place(owner)

    def _place(self, p: int) -> None:
        """Moves legacy step ``p`` into its own directory, moving a legacy occupant first.

        Decisions use the in-memory listing, identical on every process; only the
        primary process touches the file system.
        """
        held, home = self._where(p), self._home(p)
        if held != home:
            occupant = next((q for q, d in self._legacy.items() if d == home and q != p), None)
            if occupant is not None:
                self._place(occupant)
            elif p in self._hidden or (
                home.exists()
                and _tunix_step_of(home) != p + 1
                and is_committed(home, store=self._store)
            ):  # (an uncommitted one is debris, replaced as Orbax replaces it when saving)
                raise StepAlreadyExistsError(
                    f"Cannot move Tunix step {held} to {home}: that directory is taken."
                )
            if self._is_primary() and held.exists():
                store = self._store  # held lies in the listed directory
                stepmeta.update(
                    held, lambda meta: stepmeta.with_tunix_step(meta, p + 1), store=store
                )
                store.clear_for_move(home)  # a killed move into it, or a dead client's debris
                store.relocate_step(held, home, keep=LOCK_NAME)  # (a rename on a disk)
                stepmeta.moved(held, home, store=store)
                logger.info("Moved Tunix step %s to %s (MaxText step %d).", held, home, p)
        self._legacy[p] = home

    def release(self, step: int, *, forget: bool = True) -> None:
        """Moves legacy step ``step`` to its own number (where the stock deleter looks for
        it) and, with ``forget``, stops tracking it (it is about to be deleted)."""
        with self._lock:
            if step in self._legacy:
                self._place(step)
                if forget:
                    del self._legacy[step]
                    self._pending.pop(step, None)

    def after_save(self, step: int) -> None:
        """Called once save ``step`` has finalized (inline for synchronous saves, in Orbax's
        save-finalize thread for asynchronous ones): if it committed, the primary process
        migrates the restored legacy steps."""
        if not self._pending:
            return
        if not (self._home(step) / "commit_success.txt").exists():
            logger.error(
                "Step %d did not commit; legacy steps are migrated after a later save.", step
            )
            return
        with self._lock:
            pending, self._pending = self._pending, {}
        if self._is_primary():
            for p, target in sorted(pending.items()):
                self._migrate_step(p, target)

    def _migrate_step(self, p: int, target: Target) -> None:
        home = self._home(p)
        try:
            with self._lock:
                if self._where(p) != home:  # restored while this save was in flight
                    self._pending.setdefault(p, target)
                    return
            if detect_layout(home) is not Layout.TUNIX:
                return  # migrated meanwhile (e.g. by the CLI)
            report = convert_step(home, target, remove_legacy=self._remove_legacy)
            if report.status != "converted":
                raise CheckpointReadError(f"convert_step: {report.status} {report.notes}")
            logger.info(
                "Migrated legacy step %d into MaxText's layout at %s. %s", p, home, report.notes
            )
        except Exception as e:  # any failure leaves the legacy items as they were
            logger.error(
                "Migration of legacy step %d (%s) failed: %s. The legacy items are untouched "
                "and the step stays readable through this manager.",
                p,
                home,
                e,
            )

    # -- helpers -------------------------------------------------------------------------
    def _where(self, p: int) -> epath.Path:
        """Where legacy step ``p`` is now (another process's move may have outdated ours)."""
        held, home = self._legacy[p], self._home(p)
        if held != home and _tunix_step_of(held) != p + 1:
            return home
        return held


def load_requested(
    step: int,
    held: epath.Path,
    requested: Mapping[str, Any],
    load_items: Callable[[Any], Any],
    load_stock: Callable[[dict[str, Any]], Mapping[str, Any]],
    *,
    kind: str,
    log: logging.Logger,
) -> dict[str, Any]:
    """Legacy step ``step`` (in ``held``) loaded as ``requested`` asks: {name: request}, a
    name being an item (v0) or a checkpointable (v1), as ``kind`` says in the warning.

    ``items`` comes from ``load_items(its request)`` (the caller's `LegacySteps.restore_items`
    call); the other names the step holds come from one ``load_stock({name: request})``
    (the stock way); a name it lacks comes back as None, with a warning on ``log`` (the
    stock managers raise instead). Returns ``{name: result}`` in ``requested``'s order.
    """
    out: dict[str, Any] = {}
    stock: dict[str, Any] = {}
    for name, request in requested.items():
        if name == MAXTEXT_ITEM:
            out[name] = load_items(request)
        elif (held / name).exists():
            stock[name] = request
        else:
            log.warning("Step %d (%s) has no %r %s; returning None for it.", step, held, name, kind)
            out[name] = None
    if stock:
        out.update(load_stock(stock))
    return {name: out[name] for name in requested}


def _covers_step(
    held: epath.Path,
    target: Target,
    skipped: set,
    *,
    partial: bool,
    transforms: Any,
    specs: dict[str, Any] | None = None,
) -> bool:
    """Whether a restore request describes the whole model, so that the step can be
    migrated (converted in full) against it. ``specs``: the restore's item specs."""
    if not target.nnx_aux or skipped or transforms is not None:
        return False
    if not partial:
        return True  # the restore already required every model leaf to fit
    try:  # a partial request (v1's partial_load) may still name every leaf
        plan_step(held, target, specs=specs)
    except LayoutMismatchError:
        return False
    return True


def _tunix_step_of(step_dir: epath.Path) -> int | None:
    if detect_layout(step_dir) is not Layout.TUNIX:
        return None
    return tunix_step_number(step_dir)


def _commit_time(meta: dict[str, Any]) -> datetime.datetime:
    ns = meta.get("commit_timestamp_nsecs") or 0
    return datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.UTC)
