"""The LoRA merge as an op (`plan.moves.Op`): ``merge_lora``, a base weight plus its LoRA
delta, layer by layer. The floors below reach it only through the op interface: the
writer routes its boxes where they split onto the factors (`splits`, `parts`), and hands it
the rest to write layer by layer (`write_rest`: `merge_writer`); the export asks it for
boxes and layers (`box`, `layer`). A merge move's own parameters are `MergeArgs` (its
factors, and the base's layer axis, layer or layers). Registered as ``Op.MERGE_LORA`` when
this room is imported (the package's ``__init__`` does)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..base.treepaths import Path, keystr
from ..orbax_io.spec import LeafSpec
from ..plan.moves import LoraFactor, Move, Op, Reader
from .delta import factor_boxes, merge_layer, merge_part
from .merge_writer import write_merges


def _without(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return shape[:axis] + shape[axis + 1 :]


def _with_layers(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    return shape[:axis] + (n,) + shape[axis:]


@dataclasses.dataclass(frozen=True, slots=True)
class MergeArgs:
    """A merge's: the LoRA factors (``lora``: one per layer, or one for all, in another
    item), and where the base layer comes from: the whole source (no ``axis``, or each of
    its layers on ``axis``), layer ``index`` of it on ``axis`` (unrolled), or one source per
    layer (``layers``, stacked on ``axis``)."""

    lora: tuple[LoraFactor, ...]
    axis: int | None = None
    index: int | None = None
    layers: tuple[Path | None, ...] = ()

    def layer_count(self, spec: LeafSpec) -> int | None:
        """How many layers the written leaf stacks on ``axis`` (None: one layer), for a
        base stored as ``spec``."""
        if self.layers:
            return len(self.layers)
        if self.axis is None or self.index is not None:
            return None
        return spec.shape[self.axis]


class MergeLora(Op):
    """A base weight plus its LoRA delta, per layer ``l``:
    ``W_l + scale * reshape(A_l @ B_l, W_l.shape)`` (``lora``: the factors of each layer, in
    another item); the base layer comes as for copy, slice (``index``) or stack
    (``layers``), on ``axis`` (`MergeArgs`). Unrolled or stacked, a merge stays a merge."""

    name = "MERGE_LORA"
    Args = MergeArgs

    @property
    def unrolled(self) -> Op:
        return self  # it then merges layer ``index`` only

    @property
    def stacked(self) -> Op:
        return self  # each layer merged with its own factors

    def unroll(self, m: Move, *, dst: Path, axis: int, index: int) -> Move:
        """It then merges layer ``index`` only, with the same factors."""
        args = dataclasses.replace(m.args, axis=axis, index=index)
        return dataclasses.replace(m, dst=dst, args=args)

    def stack_layers(
        self, got: Mapping[int, Move], n: int, *, dst: Path, axis: int, note: str
    ) -> Move | str:
        """Every layer merged, each with its own factors: no layer missing."""
        merged = [got[i] for i in range(n) if i in got and got[i].args.lora]
        if any(i not in got for i in range(n)) or len(merged) != n:
            return f"{keystr(dst)}: layers {sorted(got)} do not all merge"
        srcs = tuple(got[i].src for i in range(n))
        lora = tuple(m.args.lora[0] for m in merged)
        first = got[min(got)]
        args = dataclasses.replace(first.args, axis=axis, layers=srcs, lora=lora)
        return dataclasses.replace(first, dst=dst, args=args)

    def sources(self, m: Move) -> tuple[Path, ...]:
        if m.args.layers:
            return tuple(p for p in m.args.layers if p is not None)
        return (m.src,)

    def reads(self, m: Move) -> tuple[tuple[str, Path, LeafSpec], ...]:
        """The base's layers and the LoRA factors (in their own item)."""
        out = list(super().reads(m))
        for f in dict.fromkeys(m.args.lora):
            out += [(f.item, f.a, f.a_spec), (f.item, f.b, f.b_spec)]
        return tuple(out)

    def factors(self, m: Move) -> tuple[LoraFactor, ...]:
        return m.args.lora

    def out_spec(self, m: Move) -> LeafSpec:
        s, g = m.spec, m.args
        if g.index is not None:
            assert g.axis is not None
            return dataclasses.replace(s, shape=_without(s.shape, g.axis))
        if g.layers:
            assert g.axis is not None
            return dataclasses.replace(s, shape=_with_layers(s.shape, g.axis, len(g.layers)))
        return s

    def detail(self, m: Move) -> str:
        g = m.args
        if not g.lora:
            return ""
        f, n = g.lora[0], g.layer_count(m.spec)
        return (
            f" + {f.scale:g} * {f.item}/{keystr(f.a).removesuffix('_a')}_{{a@b}}"
            + (f" scan step {g.index} on axis {g.axis}" if g.index is not None else "")
            + (f", {n} scan steps on axis {g.axis}" if n else "")
        )

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        assert read is not None
        cache: dict[tuple[str, Path], np.ndarray] = {}

        def layer(item: str, p: Path, axis: int | None, i: int | None) -> np.ndarray:
            if (item, p) not in cache:
                cache[item, p] = np.asarray(read(item, p))
            x = cache[item, p]
            return x if axis is None or i is None else np.take(x, i, axis=axis)

        n = m.args.layer_count(m.spec)
        if n is None:
            return merge_layer(m, 0, layer)
        return np.stack([merge_layer(m, i, layer) for i in range(n)], axis=m.args.axis)

    def part_shape(self, m: Move, piece: tuple[int, ...]) -> tuple[int, ...]:
        g = m.args
        if g.index is not None:
            assert g.axis is not None
            return _without(piece, g.axis)
        if g.layers:
            assert g.axis is not None
            return _with_layers(piece, g.axis, 1)
        return piece

    def splits(self, m: Move, piece: tuple[int, ...]) -> bool:
        """Whether every piece of the base is a box of a layer that is one run of the
        factors' rows and columns (then the delta is computed piece by piece)."""
        g = m.args
        if g.axis is not None and not g.layers:  # a layer's part of a stacked base's piece
            piece = _without(piece, g.axis)
        f = g.lora[0]
        layer = m.spec.shape if g.layers or g.axis is None else _without(m.spec.shape, g.axis)
        part = tuple(min(p, n) for p, n in zip(piece, layer, strict=True))
        a = tuple(_without(f.a_spec.shape, f.axis) if f.axis is not None else f.a_spec.shape)
        b = tuple(_without(f.b_spec.shape, f.axis) if f.axis is not None else f.b_spec.shape)
        return factor_boxes(layer, (0,) * len(layer), part, a, b, layout=f.layout) is not None

    def parts(self, m, path, start, data, factors) -> Iterator[tuple[tuple[int, ...], Any]]:
        """A piece of the base: its own box merged (`merge_part` per layer), the layers of a
        stacked base merged in one buffer."""
        a, index = m.args.axis, m.args.index
        if m.args.layers:  # per-layer bases stacked on ``axis``
            for j, p in enumerate(m.args.layers):
                if p == path:
                    got = merge_part(m, j, start, data, factors)
                    yield start[:a] + (j,) + start[a:], np.expand_dims(_split(got), a)
        elif index is not None:  # one layer of a stacked base, unrolled
            if start[a] <= index < start[a] + data.shape[a]:
                part = data[(slice(None),) * a + (index - start[a],)]
                at = start[:a] + start[a + 1 :]
                yield at, _split(merge_part(m, 0, at, part, factors))
        elif a is None:
            yield start, _split(merge_part(m, 0, start, data, factors))
        else:
            out = np.empty(data.shape, data.dtype)
            for k in range(data.shape[a]):
                at = (slice(None),) * a + (k,)
                got = merge_part(m, start[a] + k, start[:a] + start[a + 1 :], data[at], factors)
                out[at] = _split(got)
            yield start, out

    def chunk_shape(self, m: Move) -> tuple[int, ...]:
        """One chunk a layer where the merge writes a stacked weight layer by layer."""
        out, a = m.out_spec.shape, m.args.axis
        if m.args.layer_count(m.spec) is not None:
            assert a is not None
            return out[:a] + (1,) + out[a + 1 :]
        return out

    def by_box(self, m: Move) -> bool:
        return not m.args.layers and m.args.index is None

    def box(self, m, i, start, w, factors) -> np.ndarray | None:
        return merge_part(m, i, start, w, factors)

    def layer(self, m, axis, index, read, cache) -> np.ndarray:
        whole = lambda item, p: read(item, p, None, None)  # noqa: E731
        if index is None:  # the whole merged param: what the op computes
            return self.apply(m, whole)
        if m.args.axis != axis:  # cut on another axis first (MoE experts): merged whole, once
            if ("merged", m.dst) not in cache:
                cache["merged", m.dst] = self.apply(m, whole)
            return cache["merged", m.dst][(slice(None),) * axis + (index,)]
        return merge_layer(m, index, read)

    def write_rest(
        self,
        moves: Sequence[Move],
        sources: Mapping[str, Any],
        dst_json: dict,
        *,
        zarr3: bool,
        ctx: Any,
        budget: int,
    ) -> None:
        """The merges whose pieces do not split: each base kernel decoded once, its layers
        merged and written one by one (`merge_writer.write_merges`)."""
        write_merges(moves, sources, dst_json, zarr3=zarr3, ctx=ctx, budget=budget)

    def piece_overhead(self, m: Move) -> float:
        return 1 + 4 / max(1, np.dtype(m.spec.dtype).itemsize)  # the delta (f32), its sum


def _split(x: np.ndarray | None) -> np.ndarray:
    if x is None:  # `splits` said it would split
        raise AssertionError("a merge piece did not split onto its factors")
    return x


MERGE_LORA = Op.MERGE_LORA = MergeLora()
