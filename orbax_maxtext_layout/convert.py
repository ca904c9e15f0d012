"""`convert_step` and `to_maxtext_items`: the core conversion, over `plan` and `engine`."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import jax
from etils import epath

from ._tree import Path, flatten, keystr, norm_key
from ._version import __version__
from .engine import TMP_SUFFIX, assemble, read_sources, source_items, write_items
from .errors import CheckpointReadError, LayoutMismatchError
from .layout import (
    MAXTEXT_ITEM,
    STEP_METADATA,
    TUNIX_OPT_ITEM,
    TUNIX_PARAMS_ITEM,
    Layout,
    detect_layout,
    read_provenance,
    read_step_metadata,
)
from .lock import ReadOnlyStepError, StepLocked, break_stale_lock, step_lock
from .plan import OptimizerMode, Plan, make_plan
from .rescan import plan_rescan, write_pieces
from .spec import read_specs, spec_of
from .stream import DEFAULT_BUDGET, stream_items
from .target import Target
from .verify import verify_step


@dataclasses.dataclass
class StepReport:
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

    @classmethod
    def from_plan(cls, step_dir: epath.Path, plan: Plan, status: str, optimizer: str) -> StepReport:
        return cls(
            step_dir=str(step_dir),
            status=status,
            layout=Layout.TUNIX.value,
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

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
            lines.append(f"  bytes written: {self.bytes_written:,}")
        return "\n".join(lines)


def plan_step(
    step_dir: epath.PathLike,
    target: Target,
    *,
    optimizer: OptimizerMode = "convert",
    ignore: Iterable[str] = (),
    unnamed: Literal["error", "skip"] = "error",
    allow_missing: Callable[[Path], bool] | None = None,
    read_optimizer: bool = True,
) -> Plan:
    """Plans the conversion of one Tunix-layout step from Orbax metadata alone.

    ``read_optimizer=False`` never opens ``optimizer_state`` (a params-only restore);
    the plan's step then falls back to the step number, or 0 if the directory has none.
    """
    step_dir = epath.Path(step_dir)
    items = source_items(step_dir)
    params = read_specs(items[TUNIX_PARAMS_ITEM])
    read_opt = read_optimizer and TUNIX_OPT_ITEM in items
    opt = read_specs(items[TUNIX_OPT_ITEM]) if read_opt else None
    step = _tunix_step_number(step_dir)
    if step is None and not read_optimizer:
        step = 0
    return make_plan(
        params,
        opt,
        target,
        optimizer_mode=optimizer,
        step=step,
        ignore=ignore,
        unnamed=unnamed,
        allow_missing=allow_missing,
    )


def _tunix_step_number(step_dir: epath.Path) -> int | None:
    """The Tunix step number: recorded by the manager when it moved the step, else the name."""
    from .manager import TUNIX_STEP_KEY

    custom = read_step_metadata(step_dir).get("custom_metadata") or {}
    if isinstance(custom.get(TUNIX_STEP_KEY), int):
        return custom[TUNIX_STEP_KEY]
    return int(step_dir.name) if step_dir.name.isdigit() else None


def convert_step(
    step_dir: epath.PathLike,
    target: Target,
    *,
    dry_run: bool = False,
    optimizer: OptimizerMode = "convert",
    ignore: Iterable[str] = (),
    use_zarr3: bool | None = None,
    memory_budget: int = DEFAULT_BUDGET,
    in_place: bool = False,
    remove_legacy: bool = False,
    out: epath.PathLike | None = None,
    rescan: Literal["unroll", "stack"] | None = None,
) -> StepReport:
    """Converts a Tunix-layout step into ``<step_dir>/items`` (MaxText's layout).

    The new item is written atomically beside the legacy ``model_params``/
    ``optimizer_state`` (or, with ``out``, as ``<out>/items`` of a separate step
    directory, leaving the source step entirely untouched, e.g. when it is
    read-only). No array is decoded: the source databases are cloned into the new
    item and grafted under their new names (see `stream.stream_items`); memory
    stays under ``memory_budget`` plus the largest array. ``use_zarr3`` different
    from the source re-encodes every array. ``in_place`` clones with hard links
    (next to no bytes written; the legacy files are never modified) and then
    removes the legacy items; ``remove_legacy`` removes them after a copy. Legacy
    items are removed only after the new ``items`` has been verified. A step that
    already has ``items/`` is skipped; one being converted by another live process
    is reported as ``locked``. ``rescan="unroll"``/``"stack"`` writes the other scan
    form (the target is given in that form; see `rescan`), re-slicing each array
    on its own layer axis, one array at a time.

    Raises:
      LayoutMismatchError: target and checkpoint disagree (nothing is written).
      CheckpointReadError: the step is not a readable Tunix-layout step.
      ReadOnlyStepError: the step directory cannot be written (use ``out``), or
        ``in_place``/``remove_legacy`` were asked together with ``out``.
    """
    step_dir = epath.Path(step_dir)
    dest = epath.Path(out) if out is not None else step_dir
    if out is not None and (in_place or remove_legacy):
        raise ReadOnlyStepError(
            f"{step_dir}: in_place/remove_legacy modify the source step; they cannot be "
            f"combined with a separate destination ({dest})."
        )
    layout = detect_layout(step_dir)
    if layout is Layout.MAXTEXT or detect_layout(dest) is Layout.MAXTEXT:
        done = dest if detect_layout(dest) is Layout.MAXTEXT else step_dir
        report = StepReport(str(done), "skipped", "maxtext", notes=["already has items/"])
        prov = read_provenance(step_dir)
        if not dry_run and break_stale_lock(done):
            report.notes.append("removed the lock of a dead run")
        if (in_place or remove_legacy) and not dry_run and prov:
            # Finish a run killed between its commit and the legacy removal, under the
            # step lock (which also clears a dead run's lock).
            try:
                with step_lock(step_dir):
                    _clean_stale_tmp(step_dir)
                    report.notes += _remove_legacy(step_dir, linked=bool(prov.get("in_place")))
            except StepLocked as e:
                return StepReport(str(step_dir), "locked", "maxtext", notes=[str(e)])
        return report
    if layout is Layout.UNKNOWN:
        raise CheckpointReadError(
            f"{step_dir}: neither items/ nor model_params/ found; not a checkpoint step."
        )
    if rescan is not None:
        if in_place:
            raise ValueError("in_place cannot change the scan form: every array is re-sliced")
        plan, pieces = plan_rescan(step_dir, target, rescan, optimizer=optimizer, ignore=ignore)
    else:
        plan, pieces = plan_step(step_dir, target, optimizer=optimizer, ignore=ignore), None
    if dry_run:
        return StepReport.from_plan(step_dir, plan, "dry-run", optimizer)
    if out is not None:
        _seed_destination(step_dir, dest)
    try:
        with step_lock(dest):
            if detect_layout(dest) is Layout.MAXTEXT:  # converted while we waited
                return StepReport(str(dest), "skipped", "maxtext", notes=["already has items/"])
            _clean_stale_tmp(dest)
            if pieces is not None:
                report = StepReport.from_plan(dest, plan, "converted", optimizer)
                report.notes.append(f"{len(pieces)} arrays written in {rescan}ed form")
                casts = {m.dst: m.cast for m in plan.moves if m.cast is not None}
                report.bytes_written = write_pieces(
                    step_dir, dest, plan, pieces, provenance=_provenance(report), cast=casts
                )
            else:
                report = _write(step_dir, dest, plan, optimizer, use_zarr3, memory_budget, in_place)
            if in_place or remove_legacy:
                report.notes += _remove_legacy(step_dir, linked=in_place)
            return report
    except StepLocked as e:
        return StepReport(str(dest), "locked", layout.value, notes=[str(e)])


def _seed_destination(step_dir: epath.Path, dest: epath.Path) -> None:
    """A separate destination step starts with the source's step metadata."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in (STEP_METADATA, "commit_success.txt"):
        if (step_dir / name).exists() and not (dest / name).exists():
            (step_dir / name).copy(dest / name)


def _write(src, dest, plan, optimizer, use_zarr3, budget, in_place) -> StepReport:
    try:
        return _write_items(src, dest, plan, optimizer, use_zarr3, budget, in_place)
    except (LayoutMismatchError, CheckpointReadError):
        raise
    except ValueError as e:  # tensorstore reports I/O failures as ValueError
        full = "No space left" in str(e) or "RESOURCE_EXHAUSTED" in str(e)
        raise OSError(
            errno.ENOSPC if full else errno.EIO,
            f"{dest}: writing items/ failed; nothing was committed and the source is intact: {e}",
        ) from e


def _write_items(src, dest, plan, optimizer, use_zarr3, budget, in_place) -> StepReport:
    report = StepReport.from_plan(dest, plan, "converted", optimizer)
    sources = {n: d for n, d in source_items(src).items() if plan.moves_from(n)}
    sources.setdefault(TUNIX_PARAMS_ITEM, src / TUNIX_PARAMS_ITEM)
    src_zarr3 = _source_zarr3(src / TUNIX_PARAMS_ITEM)
    prov = _provenance(report) | ({"source": str(src)} if src != dest else {})
    if use_zarr3 is None or use_zarr3 == src_zarr3:
        report.bytes_written = stream_items(
            dest, plan, sources, provenance=prov, budget=budget, in_place=in_place
        )
    else:  # a format change re-encodes everything anyway
        report.notes.append(f"re-encoded as {'zarr3' if use_zarr3 else 'zarr2'}")
        tree = assemble(plan, read_sources(src, plan))
        report.bytes_written = write_items(dest, tree, use_zarr3=use_zarr3, provenance=prov)
    return report


REMOVING = ".orbax-maxtext-layout-removing"  # a verified legacy item being deleted


def _remove_legacy(step_dir: epath.Path, *, linked: bool = False) -> list[str]:
    """Deletes the legacy items of a converted step, only once ``items`` verifies.

    After an in-place conversion ``items`` holds hard links to the very same data
    files, so the check is metadata plus stored-data presence; after a copy every
    value is compared. A verified item is first renamed aside (atomic), then
    deleted, so a kill mid-deletion never leaves a half-deleted legacy item that
    reads as a checkpoint; a rerun finishes the deletion. A symlinked legacy item
    loses only its link: nothing outside the step is ever deleted.
    """
    notes = _finish_removal(step_dir)
    present = [n for n in (TUNIX_PARAMS_ITEM, TUNIX_OPT_ITEM) if _exists(step_dir / n)]
    if not present:
        return notes
    result = verify_step(step_dir, quick=linked)
    if not result.ok:
        return [*notes, f"legacy items kept: verification failed: {result.problems[:3]}"]
    for name in present:
        item = step_dir / name
        if os.path.islink(str(item)):
            os.unlink(str(item))  # the link only; its target is outside this step
        else:
            item.rename(step_dir / f"{name}{REMOVING}")
    _finish_removal(step_dir)
    return [*notes, f"removed legacy {', '.join(present)} after verifying items"]


def _exists(p: epath.Path) -> bool:
    return p.exists() or os.path.islink(str(p))


def _finish_removal(step_dir: epath.Path) -> list[str]:
    done = []
    for child in step_dir.iterdir():
        if child.name.endswith(REMOVING):
            child.rmtree()
            done.append(child.name.removesuffix(REMOVING))
    return [f"finished removing verified legacy {', '.join(done)}"] if done else []


def _clean_stale_tmp(step_dir: epath.Path) -> None:
    # Under the step lock, leftovers can only come from a dead run: an items tmp dir,
    # or the temporary file of a step-metadata replace.
    for child in step_dir.iterdir():
        if child.name.startswith(MAXTEXT_ITEM + TMP_SUFFIX):
            child.rmtree()
        elif child.name.startswith(f".{STEP_METADATA}.") and child.name.endswith(".tmp"):
            child.unlink()


def restore_as_items(
    step_dir: epath.PathLike,
    target: Target,
    *,
    optimizer: OptimizerMode = "convert",
    ignore: Iterable[str] = (),
) -> dict[str, Any]:
    """Restores a Tunix-layout step directly as MaxText items, in memory.

    Reads only the leaves the plan moves; a leaf whose target abstract value has a
    sharding is restored with that sharding. This is what the handler and the
    manager use for a transparent restore.
    """
    step_dir = epath.Path(step_dir)
    plan = plan_step(step_dir, target, optimizer=optimizer, ignore=ignore)
    return assemble(plan, read_sources(step_dir, plan, target.abstract))


def _provenance(report: StepReport) -> dict[str, Any]:
    return {
        "source_layout": Layout.TUNIX.value,
        "converter_version": __version__,
        "rules": report.rules,
        "optimizer": report.optimizer,
        "step_source": report.step_source,
        "dropped": [
            {"path": f"{d['item']}/{d['path']}", "reason": d["reason"]} for d in report.dropped
        ],
    }


def _source_zarr3(item_dir: epath.Path) -> bool:
    try:
        return bool(json.loads((item_dir / "_METADATA").read_text()).get("use_zarr3", False))
    except ValueError as e:
        raise CheckpointReadError(f"{item_dir}/_METADATA: invalid JSON ({e}).") from e


def converted_provenance(step_dir: epath.PathLike) -> dict[str, Any] | None:
    """The provenance this library recorded for a converted step, or None for a native one."""
    return read_provenance(step_dir)


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
