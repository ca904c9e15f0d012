"""Moves executed source by source: those that only move values (copy, cast, slice, stack),
and those that combine them box by box where they can (a LoRA merge: its op's `splits`).

An unrolled param is 32 destination arrays read from one source array; read one layer at a
time, the source is decoded 32 times. Here each source array is walked once
(`ItemReader.pieces`), and each piece is routed to every move that reads it
(its op's `parts`). The writer (`write_routed`) gives each destination array chunks of
the shape its pieces arrive in (`dest_chunk`), so that every piece fills whole chunks:
nothing is read back or encoded twice. `verify` walks the same pieces (the same `PIECE`
size) and reads the destination's matching boxes, so that both sides decode each stored
chunk once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from ..base.futures import results
from ..base.treepaths import Path
from ..orbax_io import item_writer
from ..orbax_io.orbax_files import param_name
from ..orbax_io.reader import ItemReader
from ..plan.moves import Move
from ..storage.memory import CONVERT

PIECE = 64 << 20  # the largest pieces a writer streams in
# Source arrays walked at once: one more than this project's 2 cores, as a worker waits on
# its piece's commit (8B `convert --unroll`, side by side: 43.0 and 39.3 s against 48.6 and
# 43.4 s with 2; 0.25 to 0.4 GiB more held).
WORKERS = CONVERT.count()
# What a worker holds per byte of piece: the piece, a cast or a merge's float32 delta and
# its sum, and the piece's parts in its transaction (`write_routed`), then encoded.
HELD = 6


def piece_for(budget: int) -> int:
    """The piece size of a writer within ``budget``: `WORKERS` pieces and what each holds
    (`HELD`), between 1 MiB and `PIECE`. Recorded with the output (``piece_bytes``), so that
    `verify` walks the same pieces and decodes each written chunk once."""
    return max(1 << 20, min(PIECE, budget // (WORKERS * HELD)))


def routed(
    moves: Sequence[Move],
    sources: Mapping[str, ItemReader] | None = None,
    piece: int = PIECE,
) -> list[Move]:
    """The moves routed piece by piece: those that only move values, and (given the
    ``sources``) those whose pieces of ``piece`` bytes can still be computed alone (a LoRA
    merge whose pieces split onto its factors: `splits`)."""
    return [m for m in moves if m.op.routed or (sources is not None and splits(m, sources, piece))]


def splits(m: Move, sources: Mapping[str, ItemReader], piece: int = PIECE) -> bool:
    """Whether ``m``'s op, one that combines values, can be computed piece by piece for the
    pieces its source's stored layout gives (its op's `splits`)."""
    if not m.sources:
        return False
    lay = sources[m.item].layout(param_name(m.sources[0]))
    if lay is None:
        return False
    return m.op.splits(m, lay.piece_shape(piece))


def by_source(moves: Sequence[Move]) -> dict[tuple[str, Path], list[Move]]:
    """Each source array, with the moves that read it (in plan order)."""
    out: dict[tuple[str, Path], list[Move]] = {}
    for m in moves:
        for p in dict.fromkeys(m.sources):
            out.setdefault((m.item, p), []).append(m)
    return out


def dest_chunk(
    m: Move, sources: Mapping[str, ItemReader], piece_bytes: int = PIECE
) -> tuple[int, ...]:
    """The chunk shape ``m``'s array is written in: the shape its pieces arrive in."""
    lay = sources[m.item].layout(param_name(m.sources[0]))
    if lay is None:  # no metadata: the walk reports it; one chunk meanwhile
        return tuple(m.out_spec.shape)
    return m.op.part_shape(m, lay.piece_shape(piece_bytes))


def walk(
    groups: Mapping[tuple[str, Path], list[Move]],
    sources: Mapping[str, ItemReader],
    visit: Callable[[Move, tuple[int, ...], np.ndarray], None],
    piece: int = PIECE,
    scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """Every source array decoded once, each piece's parts handed to ``visit(move, start,
    values)`` before the next piece is decoded (the pieces share one buffer per worker),
    inside one ``scope()`` per piece; ``WORKERS`` source arrays at a time."""

    def one(key: tuple[str, Path], moves: list[Move]) -> None:
        item, path = key
        factors = _Factors(sources)
        for got in sources[item].pieces(param_name(path), max_bytes=piece, reuse=True):
            with scope():
                for m in moves:
                    for start, data in m.op.parts(m, path, got.start, got.data, factors.read_layer):
                        visit(m, start, data)

    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        results(pool.submit(one, k, ms) for k, ms in groups.items())


class _Factors:
    """A merge's LoRA factors, each read whole once (they are small) and sliced by layer."""

    def __init__(self, sources: Mapping[str, ItemReader]) -> None:
        self.sources = sources
        self.cache: dict[tuple[str, Path], np.ndarray] = {}

    def read_layer(self, item: str, path: Path, axis: int | None, i: int | None) -> np.ndarray:
        if (item, path) not in self.cache:
            self.cache[item, path] = self.sources[item].read_whole(param_name(path))
        x = self.cache[item, path]
        return x if axis is None or i is None else x[(slice(None),) * axis + (i,)]


def write_routed(
    moves: Sequence[Move],
    sources: Mapping[str, ItemReader],
    dst_json: dict,
    *,
    zarr3: bool,
    ctx: Any,
    piece: int = PIECE,
) -> dict[int, tuple[int, ...]]:
    """Writes ``moves`` (all routed) into the database ``dst_json`` in pieces of at most
    ``piece`` bytes; returns each one's chunk shape (by ``id``), for its Orbax array
    metadata."""
    shapes = {id(m): dest_chunk(m, sources, piece) for m in moves}
    stores = {
        id(m): item_writer.create_array(
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

    # One transaction per piece: its parts (a piece of every layer, for an unroll) are
    # committed to the database together. Committed one by one, each write was a B-tree
    # commit of its own, re-encoding a leaf that grows with the keys written so far, one
    # commit at a time: at 8B, 6,000 commits and a seventh of the CPU (docs/performance.md).
    local = threading.local()

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        local.txn = ts.Transaction()
        try:
            yield
            local.txn.commit_async().result()
        except BaseException:
            local.txn.abort()
            raise
        finally:
            local.txn = None

    def visit(m: Move, start: tuple[int, ...], data: np.ndarray) -> None:
        box = tuple(slice(s, s + n) for s, n in zip(start, data.shape, strict=True))
        store = stores[id(m)]
        txn = getattr(local, "txn", None)
        if txn is not None:
            store = store.with_transaction(txn)
        store[box].write(data).result()

    walk(by_source(moves), sources, visit, piece, scope)
    for m in moves:  # what no source gives (a stack's fresh RNG layers), as `apply_op`
        for start, x in m.op.made_parts(m):
            visit(m, start, x)
    return shapes
