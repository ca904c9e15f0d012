"""Boxes of arrays: per axis a ``[start, stop)`` range, and the flat runs they cover.

A box is how every streaming operation names a part of an array: a stored chunk, a piece
of it, a layer of a stack, a LoRA factor's rows. Plans (`plan.moves`) and the Hugging Face
hooks carried over boxes (`hf.hooks_by_box`) both need to know when a box is one C-order run of
flat indices, so that it can be read or written as one range.
"""

from __future__ import annotations

from collections.abc import Sequence

Box = tuple[tuple[int, int], ...]  # per axis, [start, stop)


def flat_run(box: Sequence[tuple[int, int]], sizes: Sequence[int]) -> tuple[int, int] | None:
    """The run ``[lo, hi)`` of C-order flat indices a box of ``sizes`` covers, or None if it
    is not one run (single indices, then one range, then whole axes). A LoRA merge splits a
    box onto its factors' rows and columns with it too (`plan.ops.factor_boxes`)."""
    cut = [a for a in range(len(sizes)) if box[a] != (0, sizes[a])]
    if cut and any(box[a][1] - box[a][0] != 1 for a in range(cut[-1])):
        return None
    lo = hi = 0
    for (b0, b1), n in zip(box, sizes, strict=True):
        lo, hi = lo * n + b0, hi * n + b1 - 1
    return lo, hi + 1
