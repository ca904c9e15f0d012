"""The options of a conversion that cannot go together, checked in one place.

`convert_step` checks its keyword arguments with `check` before anything is read or moved;
the CLI checks its flags with the same function (``spelling=FLAGS``), before it builds the
target, so the refusal names the options as the caller wrote them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from ..errors import ReadOnlyStepError, UsageError

__all__ = ["FLAGS", "KEYWORDS", "ConvertOptions", "Spelling", "check"]


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """Where a conversion writes, and what it does to the source step (`convert_step`'s
    keyword arguments of the same names)."""

    in_place: bool = False
    copy: bool = False
    remove_legacy: bool = False
    out: str | os.PathLike[str] | None = None
    rescan: Literal["unroll", "stack"] | None = None


@dataclasses.dataclass(frozen=True)
class Spelling:
    """How a refusal names each option: as `convert_step`'s keywords, or as the CLI's flags."""

    in_place: str
    copy: str
    remove_legacy: str
    out: str
    rescan: str


KEYWORDS = Spelling("in_place", "copy", "remove_legacy", "out", "rescan")
FLAGS = Spelling("--in-place", "--copy", "--remove-legacy", "--out", "--unroll/--stack")


def check(
    options: ConvertOptions, where: str | os.PathLike[str], spelling: Spelling = KEYWORDS
) -> None:
    """Refuses options that cannot go together; ``where`` is the step (or run root) asked for.

    Raises:
      UsageError: ``in_place`` with ``rescan`` (every array is re-sliced), or with ``copy``
        (in place means sharing the data files).
      ReadOnlyStepError: ``in_place`` or ``remove_legacy`` with ``out`` (they modify the
        source step, which ``out`` leaves untouched).
    """
    s = spelling
    if options.rescan is not None and options.in_place:
        raise UsageError(
            f"{where}: {s.in_place} cannot change the scan form ({s.rescan}): every array is "
            f"re-sliced. Drop {s.in_place} ({s.remove_legacy} still removes the legacy items "
            "once items/ verifies)."
        )
    if options.copy and options.in_place:
        raise UsageError(
            f"{where}: {s.in_place} shares the legacy data files; {s.copy} makes private "
            f"copies. Choose one ({s.copy} with {s.remove_legacy} copies, then removes the "
            "legacy items)."
        )
    if options.out is not None and (options.in_place or options.remove_legacy):
        raise ReadOnlyStepError(
            f"{where}: {s.in_place}/{s.remove_legacy} modify the source step; they cannot be "
            f"combined with a separate destination ({options.out}), which leaves the source "
            f"untouched. Drop {s.out} to convert the source itself, or drop "
            f"{s.in_place}/{s.remove_legacy}."
        )
