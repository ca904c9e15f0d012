"""Find checkpoint steps and tell their layout from directory names alone.

Detection never looks at handler type strings: the Orbax v0 and v1 Tunix
writers record different ones, and Orbax itself rewrites ``_src`` paths.
"""

from __future__ import annotations

import enum
import re
from typing import Any

from etils import epath

from ..base.step_entries import MAXTEXT_ITEM, ROLES, TUNIX_OPT_ITEM, TUNIX_PARAMS_ITEM
from ..storage.store import StepStore, store_for
from . import stepmeta
from .stepmeta import recorded_tunix_step

__all__ = [  # the item names are re-exported: layout is where a reader looks for them
    "MAXTEXT_ITEM",
    "ROLES",
    "TUNIX_OPT_ITEM",
    "TUNIX_PARAMS_ITEM",
    "Layout",
    "detect_layout",
    "is_committed",
    "maxtext_number",
    "step_dir_of",
    "tunix_items",
    "tunix_step_number",
]

STEP_NAME = re.compile(r"^\d+$")
TMP_MARKER = ".orbax-checkpoint-tmp"


class Layout(enum.Enum):
    TUNIX = "tunix"
    MAXTEXT = "maxtext"
    UNKNOWN = "unknown"


def detect_layout(step_dir: epath.PathLike, *, store: StepStore | None = None) -> Layout:
    """MAXTEXT if ``items/`` exists, TUNIX if ``model_params/`` exists without it, else UNKNOWN.

    Reads directory names only (and, on an object store, whether the step and its
    ``items/`` have their commit markers: see `is_committed`). A step holding both
    (converted beside its legacy items) is MAXTEXT: ``items/`` is what MaxText reads.
    ``store``: the root's, as the caller decided it (else decided here).
    """
    step_dir = epath.Path(step_dir)
    store = store or store_for(step_dir)
    # On an object store items/ is written in place: it exists, incomplete, until its
    # commit marker (its last object) does. On a disk it appears whole, by a rename.
    if store.item_committed(step_dir / MAXTEXT_ITEM):
        layout = Layout.MAXTEXT
    elif store.is_dir(step_dir / TUNIX_PARAMS_ITEM):
        layout = Layout.TUNIX
    else:
        return Layout.UNKNOWN
    return layout if store.step_committed(step_dir) else Layout.UNKNOWN


def is_committed(step_dir: epath.PathLike, *, store: StepStore) -> bool:
    """Whether a step directory is a finished step.

    On an object store, as for Orbax, only once its ``commit_success.txt`` exists:
    without it, it is a save, a move or an ``--out`` in progress (or a dead one). On a
    disk a step directory appears whole (Orbax renames it into place). ``store``: the
    root's, as the caller decided it.
    """
    step_dir = epath.Path(step_dir)
    return store.step_committed(step_dir)


def tunix_items(
    step_dir: epath.PathLike, *, store: StepStore | None = None
) -> dict[str, epath.Path]:
    """The legacy items of a Tunix-layout step: ``model_params`` and, if present, the optimizer."""
    step_dir = epath.Path(step_dir)
    out = {TUNIX_PARAMS_ITEM: step_dir / TUNIX_PARAMS_ITEM}
    if (store or store_for(step_dir)).is_dir(step_dir / TUNIX_OPT_ITEM):
        out[TUNIX_OPT_ITEM] = step_dir / TUNIX_OPT_ITEM
    return out


def tunix_step_number(step_dir: epath.PathLike, meta: dict[str, Any] | None = None) -> int | None:
    """The Tunix step (optimizer updates done) a legacy step directory holds.

    Recorded under `TUNIX_STEP_KEY` when a manager moved the step to MaxText's
    number, else the directory's name; None for a non-numeric name. ``meta`` is the
    step metadata if already read.
    """
    step_dir = epath.Path(step_dir)
    recorded = recorded_tunix_step(stepmeta.read(step_dir) if meta is None else meta)
    if recorded is not None:
        return recorded
    return int(step_dir.name) if STEP_NAME.match(step_dir.name) else None


def maxtext_number(tunix_step: int) -> int:
    """The MaxText directory number of the state after ``tunix_step`` updates.

    MaxText saves after the update: its directory ``N`` holds ``items/step == N + 1``.
    """
    return tunix_step - 1


def step_dir_of(path: epath.PathLike) -> epath.Path:
    """The step directory for a step, ``items``, ``model_params`` or ``optimizer_state`` path."""
    path = epath.Path(path)
    if path.name in (MAXTEXT_ITEM, TUNIX_PARAMS_ITEM, TUNIX_OPT_ITEM):
        return path.parent
    return path
