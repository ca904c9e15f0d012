"""The streaming execution of an export: its params decoded and written within the budget.

`run_groups` runs one job per param (or fused group of params), `budget.WORKERS` at a
time and largest first, each holding what its gate (`storage.memory.Gate`) grants it. A param that fits is
decoded whole once (`ItemReader.read_whole`), sliced into its units (`hf_mapping.Unit`), and
each unit put through MaxText's hooks (`hf_mapping.transform`) into its tensors, written
whole (`PartWriter.write`). A param over the budget goes piece by piece
(`_write_pieces`): each stored chunk decoded once (`ItemReader.pieces`), each piece's part of
a layer put through the hooks (`hooks_by_box`) and written at its place
(`PartWriter.write_box`). `_ParamReader` hands out a param's layers in stored form, a LoRA
merge's computed on the way.

The caller opens the files (`formats.sink.Sink.open`) and says which tensor goes to which
(``where``); what the files are and who writes which is `export_processes`'. Nothing here
knows the files' format.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, NamedTuple

import numpy as np

from ..base.futures import results
from ..formats.sink import PartWriter
from ..model import hf_mapping
from ..model.hf_mapping import HfModel, Unit
from ..orbax_io import chunks, item_writer
from ..orbax_io.orbax_files import param_name
from ..orbax_io.reader import ItemReader
from ..plan.moves import Move
from ..storage.memory import Gate
from . import hooks_by_box
from .budget import WORKERS, group_cost, largest_first, piece_bytes, piece_held, slice_bytes
from .export_plan import ExportPlan


def run_groups(ep: ExportPlan, groups: dict, where: dict[str, PartWriter], budget: int) -> None:
    """The params ``groups`` (param keys -> their units) of ``ep`` written into the files of
    ``where`` (HF tensor name -> its open `PartWriter`; a tensor not in it is not written),
    `WORKERS` jobs at a time within ``budget`` bytes, largest first."""
    ctx = item_writer.ts_context()
    sources = {n: ItemReader.open(d, ctx) for n, d in ep.sources.items()}
    gate = Gate(budget, cap=True)  # a job over the budget holds the budget, alone

    def job(keys: tuple[str, ...], units: list[Unit]) -> None:
        moves = [ep.moves[k] for k in keys]
        fns = _piece_fns(ep.model, moves, units)
        if fns is not None:
            per = piece_held(moves[0], fns)
            size = piece_bytes(budget, moves[0], per)
            lora = moves[0].op.factors(moves[0])
            factors = sum(f.a_spec.nbytes + f.b_spec.nbytes for f in set(lora))
            held = gate.take(int(size * per) + factors)
            try:
                run = _ExportShared(ep.model, sources, ctx, where)
                _write_pieces(run, moves[0], units, fns, size)
            finally:
                gate.give(held)
            return
        cost = group_cost(ep.model, moves, units, budget)
        whole = cost <= budget
        held = gate.take(
            cost if whole else 3 * max(slice_bytes(ep.model, moves[0], u) for u in units)
        )
        try:
            reader = _ParamReader(sources, ctx, whole=whole)
            for u in units:
                layers = [u.take_more(reader.layer(m, u.axis, u.index)) for m in moves]
                _write_unit(ep.model, u, layers, where)
                if u.index is None:
                    reader.cache.clear()  # the param's only unit: hold the slice only
        finally:
            gate.give(held)

    # BLAS's own threads would spin against the workers: one BLAS thread in the command
    # line, as in merge-lora (`merge_writer`).
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        results(pool.submit(job, k, groups[k]) for k in largest_first(ep.moves, groups))


def _write_unit(model: HfModel, u: Unit, layers: list[np.ndarray], where: dict) -> None:
    """One unit's slices through MaxText's hooks, each HF tensor written whole."""
    arrays = [hf_mapping.restored(x, model.weight_dtype) for x in layers]
    del layers
    for name, arr in hf_mapping.transform(model, u, arrays):
        if name in where:
            where[name].write(name, arr)
        del arr


# -- a param piece by piece: its stored chunks decoded once --------------------------------
def _piece_fns(model: HfModel, moves: list[Move], units: list[Unit]) -> dict | None:
    """Each unit's hooks as a `hooks_by_box.PieceFn` (one per distinct shape), or None where a
    param cannot go piece by piece: a fused or merged param, or a hook a box cannot
    go through (`hooks_by_box`)."""
    m = moves[0]
    if len(moves) != 1 or not m.op.by_box(m):
        return None
    if m.op.factors(m) and any(u.more for u in units):  # a merge's layer is the first stacked axis
        return None
    shape = tuple(moves[0].out_spec.shape)
    fns: dict[int, hooks_by_box.PieceFn] = {}
    traced: dict[tuple, hooks_by_box.PieceFn | None] = {}
    for u in units:
        outs = tuple(hf_mapping.out_shapes(model, u).values())
        key = (u.hooks if callable(u.hooks) else tuple(u.hooks or ()), len(u.levels), outs)
        if key not in traced:
            traced[key] = hooks_by_box.PieceFn.trace(
                lambda x, u=u: hf_mapping.hooked(model, u, [x]),
                u.slice_shape(shape),
                model.weight_dtype,
                outs,
            )
        if traced[key] is None:
            return None
        fns[id(u)] = traced[key]
    return fns


class _ExportShared(NamedTuple):
    """What every job of an export shares: the model, the opened sources, the files."""

    model: HfModel
    sources: dict
    ctx: Any
    where: dict


def _write_pieces(run: _ExportShared, m: Move, units: list[Unit], fns: dict, size: int) -> None:
    """Param ``m`` over the budget: each stored chunk decoded once (`ItemReader.pieces`), and
    each piece's part of each layer put through the hooks (`hooks_by_box`) and written at its
    place in its HF tensors (`PartWriter.write_box`). A part the hooks cannot take alone
    leaves its unit to be read whole at the end (counted as ``layer decoded``)."""
    model, sources, ctx, where = run
    src = sources[m.item]
    wd = model.weight_dtype
    by_layer = {tuple(i for _, i in u.levels) or None: u for u in units}
    redo: dict[int, Unit] = {}
    factors = _ParamReader(sources, ctx, whole=True)  # a merge's factors, read whole once
    for piece in src.pieces(param_name(m.src), max_bytes=size, reuse=True):
        for index, start, part in _layer_parts(piece, units[0].levels, by_layer):
            u = by_layer[index]
            if id(u) in redo:
                continue
            # the op's box of the layer (a copy's is the part itself; a merge's, merged)
            part = m.op.box(m, index[0] if index else 0, start, part, factors.read_layer)
            if part is None:
                redo[id(u)] = u
                continue
            got = fns[id(u)].apply(start, hf_mapping.restored(part, wd))
            if got is None:
                redo[id(u)] = u
                continue
            for name, (at, data) in zip(hf_mapping.out_shapes(model, u), got, strict=True):
                if name in where:
                    where[name].write_box(name, at, data.astype(wd, copy=False))
        del piece
    factors.cache.clear()
    reader = _ParamReader(sources, ctx, whole=False)
    for u in redo.values():
        _write_unit(model, u, [u.take_more(reader.layer(m, u.axis, u.index))], where)


def _layer_parts(piece: chunks.Piece, levels: tuple, by_index: dict):
    """``(indices, start, values)`` of each unit slice a piece holds part of: the piece
    cut on each stacked axis in turn (``levels``: a unit's ``(axis, index)`` slices; none:
    the param is one unit, and the piece is its part)."""
    if not levels:
        yield None, piece.start, piece.data
        return
    parts = [((), piece.start, piece.data)]
    for a, _ in levels:
        parts = [
            ((*idx, start[a] + i), start[:a] + start[a + 1 :], data[(slice(None),) * a + (i,)])
            for idx, start, data in parts
            for i in range(data.shape[a])
        ]
    for idx, start, data in parts:
        if idx in by_index:
            yield idx, start, data


class _ParamReader:
    """Layers of a param's move, in stored form: decoded whole once (``whole``: each
    stored chunk once, `ItemReader.read_whole`) and sliced, or read layer by layer from
    storage (a merge over the budget; a layer `hooks_by_box` cannot take)."""

    def __init__(self, sources: dict, ctx: Any, *, whole: bool) -> None:
        self.sources, self.ctx, self.whole = sources, ctx, whole
        self.cache: dict[tuple[str, Any], np.ndarray] = {}

    def read_layer(self, item: str, path: Any, axis: int | None, index: int | None) -> np.ndarray:
        if self.whole:
            if (item, path) not in self.cache:
                self.cache[item, path] = self.sources[item].read_whole(param_name(path))
            x = self.cache[item, path]
            return x if axis is None or index is None else x[(slice(None),) * axis + (index,)]
        layer = None if axis is None or index is None else (axis, index)
        return self.sources[item].read_array(path, layer)

    def layer(self, m: Move, axis: int | None, index: int | None) -> np.ndarray:
        """Layer ``index`` on ``axis`` of what ``m`` writes (its op's `layer`; only a copy or a
        merge exports)."""
        return m.op.layer(m, axis, index, self.read_layer, self.cache)
