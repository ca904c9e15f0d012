"""Errors. Each names the path it is about and says what to do."""

from __future__ import annotations

from collections.abc import Sequence


class CheckpointReadError(ValueError):
    """A checkpoint directory or file cannot be read as what it claims to be."""


class LayoutMismatchError(ValueError):
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
