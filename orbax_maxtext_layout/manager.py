"""`CheckpointManager`: Orbax's manager, reading Tunix-layout steps as MaxText ones.

A drop-in subclass of `ocp.CheckpointManager` (same constructor, plus ``migrate`` and
``remove_legacy``). On MaxText-layout steps it is the stock manager. A Tunix-layout step
(``<dir>/<n>/model_params`` without ``items/``) is listed, restored as MaxText ``items``
against the abstract target the caller passes (the call MaxText's
``load_state_if_possible`` makes), and, with ``migrate="on_save"``, rewritten into
MaxText's layout once the next save has committed.

Step numbering
--------------
Tunix directory ``N`` holds the state after ``N`` optimizer updates; MaxText directory
``N`` holds the state after ``N + 1`` (MaxText saves after the update and resumes at
``items/step``). The manager therefore presents Tunix directory ``N`` as step ``N - 1``
everywhere (`all_steps`, `latest_step`, `restore`, `metadata`, `delete`), and
``restore(N - 1)`` returns items whose ``step`` is ``N``, so the numbers mean what they
mean for MaxText. A resumed MaxText loop then starts at ``N`` and first saves step ``N``:
the directory the Tunix step still occupies, which Orbax would delete before writing.
Right before Orbax writes a step directory, the manager therefore moves a legacy step
found there to its own number (``<dir>/N`` -> ``<dir>/N-1``, one rename; a Tunix step
already at ``N - 1`` moves first), after recording
``custom_metadata["orbax_maxtext_layout.tunix_step"] = N`` in the moved step, which keeps
its number stable wherever it lives. So no save is skipped or overwritten, and the
restored state stays restorable as step ``N - 1``, where migration writes ``items/``.
A Tunix directory ``0``, or one whose ``N - 1`` is a MaxText step, is not listed (a
warning says so), and a save at its directory raises `StepAlreadyExistsError`.

Migration (``migrate="on_save"``)
----------------------------------
Every legacy step this manager restored as items against the whole model (a request
naming ``nnx_aux`` and every model leaf, with ``partial_restore`` or without, and no
placeholders or transforms) is moved to its own number at the next save and, once that
save has committed (synchronous: before `save` returns;
asynchronous: in Orbax's save-finalize thread, so `wait_until_finished`, `close` and the
next save wait for it), rewritten in place with `convert_step` against the Target of the
restore (the optimizer is always converted; the canonical rules apply when the restore
asked for no ``opt_state``). Step custom metadata is kept. With ``remove_legacy=True``
the legacy items are deleted only after the new ``items`` verified against them (Orbax
metadata and every leaf's value). A failed migration is logged with its reason and leaves
the legacy step readable. Migration runs on the primary process only. A moved step
without ``optimizer_state`` (model only) takes its ``step`` from the recorded
``TUNIX_STEP_KEY``, not from its new directory name.

Other rules: Tunix-layout steps found when the manager was created (or reloaded) are
never deleted by the preservation policy. ``restore(step)`` without ``args`` on a Tunix
step cannot produce MaxText items (only the model tells weights from RNG state): it
returns ``Composite(model_params=..., optimizer_state=...)`` as stored, logs a warning
naming what was not restored, and does not migrate. Another requested item (e.g.
``iter``) restores the stock way if the step has it; if not, it comes back as ``None``
with a warning (the stock manager raises ``KeyError``). Note that MaxText asks for
``iter`` only if ``<dir>/<step>/iter`` exists, which for a Tunix step not moved yet is
not where it lives. Moves are directory renames, atomic and cheap on local and POSIX
file systems. Object stores have no rename: there a move is `objstore.move_dir` (server-side
copies; the destination's ``commit_success.txt`` makes it a step, then the source's is
deleted first), a step directory counts only with its ``commit_success.txt`` (as for
Orbax), and the primary process finishes or rolls back a killed move when it lists.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any, Literal

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.checkpoint_manager import CheckpointInfo, StepAlreadyExistsError

from . import legacy, stepmeta
from .convert import convert_step
from .errors import CheckpointReadError, LayoutMismatchError, UsageError
from .layout import (
    MAXTEXT_ITEM,
    TUNIX_OPT_ITEM,
    TUNIX_PARAMS_ITEM,
    Layout,
    detect_layout,
    is_committed,
    tunix_step_number,
)
from .legacy import REMOVING
from .lock import LOCK_NAME, break_stale_lock, step_lock
from .orbax_files import absolute
from .plan import plan_step
from .restore import request_target, restore_request
from .stepmeta import TUNIX_STEP_KEY, read_provenance
from .steps import find_steps
from .store import store_for
from .target import Target

__all__ = ["TUNIX_STEP_KEY", "CheckpointManager"]

logger = logging.getLogger(__name__)


class CheckpointManager(ocp.CheckpointManager):
    """`ocp.CheckpointManager` that also reads Tunix-layout steps (see the module docstring).

    Args:
      *args, **kwargs: exactly `ocp.CheckpointManager`'s.
      migrate: "on_save" rewrites each restored legacy step into MaxText's layout after
        the next committed save; "off" never rewrites (moves still happen, see above).
      remove_legacy: delete a migrated step's ``model_params``/``optimizer_state`` once
        its new ``items`` has been verified against them.
    """

    def __init__(
        self,
        *args: Any,
        migrate: Literal["on_save", "off"] = "on_save",
        remove_legacy: bool = False,
        **kwargs: Any,
    ) -> None:
        if migrate not in ("on_save", "off"):
            raise UsageError(f"migrate must be 'on_save' or 'off', not {migrate!r}")
        self._migrate = migrate
        self._remove_legacy = remove_legacy
        self._lock = threading.RLock()  # the save-finalize thread migrates concurrently
        self._legacy: dict[int, epath.Path] = {}  # presented step -> directory holding it
        self._hidden: set[int] = set()  # numbers of Tunix directories not listed
        self._protected: frozenset[int] = frozenset()  # never removed by retention
        self._pending: dict[int, Target] = {}  # restored legacy steps awaiting migration
        super().__init__(*args, **kwargs)  # lists the steps via _load_checkpoint_infos
        if remove_legacy and self._is_primary():
            self._finish_removals()

    def _finish_removals(self) -> None:
        """Finishes legacy removals a killed run left: migrated steps (with this
        library's provenance) that still hold legacy items, or a half-deleted one; and the
        lock of a run killed after its removal, before releasing the lock."""
        for info in find_steps(self.directory, roles=False):
            if info.layout is not Layout.MAXTEXT or read_provenance(info.path) is None:
                continue
            names = {c.name for c in info.path.iterdir()}
            if not names & {TUNIX_PARAMS_ITEM, TUNIX_OPT_ITEM} and not any(
                n.endswith(REMOVING) for n in names
            ):
                if any(n.startswith(LOCK_NAME) for n in names) and break_stale_lock(info.path):
                    logger.info("Step %s: removed the lock of a dead run", info.path)
                continue
            try:
                with step_lock(info.path):  # verified as its record says (`removal_check`)
                    notes = legacy.remove_legacy(info.path)
                logger.info("Step %s: %s", info.path, "; ".join(notes))
            except Exception as e:  # a failed removal leaves the step readable as it is
                logger.error("Step %s: legacy removal not finished: %s", info.path, e)

    # -- listing -----------------------------------------------------------------------
    def _load_checkpoint_infos(self, skip_metadata_read: bool = False) -> list[CheckpointInfo]:
        if self._is_primary():
            store = store_for(self.directory)
            for note in store.finish_relocations(self.directory):  # of a killed manager
                logger.info("%s: %s.", self.directory, note)
        with self._lock:
            self._legacy = {}  # the stock scan must read directories under their own names
        infos = super()._load_checkpoint_infos(skip_metadata_read)  # reads from worker threads
        with self._lock:
            tunix = {
                s.step: s.path
                for s in find_steps(self.directory, roles=False)
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

    def _get_read_step_directory(self, step: int, root_dir: epath.Path) -> epath.Path:
        with self._lock:
            if step in self._legacy and epath.Path(root_dir) == self.directory:
                return self._where(step)
        return super()._get_read_step_directory(step, root_dir)

    def _get_old_steps_to_remove(self) -> list[int]:
        return [s for s in super()._get_old_steps_to_remove() if s not in self._protected]

    # -- saving --------------------------------------------------------------------------
    def _get_write_step_directory(self, step: int, root_dir: epath.Path) -> epath.Path:
        # `save` calls this right before Orbax writes the directory (deleting one that
        # exists), after deciding to save: the one moment a move is both needed and safe.
        if epath.Path(root_dir) == self.directory:
            self._make_room(step)
        return super()._get_write_step_directory(step, root_dir)

    def _make_room(self, step: int) -> None:
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
                home.exists() and _tunix_step_of(home) != p + 1 and is_committed(home)
            ):  # (an uncommitted one is debris, replaced as Orbax replaces it when saving)
                raise StepAlreadyExistsError(
                    f"Cannot move Tunix step {held} to {home}: that directory is taken."
                )
            if self._is_primary() and held.exists():
                stepmeta.update(held, lambda meta: stepmeta.with_tunix_step(meta, p + 1))
                store = store_for(held)
                store.clear_for_move(home)  # a killed move into it, or a dead client's debris
                store.relocate_step(held, home, keep=LOCK_NAME)
                stepmeta.moved(held, home)
                logger.info("Moved Tunix step %s to %s (MaxText step %d).", held, home, p)
        self._legacy[p] = home

    def _finalize(self, step: int, steps_to_remove: list[int]) -> None:
        # Runs after the save committed: inline for synchronous saves, in Orbax's
        # save-finalize thread for asynchronous ones (so it never blocks training).
        super()._finalize(step, steps_to_remove)
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

    # -- restoring -----------------------------------------------------------------------
    def restore(
        self,
        step: int | None,
        items: Any = None,
        restore_kwargs: Any = None,
        directory: epath.PathLike | None = None,
        args: ocp.args.CheckpointArgs | None = None,
    ) -> Any:
        """`ocp.CheckpointManager.restore`; a Tunix-layout step comes back as MaxText items.

        ``args=Composite(items=PyTreeRestore(item=<MaxText abstract items>,
        restore_args=...))`` converts the step against that target, reading only the
        leaves it needs, each with the sharding of its ``restore_args`` entry (else of its
        ``item`` leaf), and returns the tree in ``item``'s structure. Runs on every
        process, with no barrier. See the module docstring for the other cases.
        """
        if step is None and directory is None:
            step = self.latest_step()
        held = self._legacy_dir(step, directory)
        if held is None:
            return super().restore(step, items, restore_kwargs, directory, args)
        assert step is not None
        if items is not None or restore_kwargs is not None:
            raise UsageError(f"Step {step} is in Tunix layout: restore it with args=, not items=.")
        if args is None:
            return self._restore_as_stored(step, held)
        composite = isinstance(args, ocp.args.Composite)
        requested = dict(args.items()) if composite else {MAXTEXT_ITEM: args}
        out: dict[str, Any] = {}
        stock: dict[str, Any] = {}
        for name, a in requested.items():
            if name == MAXTEXT_ITEM:
                out[name] = self._restore_items(step, held, a)
            elif (held / name).exists():
                stock[name] = a
            else:
                logger.warning(
                    "Step %d (%s) has no %r item; returning None for it.", step, held, name
                )
                out[name] = None
        if stock:
            out.update(super().restore(step, args=ocp.args.Composite(**stock)).items())
        result = {name: out[name] for name in requested}
        return ocp.args.Composite(**result) if composite else result[MAXTEXT_ITEM]

    def _legacy_dir(self, step: int | None, directory: epath.PathLike | None) -> epath.Path | None:
        """The directory of ``step`` if it is a listed step still in Tunix layout."""
        if step is None or (directory is not None and epath.Path(directory) != self.directory):
            return None
        with self._lock:
            if step not in self._legacy:
                return None
            held = self._where(step)
        return held if detect_layout(held) is Layout.TUNIX else None

    def _restore_items(self, step: int, held: epath.Path, args: Any) -> Any:
        item = getattr(args, "item", None)
        if item is None:
            raise UsageError(
                f"Step {step} ({held}) is in Tunix layout. Restoring it as MaxText items needs "
                "the abstract target: args=Composite(items=PyTreeRestore(item=<abstract items>))."
            )
        return self._restore_legacy_items(
            step,
            held,
            item,
            getattr(args, "restore_args", None),
            partial=bool(getattr(args, "partial_restore", False)),
            transforms=getattr(args, "transforms", None),
        )

    def _restore_legacy_items(
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

        The one restore path of both this manager and `training.Checkpointer`: reads
        with `restore_request` and, when the request describes the whole model,
        queues the step for migration after the next committed save.
        """
        request = request_target(item, restore_args)
        specs: dict[str, Any] = {}  # each item's metadata read once, for both plans
        # A model-only step has no optimizer state: the caller's (fresh) one is kept.
        out = restore_request(
            held,
            item,
            restore_args,
            partial_restore=partial,
            transforms=transforms,
            keep_missing=True,
            request=request,
            specs=specs,
        )
        target, skipped = request
        if self._migrate == "on_save" and _covers_step(
            held, target, skipped, partial, transforms, specs
        ):
            with self._lock:
                self._pending[step] = target
        logger.info(
            "Restored step %d from the Tunix-layout directory %s as MaxText items.", step, held
        )
        return out

    def _restore_as_stored(self, step: int, held: epath.Path) -> ocp.args.Composite:
        names = [n for n in (TUNIX_PARAMS_ITEM, TUNIX_OPT_ITEM) if (held / n).is_dir()]
        others = sorted(c.name for c in held.iterdir() if c.is_dir() and c.name not in names)
        logger.warning(
            "Step %d (%s) is in Tunix layout and restore() got no target, so it cannot be "
            "split into MaxText items (only the model tells weights from RNG state): returning "
            "%s as stored. Not restored: %s. Pass args=Composite(items=PyTreeRestore(item="
            "<abstract items>)) for MaxText items (and migration).",
            step,
            held,
            names,
            others or "nothing else",
        )
        return ocp.args.Composite(
            **{n: ocp.PyTreeCheckpointHandler().restore(absolute(held / n)) for n in names}
        )

    # -- other overrides ---------------------------------------------------------------
    def delete(self, step: int) -> None:
        self._release(step)
        super().delete(step)

    def _release(self, step: int, *, forget: bool = True) -> None:
        """Moves legacy step ``step`` to its own number (where the stock deleter looks for
        it) and, with ``forget``, stops tracking it (it is about to be deleted)."""
        with self._lock:
            if step in self._legacy:
                self._place(step)
                if forget:
                    del self._legacy[step]
                    self._pending.pop(step, None)

    def close(self) -> None:
        super().close()  # waits for saves and the migrations they trigger
        with self._lock:
            if self._pending:
                logger.info(
                    "Legacy steps %s were restored but not migrated: no save committed after "
                    "their restore.",
                    sorted(self._pending),
                )

    # -- helpers -------------------------------------------------------------------------
    def _home(self, step: int) -> epath.Path:
        return self._get_save_directory(step, self.directory)

    def _where(self, p: int) -> epath.Path:
        """Where legacy step ``p`` is now (another process's move may have outdated ours)."""
        held, home = self._legacy[p], self._home(p)
        if held != home and _tunix_step_of(held) != p + 1:
            return home
        return held

    def _is_primary(self) -> bool:
        return ocp.multihost.is_primary_host(self._multiprocessing_options.primary_host)


def _covers_step(
    held: epath.Path,
    target: Target,
    skipped: set,
    partial: bool,
    transforms: Any,
    specs: dict[str, Any] | None = None,
) -> bool:
    """Whether a restore request describes the whole model, so that the step can be
    migrated (converted in full) against it. ``specs``: the restore's item specs."""
    if not target.nnx_aux or skipped or transforms is not None:
        return False
    if not partial:
        return True  # restore_request already required every model leaf to fit
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
