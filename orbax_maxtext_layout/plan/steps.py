"""The steps of a run: `find_steps` lists them (``<n>``, ``actor/<n>``, ``critic/<n>``) as
`StepInfo` records, each with its layout and, read on first use, its LoRA adapters.

Built on `layout` (what one step directory is) and `lora` (what an adapter step holds), so
that neither of those reaches up here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from etils import epath

from ..model.lora import adapters_in
from ..orbax_io import stepmeta
from ..orbax_io.layout import ROLES, STEP_NAME, TMP_MARKER, TUNIX_PARAMS_ITEM, Layout, detect_layout


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
        custom = stepmeta.read(self.path).get("custom_metadata")
        return adapters_in(self.path / TUNIX_PARAMS_ITEM, custom)  # metadata only


def _steps_in(folder: epath.Path, role: str | None) -> list[StepInfo]:
    out = []
    if not folder.is_dir():
        return out
    for child in folder.iterdir():
        # Interrupted saves leave "<n>.orbax-checkpoint-tmp-*"; they are never steps.
        if TMP_MARKER in child.name or not STEP_NAME.match(child.name) or not child.is_dir():
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
        number = int(root.name) if STEP_NAME.match(root.name) else -1
        return [StepInfo(root, number, layout, role)]
    found = _steps_in(root, None)
    for role in ROLES if roles else ():
        found += _steps_in(root / role, role)
    return sorted(found, key=lambda s: (s.role is not None, s.role or "", s.step))


def find_step_roots(root: epath.PathLike, *, depth: int = 3) -> list[epath.Path]:
    """The shallowest directories below ``root`` (not ``root`` itself) that hold steps.

    For a hint when ``root`` holds none: a run directory keeps them in ``checkpoints/``.
    """
    level = [epath.Path(root)]
    for _ in range(depth):
        level = [c for d in level if d.is_dir() for c in sorted(d.iterdir()) if c.is_dir()]
        found = [d for d in level if TMP_MARKER not in d.name and find_steps(d)]
        if found:
            return found
    return []
