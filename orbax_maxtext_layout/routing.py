"""Moves that only move values (copy, cast, slice, stack), executed source by source.

An unrolled param is 32 destination arrays read from one source array; read one layer at a
time, the source is decoded 32 times. Here each source array is walked once
(`chunks.pieces`), and each piece is routed to every move that reads it
(`moves.piece_parts`). The writer (`write_routed`) gives each destination array chunks of
the shape its pieces arrive in (`dest_chunk`), so that every piece fills whole chunks:
nothing is read back or encoded twice. `verify` walks the same pieces (the same `PIECE`
size) and reads the destination's matching boxes, so that both sides decode each stored
chunk once.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import chunks, tskv
from .moves import ROUTED, Move, Op, fresh_rng, part_shape, piece_parts
from .orbax_files import param_name
from .treepaths import Path

PIECE = 64 << 20  # the pieces a writer and its check stream in: their chunks align
WORKERS = 2  # source arrays walked at once


def routed(moves: Sequence[Move]) -> list[Move]:
    """The moves routed piece by piece: those that only move values."""
    return [m for m in moves if m.op in ROUTED]


def by_source(moves: Sequence[Move]) -> dict[tuple[str, Path], list[Move]]:
    """Each source array, with the moves that read it (in plan order)."""
    out: dict[tuple[str, Path], list[Move]] = {}
    for m in moves:
        for p in dict.fromkeys(m.sources):
            out.setdefault((m.item, p), []).append(m)
    return out


def dest_chunk(m: Move, sources: Mapping[str, tskv.SourceItem]) -> tuple[int, ...]:
    """The chunk shape ``m``'s array is written in: the shape its pieces arrive in."""
    lay = chunks.layout(sources[m.item], param_name(m.sources[0]))
    if lay is None:  # no metadata: the walk reports it; one chunk meanwhile
        return tuple(m.out_spec.shape)
    return part_shape(m, lay.piece_shape(PIECE))


def walk(
    groups: Mapping[tuple[str, Path], list[Move]],
    sources: Mapping[str, tskv.SourceItem],
    ctx: Any,
    visit: Callable[[Move, tuple[int, ...], np.ndarray], None],
) -> None:
    """Every source array decoded once, each piece's parts handed to ``visit(move, start,
    values)`` before the next piece is decoded (the pieces share one buffer per worker);
    ``WORKERS`` source arrays at a time."""

    def one(key: tuple[str, Path], moves: list[Move]) -> None:
        item, path = key
        for piece in chunks.pieces(
            sources[item], param_name(path), ctx, max_bytes=PIECE, reuse=True
        ):
            for m in moves:
                for start, data in piece_parts(m, path, piece.start, piece.data):
                    visit(m, start, data)

    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        futures = [pool.submit(one, k, ms) for k, ms in groups.items()]
        for f in concurrent.futures.as_completed(futures):
            f.result()


def write_routed(
    moves: Sequence[Move],
    sources: Mapping[str, tskv.SourceItem],
    dst_json: dict,
    *,
    zarr3: bool,
    ctx: Any,
) -> dict[int, tuple[int, ...]]:
    """Writes ``moves`` (all routed) into the database ``dst_json``; returns each one's
    chunk shape (by ``id``), for its Orbax array metadata."""
    shapes = {id(m): dest_chunk(m, sources) for m in moves}
    stores = {
        id(m): tskv.create_array(
            dst_json,
            param_name(m.dst),
            m.out_spec.shape,
            m.out_spec.dtype,
            shapes[id(m)],
            use_zarr3=zarr3,
            context=ctx,
        )
        for m in moves
    }

    def visit(m: Move, start: tuple[int, ...], data: np.ndarray) -> None:
        box = tuple(slice(s, s + n) for s, n in zip(start, data.shape, strict=True))
        stores[id(m)][box].write(data).result()

    walk(by_source(moves), sources, ctx, visit)
    for m in moves:  # a stack's layers the source lacks: fresh RNG state, as `apply_op`
        for j, p in enumerate(m.layers if m.op is Op.STACK else ()):
            if p is None:
                x = np.expand_dims(fresh_rng(m.spec, m.dst, j), m.axis)
                visit(m, (0,) * m.axis + (j,) + (0,) * (x.ndim - m.axis - 1), x)
    return shapes
