"""Errors. One hierarchy under `OrbaxMaxTextLayoutError`; each names its path and what to do."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence
from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class OrbaxMaxTextLayoutError(Exception):
    """Base class of every error this library raises on purpose."""


class UsageError(OrbaxMaxTextLayoutError, ValueError):
    """The call itself is wrong (options that cannot go together, a missing argument).

    A ``ValueError`` too, so callers that caught the plain ``ValueError`` raised
    before this class existed keep working.
    """


class CheckpointReadError(OrbaxMaxTextLayoutError, ValueError):
    """A checkpoint directory or file cannot be read as what it claims to be."""


class CheckpointRefusedError(CheckpointReadError):
    """A file refused as damaged or forged (too large, nested too deeply, metadata that
    contradicts itself): never handed on to another reader, such as Orbax's own metadata
    reader (`spec.read_specs` falls back to it for other errors), which has no such limits.
    Here, not in `orbax_io`, since Orbax's files and other formats' (`formats`) refuse alike."""


class LayoutMismatchError(OrbaxMaxTextLayoutError, ValueError):
    """The target and the checkpoint disagree. Raised before anything is written.

    ``problems`` holds one line per offending path, all of them, not only the first.
    """

    def __init__(self, summary: str, problems: Sequence[str] = (), hint: str = "") -> None:
        self.summary = summary
        self.problems = list(problems)
        self.hint = hint
        lines = [summary, *(f"  - {p}" for p in self.problems)]
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))


class StepLocked(OrbaxMaxTextLayoutError, RuntimeError):
    """Another live process holds the step's lock."""


class ReadOnlyStepError(OrbaxMaxTextLayoutError, OSError):
    """The step directory cannot be written; convert to a separate destination instead."""


class StepExistsError(OrbaxMaxTextLayoutError, FileExistsError):
    """A step would be written to (or renumbered into) a directory that holds another step."""


def print_error(message: object) -> None:
    """``error: <message>`` on stderr: how the commands, and the MaxText runner
    (`orbax_maxtext_layout.maxtext.run`), report a refusal."""
    print(f"error: {message}", file=sys.stderr)


def detached(error: E, *, where: str | None = None) -> E:
    """``error``, to be kept after its ``except`` block (in a report, a memo, a run's state),
    with no frame behind it: the traceback of each exception of its chain is dropped.

    A kept exception's traceback holds the frame that kept it, whose locals hold the
    exception again: a reference cycle, which keeps every local of every frame of it (a
    restore's arrays, a reader's mappings) until a full collection (issue 57). Clearing the
    frames' locals is not enough: each frame holds its caller's (``f_back``). With
    ``where``, each dropped traceback is kept as a note, file and line by line, printed
    with the error (``where`` says whose frames they were)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:  # the cause and the context alike (``raise X from Y`` inside ``except Z``)
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            if where is not None:
                trace = "".join(traceback.format_tb(e.__traceback__)).rstrip()
                e.add_note(f"{where} ({type(e).__name__}):\n{trace}")
            e.__traceback__ = None
        todo += [e.__cause__, e.__context__]
    return error
