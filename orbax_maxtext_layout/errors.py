"""Errors. One hierarchy under `OrbaxMaxTextLayoutError`; each names its path and what to do."""

from __future__ import annotations

import sys
from collections.abc import Sequence


class OrbaxMaxTextLayoutError(Exception):
    """Base class of every error this library raises on purpose."""


class UsageError(OrbaxMaxTextLayoutError, ValueError):
    """The call itself is wrong (options that cannot go together, a missing argument).

    A ``ValueError`` too, so callers that caught the plain ``ValueError`` raised
    before this class existed keep working.
    """


class CheckpointReadError(OrbaxMaxTextLayoutError, ValueError):
    """A checkpoint directory or file cannot be read as what it claims to be."""


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
