"""Moves that only move values (copy, cast, slice, stack), executed source by source.

An unrolled param is 32 destination arrays read from one source array; read one layer at a
time, the source is decoded 32 times. Here each source array is walked once
(`ItemReader.pieces`), and each piece is routed to every move that reads it
(`moves.piece_parts`). The writer (`write_routed`) gives each destination array chunks of
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
from ..plan.moves import (
    ROUTED,
    Move,
    Op,
    factor_boxes,
    fresh_rng,
    merge_part,
    part_shape,
    piece_parts,
)
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
    ``sources``) LoRA merges whose pieces of ``piece`` bytes split onto their factors
    (`merge_splits`)."""
    return [
        m
        for m in moves
        if m.op in ROUTED or (sources is not None and merge_splits(m, sources, piece))
    ]


def merge_splits(m: Move, sources: Mapping[str, ItemReader], piece: int = PIECE) -> bool:
    """Whether a merge_lora move's delta can be computed piece by piece: every piece of
    its base is a box of a layer that is one run of the factors' rows and columns."""
    if m.op is not Op.MERGE_LORA or not m.sources:
        return False
    lay = sources[m.item].layout(param_name(m.sources[0]))
    if lay is None:
        return False
    piece = lay.piece_shape(piece)
    if m.axis is not None and not m.layers:  # a layer's part of a stacked base's piece
        piece = _drop(piece, m.axis)
    f = m.lora[0]
    layer = m.spec.shape if m.layers or m.axis is None else _drop(m.spec.shape, m.axis)
    part = tuple(min(p, n) for p, n in zip(piece, layer, strict=True))
    a = _drop(f.a_spec.shape, f.axis) if f.axis is not None else f.a_spec.shape
    b = _drop(f.b_spec.shape, f.axis) if f.axis is not None else f.b_spec.shape
    return factor_boxes(layer, (0,) * len(layer), part, a, b, layout=f.layout) is not None


def _drop(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return tuple(shape[:axis]) + tuple(shape[axis + 1 :])


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
    return part_shape(m, lay.piece_shape(piece_bytes))


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
                    if m.op is Op.MERGE_LORA:
                        parts = _merged(m, path, got.start, got.data, factors.read_layer)
                    else:
                        parts = piece_parts(m, path, got.start, got.data)
                    for start, data in parts:
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


def _merged(m: Move, path: Path, start: tuple[int, ...], data: np.ndarray, read_layer):
    """What a piece of a merge's base puts in the merged leaf (`moves.merge_part` per
    layer): its own box, the layers of a stacked base merged in one buffer."""
    if m.layers:  # per-layer bases stacked on ``axis``
        a = m.axis
        for j, p in enumerate(m.layers):
            if p == path:
                got = merge_part(m, j, start, data, read_layer)
                yield start[:a] + (j,) + start[a:], np.expand_dims(_split(got), a)
    elif m.index is not None:  # one layer of a stacked base, unrolled
        a = m.axis
        if start[a] <= m.index < start[a] + data.shape[a]:
            part = data[(slice(None),) * a + (m.index - start[a],)]
            yield (
                start[:a] + start[a + 1 :],
                _split(merge_part(m, 0, start[:a] + start[a + 1 :], part, read_layer)),
            )
    elif m.axis is None:
        yield start, _split(merge_part(m, 0, start, data, read_layer))
    else:
        a, out = m.axis, np.empty(data.shape, data.dtype)
        for k in range(data.shape[a]):
            at = (slice(None),) * a + (k,)
            out[at] = _split(
                merge_part(m, start[a] + k, start[:a] + start[a + 1 :], data[at], read_layer)
            )
        yield start, out


def _split(x: np.ndarray | None) -> np.ndarray:
    if x is None:  # `merge_splits` said it would split
        raise AssertionError("a merge piece did not split onto its factors")
    return x


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
    for m in moves:  # a stack's layers the source lacks: fresh RNG state, as `apply_op`
        for j, p in enumerate(m.layers if m.op is Op.STACK else ()):
            if p is None:
                x = np.expand_dims(fresh_rng(m.spec, m.dst, j), m.axis)
                visit(m, (0,) * m.axis + (j,) + (0,) * (x.ndim - m.axis - 1), x)
    return shapes
