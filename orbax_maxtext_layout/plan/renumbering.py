"""A run's renumbering, planned once: which Tunix step directories move to MaxText's numbers.

Tunix directory ``N`` holds the state after ``N`` updates; MaxText keeps that state in
directory ``N - 1``. Renumbering is a property of the run, not of one step: in a run of
Tunix ``1, 2, 3``, ``2`` can move to ``1`` only once ``1`` has moved to ``0``. So the moves
of a directory of steps are planned together (`plan_renumbering`, from directory names and step
metadata only), in the order the real run makes them, and a move is refused only where its
MaxText number stays taken (a MaxText step, Tunix's initial state ``0``, a step that cannot
move). The dry run reports that plan; the real run makes it (`apply_renumbering`) under the
directory's renumber lock, planning again from what it finds there: another converter may
have made some of the moves already, so any number of converters can run at once and each
step is moved exactly once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

from etils import epath

from ..errors import (
    CheckpointReadError,
    OrbaxMaxTextLayoutError,
    StepExistsError,
    StepLocked,
    detached,
)
from ..orbax_io import stepdir, stepmeta
from ..orbax_io.layout import Layout, maxtext_number, tunix_step_number
from ..storage.lock import RENUMBER_LOCK_NAME, holder, step_lock
from ..storage.store import StepStore
from .moves import Plan
from .steps import StepInfo, find_steps

TUNIX_ZERO = (
    "Tunix directory 0 holds the state before any update; MaxText numbers a directory by the "
    "updates done minus one, so it has no directory for it. Not converted; use "
    "--keep-step-numbers (renumber=False) to convert it as directory 0."
)
_LOCK_WAIT = 60.0


@dataclasses.dataclass(frozen=True)
class Renumbering:
    """Tunix directory ``src`` (the state after ``tunix_step`` updates) moves to ``dst``."""

    src: epath.Path
    dst: epath.Path
    tunix_step: int

    def note(self, *, done: bool, by_other: bool = False) -> str:
        verb = "moved" if done else "would move"
        who = " by another converter" if by_other else ""
        return (
            f"Tunix directory {self.src.name} {verb} to {self.dst.name}{who} (MaxText's number "
            f"for the state after {self.tunix_step} updates)"
        )


@dataclasses.dataclass(frozen=True)
class PlannedStep:
    """One listed step and where it is converted: ``path``, once ``renumbering`` (if any) is made.

    ``tunix`` is the update count of a Tunix step (its identity while it moves); ``skip``
    says why it is not converted (Tunix's initial state); ``error`` why its move is refused;
    ``locked`` that another live process holds it; ``notes`` what happened to it; ``plan``
    its conversion plan.
    """

    info: StepInfo
    path: epath.Path
    tunix: int | None = None
    renumbering: Renumbering | None = None
    skip: str | None = None
    error: OrbaxMaxTextLayoutError | None = None
    locked: str | None = None
    notes: tuple[str, ...] = ()
    plan: Plan | None = None  # the step's conversion plan (metadata only)


def plan_run(
    infos: Sequence[StepInfo],
    plan_of: Callable[[epath.Path], Plan],
    *,
    store: StepStore,
    renumber: bool = True,
) -> list[PlannedStep]:
    """The run plan: each Tunix step's conversion plan (``plan_of``, metadata only), then
    the moves that give the steps MaxText's numbers (`plan_renumbering`).

    A step whose conversion cannot be planned (a wrong target, a LoRA adapter step, a
    damaged item) carries that error and does not move: planned before anything moves,
    a step that does not fit stays where it is (and holds its number). ``renumber=False``
    plans no move (Tunix's numbers kept). ``store``: the run's root's, as the caller
    decided it.
    """
    plans: dict[epath.Path, Plan] = {}
    errors: dict[epath.Path, OrbaxMaxTextLayoutError] = {}
    for info in infos:
        if info.layout is Layout.TUNIX:
            try:
                plans[info.path] = plan_of(info.path)
            except OrbaxMaxTextLayoutError as e:
                errors[info.path] = detached(e)  # kept: no frame of this call behind it
    movable = [i for i in infos if i.path not in errors]
    if renumber:
        known = {d: p.step for d, p in plans.items()}  # the update count each plan was read for
        placed = {p.info.path: p for p in plan_renumbering(movable, known, store=store)}
    else:
        placed = {i.path: PlannedStep(i, i.path) for i in movable}
    out = []
    for info in infos:
        if info.path in errors:
            tunix = _tunix_of(info)
            out.append(PlannedStep(info, info.path, tunix, error=errors[info.path]))
        else:
            p = placed[info.path]
            out.append(dataclasses.replace(p, plan=plans.get(info.path)) if p.skip is None else p)
    return out


def plan_renumbering(
    infos: Sequence[StepInfo],
    known: Mapping[epath.Path, int | None] | None = None,
    *,
    store: StepStore,
) -> list[PlannedStep]:
    """Where each step of ``infos`` is converted, and the moves that take it there.

    Metadata only (directory names, step metadata); nothing is moved. Steps are handled per
    directory of steps in ascending MaxText number, so a chain ``1->0, 2->1, 3->2`` is
    three moves. A move is refused where its destination is taken by a directory that does
    not move away first; steps not in ``infos`` stay where they are. ``known`` gives the
    update count of a step where it was read together with its conversion plan (the plan's
    step), so that a step and its plan stay one even if the directory changed meanwhile.
    ``store``: the root's (every directory of steps lies under it), as the caller decided it.
    """
    known = known or {}
    out: dict[epath.Path, PlannedStep] = {}
    for folder, members in _by_folder(infos).items():
        occupied = {s.step for s in find_steps(folder, roles=False)}
        held: set[int] = set()  # directories another live process holds where they are
        todo = []
        for info in members:
            # The count read with the step's plan first: the directory may have been moved
            # by another converter since (its metadata gone from this path).
            tunix = known[info.path] if info.path in known else _tunix_of(info)
            if tunix is None or not info.path.name.isdigit():
                out[info.path] = PlannedStep(info, info.path)  # converted where it is, or skipped
            elif tunix < 1:
                out[info.path] = PlannedStep(info, info.path, tunix, skip=TUNIX_ZERO)
            elif (who := holder(info.path, store=store)) is not None:
                held.add(int(info.path.name))
                out[info.path] = PlannedStep(info, info.path, tunix, locked=who)
            else:
                todo.append((maxtext_number(tunix), tunix, info))
        for home, tunix, info in sorted(todo, key=lambda t: (t[0], t[2].step)):
            here, dst = int(info.path.name), folder / str(home)
            if here == home:
                out[info.path] = PlannedStep(info, info.path, tunix)
            elif home in held:
                held.add(here)  # waits where it is, and so do the steps behind it
                why = f"{dst} is held by another process; a later run renumbers {info.path.name}"
                out[info.path] = PlannedStep(info, info.path, tunix, locked=why)
            elif home in occupied:
                out[info.path] = PlannedStep(
                    info,
                    info.path,
                    tunix,
                    error=stepdir.renumber_refusal(info.path, dst, store=store),
                )
            else:
                occupied.discard(here)
                occupied.add(home)
                out[info.path] = PlannedStep(info, dst, tunix, Renumbering(info.path, dst, tunix))
    return [out[i.path] for i in infos]


def _tunix_of(info: StepInfo) -> int | None:
    """The update count of a listed Tunix step, even if it was moved away meanwhile."""
    if info.layout is not Layout.TUNIX or not info.path.name.isdigit():
        return None
    try:
        return tunix_step_number(info.path)
    except OrbaxMaxTextLayoutError:
        return int(info.path.name)


def _by_folder(infos: Iterable[StepInfo]) -> dict[epath.Path, list[StepInfo]]:
    out: dict[epath.Path, list[StepInfo]] = {}
    for info in infos:
        out.setdefault(info.path.parent, []).append(info)
    return out


def apply_renumbering(
    planned: Sequence[PlannedStep],
    plan_of: Callable[[epath.Path], Plan] | None = None,
    *,
    store: StepStore,
) -> list[PlannedStep]:
    """Makes the moves of a `plan_renumbering` plan, under each directory's renumber lock.

    Plans again under the lock from what is there now: a step another converter has moved
    meanwhile is found by its update count (and its note says so); a step another process
    holds is ``locked``, and so is a step whose MaxText number that one still occupies. On
    an object store, a move killed earlier is finished or rolled back first. A step whose
    metadata could not be read while planning (another converter was moving it) is planned
    again there with ``plan_of``. Returns the placements as made, in the order of
    ``planned``, each with its listed ``info``.
    """
    out: dict[epath.Path, PlannedStep] = {}
    folders: dict[epath.Path, list[PlannedStep]] = {}
    for p in planned:
        folders.setdefault(p.info.path.parent, []).append(p)
    for folder, mine in folders.items():
        try:
            with step_lock(folder, store=store, name=RENUMBER_LOCK_NAME, wait=_LOCK_WAIT):
                out.update(_apply_in(folder, mine, plan_of, store=store))
        except StepLocked as e:
            for p in mine:
                out[p.info.path] = dataclasses.replace(
                    p, path=p.info.path, renumbering=None, locked=str(e)
                )
    return [out[p.info.path] for p in planned]


def _index(folder: epath.Path) -> dict[int, StepInfo]:
    """The steps of ``folder`` by update count: a Tunix step's, or the one a converted
    step recorded when it was renumbered (`TUNIX_STEP_KEY`)."""
    out = {}
    for s in find_steps(folder, roles=False):
        if s.layout is Layout.TUNIX:
            t = tunix_step_number(s.path)
        else:
            t = stepmeta.recorded_tunix_step(stepmeta.read(s.path))
        if isinstance(t, int):
            out[t] = s
    return out


def _apply_in(
    folder: epath.Path,
    planned: Sequence[PlannedStep],
    plan_of: Callable[[epath.Path], Plan] | None,
    *,
    store: StepStore,
) -> dict[epath.Path, PlannedStep]:
    notes = store.finish_relocations(folder)  # killed moves (an object store's)

    # Planned again here: the moves (a refusal planned outside the lock may be gone), and a
    # conversion whose metadata could not be read then (another converter was moving it).
    def again(p: PlannedStep) -> bool:
        return isinstance(p.error, StepExistsError) or (
            plan_of is not None and isinstance(p.error, CheckpointReadError) and bool(p.tunix)
        )

    result = {
        p.info.path: p
        for p in planned
        if p.skip is not None or (p.error is not None and not again(p))
    }
    where = _index(folder)
    live: list[PlannedStep] = []
    now: list[StepInfo] = []
    seen: dict[epath.Path, str] = {}
    for p in planned:
        if p.info.path in result:
            continue
        loc = where.get(p.tunix) if p.tunix is not None else None
        if loc is not None and loc.path != p.info.path:
            seen[loc.path] = f"found at {loc.path.name}: moved meanwhile by another converter"
        here = loc or p.info
        if isinstance(p.error, CheckpointReadError) and plan_of is not None:
            try:
                plan = plan_of(here.path) if here.layout is Layout.TUNIX else None
            except OrbaxMaxTextLayoutError as e:
                result[p.info.path] = dataclasses.replace(p, error=detached(e))
                continue
            p = dataclasses.replace(p, plan=plan)
        live.append(dataclasses.replace(p, error=None))
        now.append(here)
    blocked: set[epath.Path] = set()  # directories another process holds where they are
    known = {i.path: p.tunix for p, i in zip(live, now, strict=True) if i.layout is Layout.TUNIX}
    for p, q in zip(live, plan_renumbering(now, known, store=store), strict=True):
        extra = [*notes, *([seen[q.info.path]] if q.info.path in seen else [])]
        notes = []  # the folder's notes go with its first step
        if q.renumbering is not None and q.renumbering.dst in blocked:
            why = f"{q.renumbering.dst} is held by another process; a later run renumbers this step"
            q = dataclasses.replace(q, path=q.info.path, renumbering=None, locked=why)
        elif q.renumbering is not None:
            try:
                stepdir.renumber_step(
                    q.renumbering.src, q.renumbering.dst, q.renumbering.tunix_step, store=store
                )
            except StepLocked as e:
                blocked.add(q.renumbering.src)
                q = dataclasses.replace(q, path=q.info.path, renumbering=None, locked=str(e))
            else:
                extra.append(q.renumbering.note(done=True))
        result[p.info.path] = dataclasses.replace(
            q, info=p.info, plan=p.plan, notes=(*q.notes, *extra)
        )
    return result
