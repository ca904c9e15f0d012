"""Find checkpoint steps and tell their layout from directory names alone.

Detection never looks at handler type strings: the Orbax v0 and v1 Tunix
writers record different ones, and Orbax itself rewrites ``_src`` paths.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import re
from typing import Any

from etils import epath

from . import objstore
from .errors import CheckpointReadError

MAXTEXT_ITEM = "items"
TUNIX_PARAMS_ITEM = "model_params"
TUNIX_OPT_ITEM = "optimizer_state"
ROLES = ("actor", "critic")
STEP_METADATA = "_CHECKPOINT_METADATA"
PROVENANCE_KEY = "orbax_maxtext_layout"  # our key in the step's custom metadata
# Recorded in a moved legacy step's custom metadata: the Tunix step (update count) it holds.
TUNIX_STEP_KEY = "orbax_maxtext_layout.tunix_step"
_STEP_NAME = re.compile(r"^\d+$")
_TMP_MARKER = ".orbax-checkpoint-tmp"


class Layout(enum.Enum):
    TUNIX = "tunix"
    MAXTEXT = "maxtext"
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One step directory under a run root.

    ``lora`` (read on first use, from metadata) is a `lora.LoraAdapters` when the step
    is a Tunix LoRA adapter step (``model_params`` holds only LoRA factors), else None.
    """

    path: epath.Path
    step: int
    layout: Layout
    role: str | None = None

    @functools.cached_property
    def lora(self) -> Any:
        if self.layout is not Layout.TUNIX:
            return None
        from .lora import adapters_in  # reads Orbax metadata: only when asked

        custom = read_step_metadata(self.path).get("custom_metadata")
        return adapters_in(self.path / TUNIX_PARAMS_ITEM, custom)


def detect_layout(step_dir: epath.PathLike) -> Layout:
    """MAXTEXT if ``items/`` exists, TUNIX if ``model_params/`` exists without it, else UNKNOWN.

    Reads directory names only (and, on an object store, whether the step and its
    ``items/`` have their commit markers: see `is_committed`). A step holding both
    (converted beside its legacy items) is MAXTEXT: ``items/`` is what MaxText reads.
    """
    step_dir = epath.Path(step_dir)
    items = step_dir / MAXTEXT_ITEM
    remote = objstore.is_remote(step_dir)
    # On an object store items/ is written in place: it exists, incomplete, until its
    # commit marker (its last object) does. On a disk it appears whole, by a rename.
    if (items / objstore.COMMIT_MARKER).exists() if remote else items.is_dir():
        layout = Layout.MAXTEXT
    elif (step_dir / TUNIX_PARAMS_ITEM).is_dir():
        layout = Layout.TUNIX
    else:
        return Layout.UNKNOWN
    if remote and not is_committed(step_dir):
        return Layout.UNKNOWN
    return layout


def is_committed(step_dir: epath.PathLike) -> bool:
    """Whether a step directory is a finished step.

    On an object store, as for Orbax, only once its ``commit_success.txt`` exists:
    without it, it is a save, a move or an ``--out`` in progress (or a dead one). On a
    disk a step directory appears whole (Orbax renames it into place).
    """
    step_dir = epath.Path(step_dir)
    return not objstore.is_remote(step_dir) or (step_dir / objstore.COMMIT_MARKER).exists()


def _steps_in(folder: epath.Path, role: str | None) -> list[StepInfo]:
    out = []
    if not folder.is_dir():
        return out
    for child in folder.iterdir():
        # Interrupted saves leave "<n>.orbax-checkpoint-tmp-*"; they are never steps.
        if _TMP_MARKER in child.name or not _STEP_NAME.match(child.name) or not child.is_dir():
            continue
        out.append(StepInfo(child, int(child.name), detect_layout(child), role))
    return out


def find_steps(root: epath.PathLike, *, roles: bool = True) -> list[StepInfo]:
    """Steps at ``<root>/<n>``, ``<root>/actor/<n>`` and ``<root>/critic/<n>``.

    Sorted by role (no role first) and then by step. Non-numeric entries and
    Orbax temporary directories are ignored. ``roles=False`` looks at ``<root>/<n>``
    only (what a checkpoint manager of ``root`` lists). A ``root`` that is itself a
    step (it holds ``items/`` or ``model_params/``) is returned alone.
    """
    root = epath.Path(root)
    layout = detect_layout(root)
    if layout is not Layout.UNKNOWN:
        role = root.parent.name if root.parent.name in ROLES else None
        number = int(root.name) if _STEP_NAME.match(root.name) else -1
        return [StepInfo(root, number, layout, role)]
    found = _steps_in(root, None)
    for role in ROLES if roles else ():
        found += _steps_in(root / role, role)
    return sorted(found, key=lambda s: (s.role is not None, s.role or "", s.step))


def tunix_items(step_dir: epath.PathLike) -> dict[str, epath.Path]:
    """The legacy items of a Tunix-layout step: ``model_params`` and, if present, the optimizer."""
    step_dir = epath.Path(step_dir)
    out = {TUNIX_PARAMS_ITEM: step_dir / TUNIX_PARAMS_ITEM}
    if (step_dir / TUNIX_OPT_ITEM).is_dir():
        out[TUNIX_OPT_ITEM] = step_dir / TUNIX_OPT_ITEM
    return out


def tunix_step_number(step_dir: epath.PathLike, meta: dict[str, Any] | None = None) -> int | None:
    """The Tunix step (optimizer updates done) a legacy step directory holds.

    Recorded under `TUNIX_STEP_KEY` when a manager moved the step to MaxText's
    number, else the directory's name; None for a non-numeric name. ``meta`` is the
    step metadata if already read.
    """
    step_dir = epath.Path(step_dir)
    custom = (read_step_metadata(step_dir) if meta is None else meta).get("custom_metadata") or {}
    recorded = custom.get(TUNIX_STEP_KEY)
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        return recorded
    return int(step_dir.name) if _STEP_NAME.match(step_dir.name) else None


def with_tunix_step(meta: dict[str, Any], tunix_step: int) -> dict[str, Any]:
    """Step metadata ``meta`` recording `TUNIX_STEP_KEY` (for a step moved to MaxText's number)."""
    custom = dict(meta.get("custom_metadata") or {})
    custom[TUNIX_STEP_KEY] = tunix_step
    return {**meta, "custom_metadata": custom}


def maxtext_number(tunix_step: int) -> int:
    """The MaxText directory number of the state after ``tunix_step`` updates.

    MaxText saves after the update: its directory ``N`` holds ``items/step == N + 1``.
    """
    return tunix_step - 1


def find_step_roots(root: epath.PathLike, *, depth: int = 3) -> list[epath.Path]:
    """The shallowest directories below ``root`` (not ``root`` itself) that hold steps.

    For a hint when ``root`` holds none: a run directory keeps them in ``checkpoints/``.
    """
    level = [epath.Path(root)]
    for _ in range(depth):
        level = [c for d in level if d.is_dir() for c in sorted(d.iterdir()) if c.is_dir()]
        found = [d for d in level if _TMP_MARKER not in d.name and find_steps(d)]
        if found:
            return found
    return []


def step_dir_of(path: epath.PathLike) -> epath.Path:
    """The step directory for a step, ``items``, ``model_params`` or ``optimizer_state`` path."""
    path = epath.Path(path)
    if path.name in (MAXTEXT_ITEM, TUNIX_PARAMS_ITEM, TUNIX_OPT_ITEM):
        return path.parent
    return path


def read_step_metadata(step_dir: epath.Path) -> dict[str, Any]:
    """The step-level ``_CHECKPOINT_METADATA`` JSON, or ``{}`` if the step has none."""
    f = epath.Path(step_dir) / STEP_METADATA
    if not f.exists():
        return {}
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError as e:  # gone since the check: moved or removed meanwhile
        raise CheckpointReadError(
            f"{f}: disappeared while being read (another process moved or removed the step?)."
            " Run again."
        ) from e
    except ValueError as e:
        raise CheckpointReadError(
            f"{f}: invalid JSON ({e}). Fix or remove the file; the arrays are not affected."
        ) from e
    if not isinstance(data, dict):
        raise CheckpointReadError(f"{f}: expected a JSON object, got {type(data).__name__}.")
    return data


def read_provenance(step_dir: epath.PathLike) -> dict[str, Any] | None:
    """What this library recorded when it converted the step, or None for a native step."""
    custom = read_step_metadata(epath.Path(step_dir)).get("custom_metadata") or {}
    return custom.get(PROVENANCE_KEY)
