"""The options of a conversion and of a LoRA merge, as small frozen objects, and the check of
the conversion options that cannot go together.

`convert_step` takes a `ConvertOptions` and `merge_lora` a `MergeOptions`, or the same options
as keyword arguments (`resolve` turns those into the object, and refuses both at once).
`convert_step` checks its options with `check` before anything is read or moved; the CLI
checks its flags with the same function (``spelling=FLAGS``), before it builds the target,
so the refusal names the options as the caller wrote them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypedDict, TypeVar

from ..errors import ReadOnlyStepError, UsageError
from ..model.target import Target
from ..plan.step_plan import OptimizerMode
from .write import DEFAULT_BUDGET

__all__ = [
    "FLAGS",
    "KEYWORDS",
    "ConvertKeywords",
    "ConvertOptions",
    "MergeKeywords",
    "MergeOptions",
    "Spelling",
    "check",
    "resolve",
]

_Options = TypeVar("_Options")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """How `convert_step` converts a step: its keyword arguments of the same names, as one
    object (``convert_step(step_dir, target, ConvertOptions(copy=True))``).

    ``dry_run``: report only (reads metadata). ``optimizer``: ``"convert"`` or ``"drop"`` the
    optimizer state. ``ignore``: glob patterns of model leaves dropped as intermediates.
    ``use_zarr3``: the format written (None: the source's). ``memory_budget``: bytes of
    arrays held at once (plus the largest). ``in_place``/``copy``/``remove_legacy``/``out``:
    where the new item goes and what becomes of the legacy items. ``rescan``: the other scan
    form, with ``plain_scan`` for a stack without a scanned form at hand. ``renumber``: the
    converted step takes MaxText's number.
    """

    dry_run: bool = False
    optimizer: OptimizerMode = "convert"
    ignore: Iterable[str] = ()
    use_zarr3: bool | None = None
    memory_budget: int = DEFAULT_BUDGET
    in_place: bool = False
    copy: bool = False
    remove_legacy: bool = False
    out: str | os.PathLike[str] | None = None
    rescan: Literal["unroll", "stack"] | None = None
    renumber: bool = False
    plain_scan: bool = False

    def __post_init__(self) -> None:
        # Held as a tuple: the object stays immutable, and a generator is read once here,
        # not used up by the first leaf the plan classifies.
        object.__setattr__(self, "ignore", tuple(self.ignore))


class ConvertKeywords(TypedDict, total=False):
    """`ConvertOptions` as `convert_step`'s keyword arguments (for type checkers)."""

    dry_run: bool
    optimizer: OptimizerMode
    ignore: Iterable[str]
    use_zarr3: bool | None
    memory_budget: int
    in_place: bool
    copy: bool
    remove_legacy: bool
    out: str | os.PathLike[str] | None
    rescan: Literal["unroll", "stack"] | None
    renumber: bool
    plain_scan: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class MergeOptions:
    """How `merge_lora` merges an adapter step: its keyword arguments of the same names, as
    one object.

    ``alpha``: the run's ``lora_alpha`` (None: the one the step records). ``target``: the
    model, for a Tunix base or a scan change. ``scan``: write the other scan form
    (``"unroll"``/``"stack"``), with ``plain_scan`` for a stack without a scanned form at
    hand; ``scan_axis``: the model's ``param_scan_axis`` where the shapes fit both.
    ``memory_budget``: bytes of arrays held at once. ``dry_run``: report only.
    """

    alpha: float | None = None
    target: Target | None = None
    scan: Literal["unroll", "stack"] | None = None
    scan_axis: int | None = None
    memory_budget: int = DEFAULT_BUDGET
    dry_run: bool = False
    plain_scan: bool = False


class MergeKeywords(TypedDict, total=False):
    """`MergeOptions` as `merge_lora`'s keyword arguments (for type checkers)."""

    alpha: float | None
    target: Target | None
    scan: Literal["unroll", "stack"] | None
    scan_axis: int | None
    memory_budget: int
    dry_run: bool
    plain_scan: bool


def resolve(
    kind: type[_Options], options: _Options | None, keywords: Mapping[str, Any], caller: str
) -> _Options:
    """The options of a call to ``caller``: ``options`` as given, or a ``kind`` built from
    the call's option keywords. A public function takes its options either way, never both.

    Raises:
      TypeError: a keyword that is none of ``kind``'s fields (worded as Python words an
        unexpected keyword argument), or ``options`` of another type.
      UsageError: ``options`` together with option keywords, naming them.
    """
    fields = {f.name for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    for name in keywords:
        if name not in fields:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    if options is None:
        return kind(**keywords)
    if not isinstance(options, kind):
        raise TypeError(
            f"{caller}(): options must be a {kind.__name__}, not {type(options).__name__}"
        )
    if keywords:
        # Which of the two should win is a guess either way: refused, naming both sides.
        given = ", ".join(keywords)
        raise UsageError(
            f"{caller}: options= and the keyword argument(s) {given} were both given; pass "
            f"each option one way: in the {kind.__name__} (dataclasses.replace(options, ...) "
            "makes a changed copy), or as keywords alone."
        )
    return options


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
