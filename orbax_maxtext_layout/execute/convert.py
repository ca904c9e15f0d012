"""`convert_step` and `to_maxtext_items`: plan a step, then write it (or report the plan).

The report, the provenance record and the progress total all come from the one
`Plan`; `write.write_items` executes it and `verify` replays it.
"""

from __future__ import annotations

import dataclasses
import errno
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Unpack

import jax
from etils import epath

from ..base.reports import Report
from ..base.treepaths import flatten, keystr, norm_key
from ..errors import (
    CheckpointReadError,
    LayoutMismatchError,
    StepExistsError,
    StepLocked,
    UsageError,
)
from ..model.target import Target
from ..orbax_io import stepdir, stepmeta
from ..orbax_io.layout import (
    MAXTEXT_ITEM,
    TUNIX_OPT_ITEM,
    TUNIX_PARAMS_ITEM,
    Layout,
    detect_layout,
    is_committed,
    maxtext_number,
    tunix_items,
    tunix_step_number,
)
from ..orbax_io.orbax_files import ItemFiles, reads_each_item_once
from ..orbax_io.spec import spec_of
from ..plan import renumbering
from ..plan.moves import Plan
from ..plan.provenance import record as provenance_record
from ..plan.step_plan import OptimizerMode, make_plan, plan_maxtext_step, plan_step
from ..plan.steps import find_steps
from ..storage import placement
from ..storage.lock import RENUMBER_LOCK_NAME, break_stale_lock, step_lock
from ..storage.store import COMMIT_MARKER, StepStore, store_for
from . import legacy_removal
from .options import (
    FLAGS,
    KEYWORDS,
    ConvertKeywords,
    ConvertOptions,
    Spelling,
    resolve,
)
from .options import check as check_options
from .restore import assemble
from .write import write_items


@dataclasses.dataclass
class StepReport(Report):
    """What a conversion did (or, for a dry run, would do) to one step."""

    step_dir: str
    status: str  # "converted" | "dry-run" | "skipped"
    layout: str
    step: int | None = None
    step_source: str = ""
    optimizer: str = "convert"
    destinations: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    dropped: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    rules: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    bytes_written: int = 0
    lora: dict[str, Any] | None = None  # a LoRA adapter step: what it holds (`LoraAdapters`)
    # How the source data files were placed in items/ (`placement.Placement.to_dict`): files
    # and bytes shared by reflink, by hard link, or copied, with the reasons for copies.
    data_files: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_plan(
        cls,
        step_dir: epath.Path,
        plan: Plan,
        status: str,
        optimizer: str,
        *,
        layout: Layout = Layout.TUNIX,
    ) -> StepReport:
        return cls(
            step_dir=str(step_dir),
            status=status,
            layout=layout.value,
            step=plan.step,
            step_source=plan.step_source,
            optimizer=optimizer,
            destinations=plan.summary(),
            dropped=[
                {"item": d.item, "path": keystr(d.src), "bytes": d.spec.nbytes, "reason": d.reason}
                for d in plan.drops
            ],
            rules=list(plan.rules),
            notes=list(plan.notes),
        )

    def __str__(self) -> str:
        lines = [f"{self.step_dir}: {self.status} ({self.layout})"]
        if self.destinations:
            lines.append(f"  {'destination':<12}{'leaves':>8}{'bytes':>14}")
            for name, d in self.destinations.items():
                lines.append(f"  {name:<12}{d['leaves']:>8}{d['bytes']:>14,}")
        if self.step is not None:
            lines.append(f"  step {self.step} (from {self.step_source})")
        if self.rules:
            lines.append("  rules: " + ", ".join(self.rules))
        by_reason: dict[str, list[str]] = {}
        for d in self.dropped:
            by_reason.setdefault(d["reason"], []).append(f"{d['item']}/{d['path']}")
        for reason, paths in by_reason.items():
            shown = ", ".join(paths[:3]) + (
                f", ... ({len(paths) - 3} more)" if len(paths) > 3 else ""
            )
            lines.append(f"  dropped {len(paths)} ({reason}): {shown}")
        lines += [f"  note: {n}" for n in self.notes]
        if self.status == "converted":
            if (files := placement.describe(self.data_files)) is not None:
                lines.append(f"  {files}")
            lines.append(f"  bytes written: {self.bytes_written:,}")
        return "\n".join(lines)


@reads_each_item_once
def convert_step(
    step_dir: epath.PathLike,
    target: Target,
    options: ConvertOptions | None = None,
    *,
    plan: Plan | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> StepReport:
    """Converts a Tunix-layout step into ``<step_dir>/items`` (MaxText's layout), or a
    MaxText-layout step into the other scan form (``rescan`` with ``out``).

    The new item is written atomically beside the legacy ``model_params``/
    ``optimizer_state`` (or, with ``out``, as ``<out>/items`` of a separate step
    directory, leaving the source step entirely untouched, e.g. when it is
    read-only). No array is decoded: the source databases are cloned into the new
    item and grafted under their new names (see `write.write_items`); memory
    stays under ``memory_budget`` plus the largest array. On a local file system the
    data files are shared with the legacy items, not copied: each is a reflink where
    the file system supports it, else a hard link (next to no bytes written; Orbax
    never modifies a committed data file, and neither does this), else, for that file
    alone, a copy (another file system, no links): the report's ``data_files`` counts
    each kind and why. ``copy=True`` writes private copies of every data file instead
    (a second physical copy). ``use_zarr3`` different from the source re-encodes every
    array. ``in_place`` shares the files and then removes the legacy items;
    ``remove_legacy`` removes them after the conversion. Legacy items are removed
    only after the new ``items`` has been verified (quickly when every data file is
    shared, value by value otherwise; see `legacy_removal.removal_check`). A step that
    already has ``items/`` is skipped; one being converted by another live process
    is reported as ``locked``. ``rescan="unroll"``/``"stack"`` writes the other scan
    form (the target is given in that form; see `rescan`), re-slicing each array
    on its own layer axis, one array at a time; a stack onto an unscanned target with no
    scanned form at hand needs ``plain_scan=True`` (the model is a plain scan: see
    `rescan.check_plain_stack`). ``plan`` is this step's plan if the
    caller already made it (`plan_step` with the same options), so it is not made twice.

    A MaxText-layout step with ``rescan`` is written in the other scan form into ``out``, a
    separate step (`_rescan_maxtext`, `plan_maxtext_step`): its items/ are only read, never
    rewritten, so ``out`` is then required (`check_rescan_destination`). A step this library
    converted from a Tunix step beside it is skipped without ``out``, as before.

    ``renumber=True`` gives the converted step MaxText's number (the CLI's default):
    Tunix directory ``N`` holds the state after ``N`` updates, which MaxText keeps in
    directory ``N - 1`` (it saves after the update), so the step directory is first
    renamed to ``N - 1`` (its update count recorded as `TUNIX_STEP_KEY`; a directory
    ``N - 1`` that exists is refused with `StepExistsError`, nothing moved), then
    converted there; ``items/step`` stays ``N``. Tunix directory ``0`` (the state
    before any update) has no MaxText number and is skipped with a note. With
    ``out``, ``out`` is the destination step directory as given.

    The options (`ConvertOptions`) come as one object or as keyword arguments of the same
    names, not both; ``plan`` is not an option (it is this step's own).

    Raises:
      LayoutMismatchError: target and checkpoint disagree (nothing is written).
      CheckpointReadError: the step is not a readable Tunix-layout step.
      ReadOnlyStepError: the step directory cannot be written (use ``out``), or
        ``in_place``/``remove_legacy`` were asked together with ``out``.
      UsageError: ``in_place`` with ``copy`` (in place means sharing the files), or with
        ``rescan``; ``rescan`` of a MaxText-layout step without ``out``, or in the form it is
        in; ``options`` together with option keywords. The option checks (`options.check`)
        come first, before anything is read or moved.
    """
    o = resolve(ConvertOptions, options, keywords, "convert_step")
    step_dir = epath.Path(step_dir)
    check_options(o, step_dir)  # before anything is read or moved
    if o.rescan is not None:
        check_rescan_destination([step_dir], o.out)
    store = store_for(step_dir)
    if o.renumber and o.out is None:  # a one-step run: moved under the run's lock, then converted
        return _renumbered(step_dir, target, o, store=store)
    dest = epath.Path(o.out) if o.out is not None else step_dir
    moved: list[str] = []  # a killed renumbering into this directory, finished first
    if not o.dry_run and store.relocation_in_progress(step_dir):
        with step_lock(step_dir.parent, store=store, name=RENUMBER_LOCK_NAME, wait=60.0):
            moved += [n for n in [store.finish_relocation(step_dir)] if n]
    if not step_dir.exists():  # listed, then renumbered or removed by another converter
        return StepReport(str(step_dir), "skipped", "gone", notes=[*moved, "no longer exists"])
    dest_store = store if o.out is None else store_for(dest)  # ``--out`` may be elsewhere
    layout = detect_layout(step_dir, store=store)
    if layout is Layout.MAXTEXT and o.rescan is not None and o.out is not None:
        if detect_layout(dest, store=dest_store) is not Layout.MAXTEXT:  # else written earlier
            return _rescan_maxtext(
                step_dir, target, dest, plan, o, store=store, dest_store=dest_store
            )
    if layout is Layout.MAXTEXT or detect_layout(dest, store=dest_store) is Layout.MAXTEXT:
        return _already_converted(
            step_dir,
            dest,
            store=store,
            dest_store=dest_store,
            dry_run=o.dry_run,
            finish_removal=o.in_place or o.remove_legacy,
        )
    if layout is Layout.UNKNOWN:
        return _uncommitted(step_dir, store=store)
    meta = stepmeta.read(step_dir, store=store)  # read once: numbering, the plan, the commit
    if o.renumber and (tunix_step_number(step_dir, meta) or 0) < 1 and step_dir.name.isdigit():
        return StepReport(str(step_dir), "skipped", layout.value, notes=[renumbering.TUNIX_ZERO])
    # Planned before anything is written: a step that does not fit the target stays as it is.
    specs: dict = {}  # the legacy items' metadata, read once: for the plan and for verify
    plan = plan or plan_step(step_dir, target, **_plan_options(o), specs=specs)
    if o.dry_run:
        report = StepReport.from_plan(step_dir, plan, "dry-run", o.optimizer)
        report.notes = moved + report.notes
        return report
    job = _StepJob(
        step_dir,
        dest,
        plan,
        o.optimizer,
        o.use_zarr3,
        o.memory_budget,
        o.copy,
        o.in_place,
        meta,
        _numbering(step_dir, o.renumber, meta),
        store,
    )
    if o.out is not None:
        return _convert_to(job, store=dest_store)
    removal = legacy_removal.remove_legacy if o.in_place or o.remove_legacy else None
    return _write_beside(job, moved, removal, specs, store=store)


def _plan_options(o: ConvertOptions) -> dict[str, Any]:
    """`plan_step`'s options of a conversion."""
    return dict(optimizer=o.optimizer, ignore=o.ignore, scan=o.rescan, plain_scan=o.plain_scan)


def _renumbered(
    step_dir: epath.Path, target: Target, o: ConvertOptions, *, store: StepStore
) -> StepReport:
    """`convert_step` of a one-step run with ``renumber``: the step moved to MaxText's number
    under the run's lock (`renumbering`), then converted there."""
    opts = _plan_options(o)

    def plan_of(d: epath.Path) -> Plan:
        return plan_step(d, target, **opts)

    [placed] = renumbering.plan_run(find_steps(step_dir), plan_of, store=store)
    if not o.dry_run:
        [placed] = renumbering.apply_renumbering([placed], plan_of, store=store)
    # Converted where it landed with the same options, the renumbering done: the optimizer
    # mode too, which the report and the provenance record (verify replays it); the
    # planning options go with the plan, made with them.
    return convert_placed(placed, target, dataclasses.replace(o, renumber=False))


def _uncommitted(step_dir: epath.Path, *, store: StepStore) -> StepReport:
    """A step with neither layout's items: skipped while uncommitted (a save, move or
    conversion in progress or dead), else refused as not a checkpoint step. ``store``: the
    step's."""
    if not is_committed(step_dir, store=store):
        note = (
            f"no {COMMIT_MARKER}: a save, move or conversion to it is in progress or "
            "died; Orbax does not list it either"
        )
        return StepReport(str(step_dir), "skipped", "uncommitted", notes=[note])
    raise CheckpointReadError(
        f"{step_dir}: neither items/ nor model_params/ found; not a checkpoint step."
    )


def _write_beside(
    job: _StepJob, moved: list[str], removal: Callable | None, specs: dict, *, store: StepStore
) -> StepReport:
    """`convert_step`'s write of ``items`` beside the legacy items, under the step's lock:
    skipped if another converter wrote it meanwhile; then the legacy items removed
    (``removal``, verified first) when asked for. ``store``: the step's."""
    dest = job.dest
    try:
        with step_lock(dest, store=store):
            if detect_layout(dest, store=store) is Layout.MAXTEXT:  # converted while we waited
                return StepReport(str(dest), "skipped", "maxtext", notes=["already has items/"])
            stepdir.clean_stale_tmp(dest, store=store)
            report = _write(job, dest, store=store)
            report.notes = moved + report.notes
            if removal is not None:
                report.notes += removal(job.src, store=store, specs=specs)
            return report
    except StepLocked as e:
        return StepReport(str(dest), "locked", Layout.TUNIX.value, notes=[str(e)])


def _already_converted(
    step_dir: epath.Path,
    dest: epath.Path,
    *,
    store: StepStore,
    dest_store: StepStore,
    dry_run: bool,
    finish_removal: bool,
) -> StepReport:
    """The report of a step that already has ``items/`` (at ``dest`` or in place). A real
    run also clears what dead runs left there (their lock, a half-built destination), and
    with ``finish_removal`` finishes a run killed between its commit and its legacy removal,
    under the step lock (which also clears a dead run's lock). ``store``: ``step_dir``'s;
    ``dest_store``: ``dest``'s (``--out`` may be elsewhere)."""
    done = dest if detect_layout(dest, store=dest_store) is Layout.MAXTEXT else step_dir
    report = StepReport(str(done), "skipped", "maxtext", notes=["already has items/"])
    if dry_run:
        return report
    done_store = store if done == step_dir else dest_store
    if break_stale_lock(done, store=done_store):
        report.notes.append("removed the lock of a dead run")
    report.notes += stepdir.sweep_dead_work(done, store=done_store)
    if finish_removal and stepmeta.read_provenance(step_dir):
        try:
            with step_lock(step_dir, store=store):
                stepdir.clean_stale_tmp(step_dir, store=store)
                report.notes += legacy_removal.remove_legacy(step_dir, store=store)
        except StepLocked as e:
            return StepReport(str(step_dir), "locked", "maxtext", notes=[str(e)])
    return report


def rescans_items(step_dir: epath.PathLike) -> bool:
    """Whether a scan change of ``step_dir`` rewrites its ``items/``: a MaxText-layout step
    not converted by this library from a Tunix step (whose items/ a rerun of its conversion
    skips, as it always has): MaxText's own, or written by ``merge-lora`` or a scan change."""
    step_dir = epath.Path(step_dir)
    if detect_layout(step_dir) is not Layout.MAXTEXT:
        return False
    return (stepmeta.read_provenance(step_dir) or {}).get("source_layout") != Layout.TUNIX.value


def check_rescan_destination(
    step_dirs: Iterable[epath.PathLike],
    out: epath.PathLike | None,
    spelling: Spelling = KEYWORDS,
) -> None:
    """Refuses a scan change of MaxText-layout steps (`rescans_items`) without a separate
    destination, before anything is read or written: a step MaxText wrote is never
    rewritten in place (its items/ stay what MaxText saved, and a kill midway could leave
    neither form); the other form goes into a step of its own. ``spelling`` names the
    options as the caller wrote them.

    Raises:
      UsageError: ``out`` is None and a step of ``step_dirs`` is such a step.
    """
    if out is not None:
        return
    steps = [str(d) for d in step_dirs if rescans_items(d)]
    if steps:
        s = spelling
        flag = f"{s.out} DIR" if s is FLAGS else f"{s.out}=DIR"
        raise UsageError(
            f"{', '.join(steps)}: MaxText-layout step(s) (items/): {s.rescan} writes the other "
            f"scan form of such a step only into a separate step, never in place. Pass {flag} "
            "(the new step directory; a run's steps go under it at their relative paths; "
            "the source is only read). Nothing was written."
            + (" (--steps leaves steps out of a run.)" if s is FLAGS else "")
        )


def _rescan_maxtext(
    step_dir: epath.Path,
    target: Target,
    dest: epath.Path,
    plan: Plan | None,
    o: ConvertOptions,
    *,
    store: StepStore,
    dest_store: StepStore,
) -> StepReport:
    """A MaxText-layout step in the other scan form, into the separate step ``dest``: planned
    from its items' metadata (`plan.plan_maxtext_step`: identity moves over every leaf,
    transformed by `rescan` exactly as a Tunix step's), then written by the one writer,
    streaming, and published only once complete (`_convert_to`); the source is only read.
    ``store``: ``step_dir``'s; ``dest_store``: ``dest``'s."""
    change = dict(scan=o.rescan, optimizer=o.optimizer, plain_scan=o.plain_scan)
    plan = plan or plan_maxtext_step(step_dir, target, **change)
    optimizer = o.optimizer
    if o.dry_run:
        return StepReport.from_plan(step_dir, plan, "dry-run", optimizer, layout=Layout.MAXTEXT)
    meta, dropped = _seeded_meta(stepmeta.read(step_dir, store=store))
    job = dict(use_zarr3=o.use_zarr3, budget=o.memory_budget, copy=o.copy)
    kw = dict(in_place=False, meta=meta, numbering={}, src_store=store, maxtext=True)
    report = _convert_to(_StepJob(step_dir, dest, plan, optimizer, **job, **kw), store=dest_store)
    report.notes += [
        f"{step_dir / n}/ not carried (item '{n}' of the step, not a MaxText items/ leaf): "
        "copy it beside the new items/ if it is needed"
        for n in dropped
    ]
    return report


def _seeded_meta(meta: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The source's step metadata for the new step, naming only the ``items`` it gets (a
    Grain ``iter`` the source holds is not written there), and the items left out."""
    handlers = dict(meta.get("item_handlers") or {})
    dropped = sorted(n for n in handlers if n != MAXTEXT_ITEM)
    if not dropped:
        return meta, []
    kept = {n: h for n, h in handlers.items() if n == MAXTEXT_ITEM}
    return {**meta, "item_handlers": kept}, dropped


@dataclasses.dataclass(frozen=True)
class _StepJob:
    """One step's conversion once planned: what the writing helpers below share."""

    src: epath.Path
    dest: epath.Path
    plan: Plan
    optimizer: str
    use_zarr3: bool | None
    budget: int
    copy: bool
    in_place: bool
    meta: dict  # the source's step metadata, as read for the plan
    numbering: dict  # what the provenance records of the step's numbering (`_numbering`)
    src_store: StepStore  # ``src``'s, as the entry point decided it (``dest`` may be elsewhere)
    # A MaxText-layout source (a scan change of its items/, `_rescan_maxtext`), not a Tunix one.
    maxtext: bool = False


def _numbering(step_dir: epath.Path, renumber: bool, meta: dict) -> dict[str, Any]:
    """What the provenance records of a step in MaxText's numbering.

    ``renumber`` (a copy under ``out``): the source's number becomes MaxText's. Otherwise,
    a step sits at MaxText's number if its directory is the one for the update count it
    recorded when it was moved (`TUNIX_STEP_KEY`). ``meta``: the step's metadata.
    """
    if renumber:
        if tunix_step_number(step_dir, meta) is None:
            raise CheckpointReadError(
                f"{step_dir}: not a numbered step directory; convert it with renumber=False "
                "(--keep-step-numbers)."
            )
        return {"numbering": "maxtext", "tunix_directory": step_dir.name}
    recorded = stepmeta.recorded_tunix_step(meta)
    if recorded is not None and step_dir.name == str(maxtext_number(recorded)):
        return {"numbering": "maxtext", "tunix_directory": str(recorded)}
    return {}


def convert_placed(
    placed: renumbering.PlannedStep, target: Target, options: ConvertOptions
) -> StepReport:
    """Converts one step of a run plan (`renumbering.plan_run`) where its moves put it.

    ``options`` go to `convert_step`. A step the plan skips, refuses or found locked is
    reported so (a refusal raises its error, as the conversion would).
    """
    info, listed = placed.info, str(placed.info.path)
    if placed.skip:
        return StepReport(listed, "skipped", info.layout.value, notes=[*placed.notes, placed.skip])
    if placed.locked:
        return StepReport(listed, "locked", info.layout.value, notes=[*placed.notes, placed.locked])
    if placed.error is not None:
        raise placed.error
    dry_run = options.dry_run
    where = placed.info.path if dry_run else placed.path  # a dry run moves nothing
    report = convert_step(where, target, options, plan=placed.plan)
    would = [placed.renumbering.note(done=False)] if dry_run and placed.renumbering else []
    report.notes = [*placed.notes, *would, *report.notes]
    return report


def _convert_to(job: _StepJob, *, store: StepStore) -> StepReport:
    """Converts into a separate destination step, which appears only once complete.

    Where the store builds it in place (an object store), one converter at a time, under
    the destination's lock. ``store``: the destination's, as `convert_step` decided it."""
    if not store.builds_in_place:
        if store.dest_taken(job.dest):
            raise StepExistsError(
                f"{job.dest}: exists and is not a converted step; nothing was written. Remove "
                "it or choose another destination."
            )
        return _build_and_publish(job, store=store)
    try:
        with step_lock(job.dest, store=store):
            if detect_layout(job.dest, store=store) is Layout.MAXTEXT:
                return StepReport(str(job.dest), "skipped", "maxtext", notes=["already has items/"])
            return _build_and_publish(job, store=store)
    except StepLocked as e:
        return StepReport(str(job.dest), "locked", Layout.TUNIX.value, notes=[str(e)])


def _build_and_publish(job: _StepJob, *, store: StepStore) -> StepReport:
    """``job`` built in a new step directory and published at its destination (whose
    store is ``store``)."""
    work = stepdir.new_step_dir(job.dest, store=store)
    try:
        tunix_step = tunix_step_number(job.src, job.meta) if job.numbering else None
        stepdir.seed_destination(job.src, work, tunix_step, store=store, meta=job.meta)
        report = _write(job, work, store=store)
        if not stepdir.publish_step(work, job.dest, store=store):
            return StepReport(str(job.dest), "skipped", "maxtext", notes=["converted meanwhile"])
    except BaseException:
        stepdir.discard_step_dir(work, store=store)
        raise
    report.step_dir = str(job.dest)
    return report


# tensorstore's words for a file it could not read (cut short: OUT_OF_RANGE; deleted:
# NOT_FOUND), each naming the file
_READ_FAILED = re.compile(r"Error reading .*(local )?file")


def _write(job: _StepJob, dest: epath.Path, *, store: StepStore) -> StepReport:
    """Writes ``dest/items`` for ``job`` (``dest``: the step itself, or where a separate
    destination is built); a tensorstore I/O failure becomes an `OSError` naming it, one
    reading a file a `CheckpointReadError`. ``store``: ``dest``'s."""
    try:
        return _write_items(job, dest, store=store)
    except (LayoutMismatchError, CheckpointReadError):
        raise
    except ValueError as e:  # tensorstore reports I/O failures as ValueError
        if _READ_FAILED.search(str(e)):  # names the file: a source cut short or deleted
            raise CheckpointReadError(
                f"{dest}: a file of the source could not be read, nothing was committed: {e}. "
                "The source changed while it was read (a data file cut short or deleted by "
                "another process?): convert again once the step is complete."
            ) from e
        full = "No space left" in str(e) or "RESOURCE_EXHAUSTED" in str(e)
        raise OSError(
            errno.ENOSPC if full else errno.EIO,
            f"{dest}: writing items/ failed; nothing was committed and the source is intact: {e}",
        ) from e


def _write_items(job: _StepJob, dest: epath.Path, *, store: StepStore) -> StepReport:
    src, plan = job.src, job.plan
    layout = Layout.MAXTEXT if job.maxtext else Layout.TUNIX
    report = StepReport.from_plan(dest, plan, "converted", job.optimizer, layout=layout)
    if job.maxtext:
        sources = {MAXTEXT_ITEM: src / MAXTEXT_ITEM}
        prov = rescan_provenance(plan, job.optimizer, src, store=job.src_store)
    else:
        items = tunix_items(src, store=job.src_store)
        sources = {n: d for n, d in items.items() if plan.moves_from(n)}
        sources.setdefault(TUNIX_PARAMS_ITEM, src / TUNIX_PARAMS_ITEM)
        prov = provenance(plan, job.optimizer) | job.numbering
        prov |= {"source": str(src)} if src != dest else {}
    zarr3 = job.use_zarr3
    main = sources.get(TUNIX_PARAMS_ITEM) or sources[MAXTEXT_ITEM]
    if zarr3 is not None and zarr3 != ItemFiles.read(main, store=job.src_store).use_zarr3:
        report.notes.append(f"re-encoded as {'zarr3' if zarr3 else 'zarr2'}")
    written = write_items(
        dest,
        plan,
        sources,
        provenance=prov,
        budget=job.budget,
        in_place=job.in_place,
        use_zarr3=zarr3,
        copy=job.copy,
        step_meta=job.meta if src == dest else None,
        store=store,
    )
    report.bytes_written, report.data_files = written
    return report


def provenance(plan: Plan, optimizer: str) -> dict[str, Any]:
    """What a converted step records of its conversion: enough for `verify` to replay it."""
    scan = {"scan": plan.scan, "scan_axes": dict(plan.scan_axes)} if plan.scan else {}
    return provenance_record(
        plan, Layout.TUNIX.value, optimizer=optimizer, step_source=plan.step_source, **scan
    )


def rescan_provenance(
    plan: Plan, optimizer: str, source: epath.Path, *, store: StepStore
) -> dict[str, Any]:
    """What a scan change of a MaxText step records (`_rescan_maxtext`): its source step,
    absolute (the output is a separate step), and the plan's scan change and layer axes,
    for `verify` to replay it (`verify.replay_rescan`). ``store``: ``source``'s."""
    return provenance_record(
        plan,
        Layout.MAXTEXT.value,
        optimizer=optimizer,
        source=store.absolute(source),
        scan=plan.scan,
        scan_axes=dict(plan.scan_axes),
    )


def converted_provenance(step_dir: epath.PathLike) -> dict[str, Any] | None:
    """The provenance this library recorded for a converted step, or None for a native one."""
    return stepmeta.read_provenance(step_dir)


def to_maxtext_items(
    model_params: Mapping[str, Any],
    optimizer_state: Mapping[str, Any] | None,
    target: Target,
    *,
    optimizer: OptimizerMode = "convert",
    step: int | None = None,
    ignore: Iterable[str] = (),
) -> dict[str, Any]:
    """Converts in-memory Tunix trees (as Orbax restores them) into MaxText items.

    Returns ``{"params": {"params": ...}, "nnx_aux": {"model": ...}, "opt_state": ...,
    "step": int32}``. PRNG keys stay typed. ``step`` is needed only when
    ``optimizer_state`` is None.
    """
    srcs = {TUNIX_PARAMS_ITEM: _flat(model_params)}
    if optimizer_state is not None:
        srcs[TUNIX_OPT_ITEM] = _flat(optimizer_state)
    specs = {name: {p: spec_of(x) for p, x in flat.items()} for name, flat in srcs.items()}
    plan = make_plan(
        specs[TUNIX_PARAMS_ITEM],
        specs.get(TUNIX_OPT_ITEM),
        target,
        optimizer_mode=optimizer,
        step=step,
        ignore=ignore,
    )
    return assemble(plan, srcs)


def _flat(tree: Any) -> dict:
    leaves = flatten(tree, is_leaf=lambda x: isinstance(x, jax.Array) or hasattr(x, "dtype"))
    return {tuple(norm_key(k) for k in p): x for p, x in leaves.items()}
