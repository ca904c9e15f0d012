"""The memory budget of a streaming export: what each job holds, the peak to expect, and
the gate that keeps the bytes in flight within the budget.

A job is one param (or a fused group of params) with its units (`hf_mapping.Unit`). It
costs the param decoded whole, a merge's factors, and its largest slice three times over
(`group_cost`); one over the budget goes piece by piece instead, in pieces sized from the
budget (`piece_bytes`). `WORKERS` jobs run at once where the budget holds them (`storage.memory.Gate`,
capped: a job over the budget holds the budget, alone), largest first (`largest_first`). `expected_memory` is the same sum, from metadata, for
the report.
"""

from __future__ import annotations

import numpy as np

from ..model.hf_mapping import HfModel, Unit
from ..orbax_io.reader import FAST_DECODING
from ..plan.moves import Move
from ..storage.memory import EXPORT

WORKERS = EXPORT.count()


def expected_memory(
    model: HfModel, units: list[Unit], moves: dict[str, Move], budget: int
) -> dict[str, int]:
    """What the export holds at once: at most ``WORKERS`` params in flight within the
    budget (a param over it runs alone), plus the slices being transformed."""
    groups: dict[tuple[str, ...], list[Unit]] = {}
    for u in units:
        groups.setdefault(u.keys, []).append(u)
    costs = sorted(
        (group_cost(model, [moves[k] for k in ks], us, budget) for ks, us in groups.items()),
        reverse=True,
    )
    largest_slice = max((slice_bytes(model, moves[u.keys[0]], u) for u in units), default=0)
    fitting = [c for c in costs if c <= budget]
    held = max(min(budget, sum(fitting[:WORKERS])), costs[0] if costs else 0)
    return {
        "budget": budget,
        "largest_param": max((m.out_spec.nbytes for m in moves.values()), default=0),
        "largest_slice": largest_slice,
        "expected_peak": held + 3 * largest_slice,
    }


def group_cost(model: HfModel, moves: list[Move], units: list[Unit], budget: int) -> int:
    """Bytes a param's job holds: the param decoded whole (`ItemReader.read_whole`: the array
    and the piece being decoded, `FAST_DECODING`), a merge's factors, and its largest
    slice three times over (cast to ``weight_dtype``, handed to the hooks, and their
    output)."""
    stored = int(FAST_DECODING * sum(m.out_spec.nbytes for m in moves))
    lora = dict.fromkeys(f for m in moves for f in m.op.factors(m))
    factors = sum(f.a_spec.nbytes + f.b_spec.nbytes for f in lora)
    biggest = max((slice_bytes(model, moves[0], u) for u in units), default=0)
    return stored + factors + 3 * biggest


def slice_bytes(model: HfModel, m: Move, u: Unit) -> int:
    """Bytes of one unit's slice of ``m``, in the wider of the stored and the HF dtype."""
    n = int(np.prod(u.slice_shape(m.out_spec.shape), dtype=np.int64))
    return n * max(model.weight_dtype.itemsize, np.dtype(m.out_spec.dtype).itemsize) * len(u.keys)


def piece_held(m: Move, fns: dict) -> float:
    """What a piece's job holds, in times the piece: the hooks' intermediates
    (`hooks_by_box.PieceFn.held`), and a merge's delta (float32) and its sum."""
    held = max((f.held for f in fns.values()), default=1.0)
    return held + m.op.piece_overhead(m)


def piece_bytes(budget: int, m: Move, held: float) -> int:
    """The size of the pieces a param is decoded in: a worker's share of the budget over
    what a piece's job holds (`piece_held`), at least 256 KiB, at most the param."""
    return min(m.out_spec.nbytes, max(256 << 10, int(budget / (WORKERS * held))))


def group_bytes(moves: dict[str, Move], keys: tuple[str, ...]) -> int:
    """The output bytes of the params ``keys``."""
    return sum(moves[k].out_spec.nbytes for k in keys)


def largest_first(moves: dict[str, Move], groups: dict) -> list[tuple[str, ...]]:
    """The params of ``groups`` by output bytes, largest first (then by name): the order
    that leaves the least for one worker alone at the end (at 8B, the plan's order left a
    3.8 GB MLP kernel last: 14 s on one core of two)."""
    return sorted(groups, key=lambda ks: (-group_bytes(moves, ks), ks))
