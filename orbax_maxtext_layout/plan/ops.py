"""One class per op (`moves.Op`, the interface): what each writes, what it reads, how it
applies to a whole leaf and to a box, and its reverse where there is one (``slice`` and
``stack``). The LoRA merge's class is in LoRA's room (`lora.merge_op`), with its numerics.

Each op has one instance, named as the enum named it (``COPY``, ``CAST``, ...) and
registered on `moves.Op` (``Op.COPY``), which `moves.Move` defaults to and the public API
offers. Like transformers' conversion ops: callers ask the op, never which op it is. What a
move of an op needs besides its source is the op's own parameters, a frozen dataclass
beside it (``Cast.Args`` is `CastArgs`, ...), carried as `moves.Move.args`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..base.treepaths import Path
from ..model.rng import fresh_rng
from ..orbax_io import casts
from ..orbax_io.spec import LeafSpec
from .moves import Move, NoArgs, Op, Reader

__all__ = [
    "CAST",
    "CONSTANT",
    "COPY",
    "FRESH",
    "SLICE",
    "STACK",
    "CastArgs",
    "ConstantArgs",
    "FreshArgs",
    "SliceArgs",
    "StackArgs",
    "apply_op",
]


def apply_op(m: Move, read: Reader | None) -> np.ndarray:
    """The destination leaf of ``m`` in stored form (keys as raw data), from ``read``."""
    return m.op.apply(m, read)


def _without(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return shape[:axis] + shape[axis + 1 :]


def _with_layers(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    return shape[:axis] + (n,) + shape[axis:]


@dataclasses.dataclass(frozen=True, slots=True)
class CastArgs:
    """A cast's: the stored dtype the leaf is cast to."""

    dtype: np.dtype


@dataclasses.dataclass(frozen=True, slots=True)
class ConstantArgs:
    """A constant's: the value written."""

    value: int


@dataclasses.dataclass(frozen=True, slots=True)
class SliceArgs:
    """A slice's: the layer ``index`` taken on ``axis``, the stacked source's layer axis."""

    axis: int
    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class StackArgs:
    """A stack's: the source path of each layer (None: fresh RNG state), joined on ``axis``."""

    axis: int
    layers: tuple[Path | None, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class FreshArgs:
    """Fresh RNG state's: the layer axis of a stacked leaf whose layers are derived one by
    one (None: one value)."""

    axis: int | None = None


class Copy(Op):
    """The source leaf, stored bytes unchanged (PRNG keys keep their impl)."""

    name = "COPY"
    Args = NoArgs
    renames = elementwise = routed = True

    @property
    def unrolled(self) -> Op:
        return SLICE

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        assert read is not None
        return np.asarray(read(m.item, m.src))

    def assemble(self, m: Move, read: Any) -> Any:
        return read(m.item, m.src)

    def parts(self, m, path, start, data, factors) -> Iterator[tuple[tuple[int, ...], Any]]:
        yield start, data

    def by_box(self, m: Move) -> bool:
        return True

    def box(self, m, i, start, w, factors) -> np.ndarray:
        return w

    def layer(self, m, axis, index, read, cache) -> np.ndarray:
        return read(m.item, m.src, axis, index)


class Cast(Op):
    """The source leaf cast to ``cast`` (``step``: uint32 -> int32), as Orbax casts."""

    name = "CAST"
    Args = CastArgs
    elementwise = routed = True

    def out_spec(self, m: Move) -> LeafSpec:
        return dataclasses.replace(m.spec, dtype=np.dtype(m.args.dtype))

    def detail(self, m: Move) -> str:
        dtype = m.args.dtype
        return f" to {np.dtype(dtype).name if dtype is not None else ''}"

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        assert read is not None
        return casts.astype(read(m.item, m.src), m.args.dtype)  # as Orbax casts

    def assemble(self, m: Move, read: Any) -> Any:
        x = read(m.item, m.src)
        if np.dtype(x.dtype) != m.args.dtype:
            x = casts.astype(x, m.args.dtype)  # as Orbax casts (tensorstore's cast)
        return x

    def parts(self, m, path, start, data, factors) -> Iterator[tuple[tuple[int, ...], Any]]:
        yield start, casts.astype(data, m.args.dtype)


class Constant(Op):
    """``value``, no source (``step`` from the step directory's number)."""

    name = "CONSTANT"
    Args = ConstantArgs
    made = True

    def sources(self, m: Move) -> tuple[Path, ...]:
        return ()

    def detail(self, m: Move) -> str:
        return f" {m.args.value}"

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        return np.asarray(m.args.value, dtype=m.spec.dtype).reshape(m.spec.shape)


class Fresh(Op):
    """No source: RNG state initialised fresh (count 0, a derived key; with ``axis``, a
    stacked leaf whose layers are derived one by one, as for stack)."""

    name = "FRESH"
    Args = FreshArgs
    made = True

    def sources(self, m: Move) -> tuple[Path, ...]:
        return ()

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        return fresh_rng(m.spec, m.dst, axis=m.args.axis)


class Slice(Op):
    """Layer ``index`` of a stacked source, taken on ``axis`` (unroll); its reverse is
    `Stack`."""

    name = "SLICE"
    Args = SliceArgs
    routed = True

    @property
    def stacked(self) -> Op:
        return STACK

    def out_spec(self, m: Move) -> LeafSpec:
        return dataclasses.replace(m.spec, shape=_without(m.spec.shape, m.args.axis))

    def detail(self, m: Move) -> str:
        return f" scan step {m.args.index} on axis {m.args.axis}"

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        assert read is not None
        return np.take(np.asarray(read(m.item, m.src)), m.args.index, axis=m.args.axis)

    def parts(self, m, path, start, data, factors) -> Iterator[tuple[tuple[int, ...], Any]]:
        a, i = m.args.axis, m.args.index
        if start[a] <= i < start[a] + data.shape[a]:
            yield start[:a] + start[a + 1 :], data[(slice(None),) * a + (i - start[a],)]

    def part_shape(self, m: Move, piece: tuple[int, ...]) -> tuple[int, ...]:
        return _without(piece, m.args.axis)


class Stack(Op):
    """The sources (one per layer) joined on ``axis``; a ``None`` layer is RNG state the
    source never had, initialised fresh. Its reverse is `Slice`."""

    name = "STACK"
    Args = StackArgs
    routed = True

    @property
    def unrolled(self) -> Op:
        return SLICE

    def sources(self, m: Move) -> tuple[Path, ...]:
        return tuple(p for p in m.args.layers if p is not None)

    def out_spec(self, m: Move) -> LeafSpec:
        a, n = m.args.axis, len(m.args.layers)
        return dataclasses.replace(m.spec, shape=_with_layers(m.spec.shape, a, n))

    def detail(self, m: Move) -> str:
        return f" on axis {m.args.axis}"

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        arrays = [
            np.asarray(read(m.item, p)) if p is not None else fresh_rng(m.spec, m.dst, i)  # type: ignore[misc]
            for i, p in enumerate(m.args.layers)
        ]
        return np.stack(arrays, axis=m.args.axis)

    def parts(self, m, path, start, data, factors) -> Iterator[tuple[tuple[int, ...], Any]]:
        a = m.args.axis
        for j, p in enumerate(m.args.layers):
            if p == path:
                yield start[:a] + (j,) + start[a:], np.expand_dims(data, a)

    def part_shape(self, m: Move, piece: tuple[int, ...]) -> tuple[int, ...]:
        return _with_layers(piece, m.args.axis, 1)

    def made_parts(self, m: Move) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
        a = m.args.axis
        for j, p in enumerate(m.args.layers):  # the layers the source lacks: fresh RNG state
            if p is None:
                x = np.expand_dims(fresh_rng(m.spec, m.dst, j), a)
                yield (0,) * a + (j,) + (0,) * (x.ndim - a - 1), x

    def makes_parts(self, m: Move) -> bool:
        return None in m.args.layers


COPY = Op.COPY = Copy()
CAST = Op.CAST = Cast()
CONSTANT = Op.CONSTANT = Constant()
SLICE = Op.SLICE = Slice()
STACK = Op.STACK = Stack()
FRESH = Op.FRESH = Fresh()
