"""One class per op (`moves.Op`, the interface): what each writes, what it reads, how it
applies to a whole leaf and to a box, and its reverse where there is one (``slice`` and
``stack``). The LoRA merge's class is beside them (`MergeLora`), with its numerics.

Each op has one instance, named as the enum named it (``COPY``, ``CAST``, ...) and
registered on `moves.Op` (``Op.COPY``), which `moves.Move` defaults to and the public API
offers. Like transformers' conversion ops: callers ask the op, never which op it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..base.boxes import flat_run
from ..base.treepaths import Path, keystr
from ..model.rng import fresh_rng
from ..orbax_io import casts
from ..orbax_io.spec import LeafSpec
from ..storage.scratch import scratch_buffer
from .moves import LayerReader, Move, Op, Reader

__all__ = [
    "CAST",
    "CONSTANT",
    "COPY",
    "FRESH",
    "MERGE_LORA",
    "SLICE",
    "STACK",
    "apply_op",
    "factor_boxes",
    "lora_delta_added",
    "merge_base",
    "merge_layer",
    "merge_part",
]


def apply_op(m: Move, read: Reader | None) -> np.ndarray:
    """The destination leaf of ``m`` in stored form (keys as raw data), from ``read``."""
    return m.op.apply(m, read)


def _without(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return shape[:axis] + shape[axis + 1 :]


def _with_layers(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    return shape[:axis] + (n,) + shape[axis:]


class Copy(Op):
    """The source leaf, stored bytes unchanged (PRNG keys keep their impl)."""

    name = "COPY"
    renames = elementwise = routed = True

    def casting(self, cast: np.dtype | None) -> Op:
        return self if cast is None else CAST

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
    elementwise = routed = True

    def out_spec(self, m: Move) -> LeafSpec:
        return dataclasses.replace(m.spec, dtype=np.dtype(m.cast))

    def detail(self, m: Move) -> str:
        return f" to {np.dtype(m.cast).name if m.cast is not None else ''}"

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        assert read is not None
        return casts.astype(read(m.item, m.src), m.cast)  # as Orbax casts

    def assemble(self, m: Move, read: Any) -> Any:
        x = read(m.item, m.src)
        if np.dtype(x.dtype) != m.cast:
            x = casts.astype(x, m.cast)  # as Orbax casts (tensorstore's cast)
        return x

    def parts(self, m, path, start, data, factors) -> Iterator[tuple[tuple[int, ...], Any]]:
        yield start, casts.astype(data, m.cast)


class Constant(Op):
    """``value``, no source (``step`` from the step directory's number)."""

    name = "CONSTANT"
    made = True

    def sources(self, m: Move) -> tuple[Path, ...]:
        return ()

    def detail(self, m: Move) -> str:
        return f" {m.value}"

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        return np.asarray(m.value, dtype=m.spec.dtype).reshape(m.spec.shape)


class Fresh(Op):
    """No source: RNG state initialised fresh (count 0, a derived key; with ``axis``, a
    stacked leaf whose layers are derived one by one, as for stack)."""

    name = "FRESH"
    made = True

    def sources(self, m: Move) -> tuple[Path, ...]:
        return ()

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        return fresh_rng(m.spec, m.dst, axis=m.axis)


class Slice(Op):
    """Layer ``index`` of a stacked source, taken on ``axis`` (unroll); its reverse is
    `Stack`."""

    name = "SLICE"
    routed = True

    @property
    def stacked(self) -> Op:
        return STACK

    def out_spec(self, m: Move) -> LeafSpec:
        assert m.axis is not None
        return dataclasses.replace(m.spec, shape=_without(m.spec.shape, m.axis))

    def detail(self, m: Move) -> str:
        return f" scan step {m.index} on axis {m.axis}"

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        assert read is not None
        return np.take(np.asarray(read(m.item, m.src)), m.index, axis=m.axis)

    def parts(self, m, path, start, data, factors) -> Iterator[tuple[tuple[int, ...], Any]]:
        a = m.axis
        assert a is not None and m.index is not None
        if start[a] <= m.index < start[a] + data.shape[a]:
            yield start[:a] + start[a + 1 :], data[(slice(None),) * a + (m.index - start[a],)]

    def part_shape(self, m: Move, piece: tuple[int, ...]) -> tuple[int, ...]:
        assert m.axis is not None
        return _without(piece, m.axis)


class Stack(Op):
    """The sources (one per layer) joined on ``axis``; a ``None`` layer is RNG state the
    source never had, initialised fresh. Its reverse is `Slice`."""

    name = "STACK"
    routed = True

    @property
    def unrolled(self) -> Op:
        return SLICE

    def sources(self, m: Move) -> tuple[Path, ...]:
        return tuple(p for p in m.layers if p is not None)

    def out_spec(self, m: Move) -> LeafSpec:
        assert m.axis is not None
        return dataclasses.replace(m.spec, shape=_with_layers(m.spec.shape, m.axis, len(m.layers)))

    def detail(self, m: Move) -> str:
        return f" on axis {m.axis}"

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        arrays = [
            np.asarray(read(m.item, p)) if p is not None else fresh_rng(m.spec, m.dst, i)  # type: ignore[misc]
            for i, p in enumerate(m.layers)
        ]
        return np.stack(arrays, axis=m.axis)

    def parts(self, m, path, start, data, factors) -> Iterator[tuple[tuple[int, ...], Any]]:
        a = m.axis
        assert a is not None
        for j, p in enumerate(m.layers):
            if p == path:
                yield start[:a] + (j,) + start[a:], np.expand_dims(data, a)

    def part_shape(self, m: Move, piece: tuple[int, ...]) -> tuple[int, ...]:
        assert m.axis is not None
        return _with_layers(piece, m.axis, 1)

    def made_parts(self, m: Move) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
        a = m.axis
        assert a is not None
        for j, p in enumerate(m.layers):  # the layers the source lacks: fresh RNG state
            if p is None:
                x = np.expand_dims(fresh_rng(m.spec, m.dst, j), a)
                yield (0,) * a + (j,) + (0,) * (x.ndim - a - 1), x

    def makes_parts(self, m: Move) -> bool:
        return None in m.layers


class MergeLora(Op):
    """A base weight plus its LoRA delta, per layer ``l``:
    ``W_l + scale * reshape(A_l @ B_l, W_l.shape)`` (``lora``: the factors of each layer, in
    another item); the base layer comes as for copy, slice (``index``) or stack
    (``layers``), on ``axis``. Unrolled or stacked, a merge stays a merge."""

    name = "MERGE_LORA"
    by_layer = True

    @property
    def unrolled(self) -> Op:
        return self  # it then merges layer ``index`` only

    @property
    def stacked(self) -> Op:
        return self  # each layer merged with its own factors

    def sources(self, m: Move) -> tuple[Path, ...]:
        if m.layers:
            return tuple(p for p in m.layers if p is not None)
        return (m.src,)

    def out_spec(self, m: Move) -> LeafSpec:
        s = m.spec
        if m.index is not None:
            assert m.axis is not None
            return dataclasses.replace(s, shape=_without(s.shape, m.axis))
        if m.layers:
            assert m.axis is not None
            return dataclasses.replace(s, shape=_with_layers(s.shape, m.axis, len(m.layers)))
        return s

    def detail(self, m: Move) -> str:
        if not m.lora:
            return ""
        f = m.lora[0]
        return (
            f" + {f.scale:g} * {f.item}/{keystr(f.a).removesuffix('_a')}_{{a@b}}"
            + (f" scan step {m.index} on axis {m.axis}" if m.index is not None else "")
            + (f", {m.layer_count} scan steps on axis {m.axis}" if m.layer_count else "")
        )

    def apply(self, m: Move, read: Reader | None) -> np.ndarray:
        assert read is not None
        cache: dict[tuple[str, Path], np.ndarray] = {}

        def layer(item: str, p: Path, axis: int | None, i: int | None) -> np.ndarray:
            if (item, p) not in cache:
                cache[item, p] = np.asarray(read(item, p))
            x = cache[item, p]
            return x if axis is None or i is None else np.take(x, i, axis=axis)

        n = m.layer_count
        if n is None:
            return merge_layer(m, 0, layer)
        return np.stack([merge_layer(m, i, layer) for i in range(n)], axis=m.axis)

    def part_shape(self, m: Move, piece: tuple[int, ...]) -> tuple[int, ...]:
        if m.index is not None:
            assert m.axis is not None
            return _without(piece, m.axis)
        if m.layers:
            assert m.axis is not None
            return _with_layers(piece, m.axis, 1)
        return piece

    def splits(self, m: Move, piece: tuple[int, ...]) -> bool:
        """Whether every piece of the base is a box of a layer that is one run of the
        factors' rows and columns (then the delta is computed piece by piece)."""
        if m.axis is not None and not m.layers:  # a layer's part of a stacked base's piece
            piece = _without(piece, m.axis)
        f = m.lora[0]
        layer = m.spec.shape if m.layers or m.axis is None else _without(m.spec.shape, m.axis)
        part = tuple(min(p, n) for p, n in zip(piece, layer, strict=True))
        a = tuple(_without(f.a_spec.shape, f.axis) if f.axis is not None else f.a_spec.shape)
        b = tuple(_without(f.b_spec.shape, f.axis) if f.axis is not None else f.b_spec.shape)
        return factor_boxes(layer, (0,) * len(layer), part, a, b, layout=f.layout) is not None

    def parts(self, m, path, start, data, factors) -> Iterator[tuple[tuple[int, ...], Any]]:
        """A piece of the base: its own box merged (`merge_part` per layer), the layers of a
        stacked base merged in one buffer."""
        a = m.axis
        if m.layers:  # per-layer bases stacked on ``axis``
            for j, p in enumerate(m.layers):
                if p == path:
                    got = merge_part(m, j, start, data, factors)
                    yield start[:a] + (j,) + start[a:], np.expand_dims(_split(got), a)
        elif m.index is not None:  # one layer of a stacked base, unrolled
            if start[a] <= m.index < start[a] + data.shape[a]:
                part = data[(slice(None),) * a + (m.index - start[a],)]
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
        out = m.out_spec.shape
        if m.layer_count is not None:
            assert m.axis is not None
            return out[: m.axis] + (1,) + out[m.axis + 1 :]
        return out

    def by_box(self, m: Move) -> bool:
        return not m.layers and m.index is None

    def box(self, m, i, start, w, factors) -> np.ndarray | None:
        return merge_part(m, i, start, w, factors)

    def layer(self, m, axis, index, read, cache) -> np.ndarray:
        whole = lambda item, p: read(item, p, None, None)  # noqa: E731
        if index is None:  # the whole merged param: what the op computes
            return self.apply(m, whole)
        if m.axis != axis:  # cut on another axis first (MoE experts): merged whole, once
            if ("merged", m.dst) not in cache:
                cache["merged", m.dst] = self.apply(m, whole)
            return cache["merged", m.dst][(slice(None),) * axis + (index,)]
        return merge_layer(m, index, read)

    def piece_overhead(self, m: Move) -> float:
        return 1 + 4 / max(1, np.dtype(m.spec.dtype).itemsize)  # the delta (f32), its sum


def _split(x: np.ndarray | None) -> np.ndarray:
    if x is None:  # `splits` said it would split
        raise AssertionError("a merge piece did not split onto its factors")
    return x


COPY = Op.COPY = Copy()
CAST = Op.CAST = Cast()
CONSTANT = Op.CONSTANT = Constant()
SLICE = Op.SLICE = Slice()
STACK = Op.STACK = Stack()
FRESH = Op.FRESH = Fresh()
MERGE_LORA = Op.MERGE_LORA = MergeLora()


# -- merge_lora, one layer at a time ----------------------------------------------------------
def merge_layer(m: Move, i: int, read_layer: LayerReader, *, inplace: bool = False) -> np.ndarray:
    """Layer ``i`` of a merge_lora move's output: ``W_i + scale * reshape(A_i @ B_i, W_i.shape)``.

    Computed in at least float32 and cast to the base dtype once (a bf16 base gives a
    bf16 result, rounded to nearest even), in row blocks so that no temporary is larger
    than a few MiB. With ``inplace`` the result overwrites the layer just read (the
    writer's own buffer), so a layer costs one slice of memory plus the blocks.
    """
    w = merge_base(m, i, read_layer)
    f = m.lora[i] if len(m.lora) > 1 else m.lora[0]
    li = m.index if m.index is not None else i
    a = read_layer(f.item, f.a, f.axis, li if f.axis is not None else None)
    b = read_layer(f.item, f.b, f.axis, li if f.axis is not None else None)
    return lora_delta_added(w, a, b, f.scale, inplace=inplace, layout=f.layout)


def merge_base(m: Move, i: int, read_layer: LayerReader) -> np.ndarray:
    """Layer ``i`` of a merge_lora move's base weight, as stored."""
    if m.layers:
        return read_layer(m.item, m.layers[i], None, None)  # type: ignore[arg-type]
    if m.index is not None:
        return read_layer(m.item, m.src, m.axis, m.index)
    return read_layer(m.item, m.src, m.axis, i if m.axis is not None else None)


def lora_delta_added(
    w: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    scale: float,
    *,
    inplace: bool = False,
    layout: tuple[int, ...] = (),
) -> np.ndarray:
    """``w + scale * reshape(a @ b, w.shape)`` computed in at least float32, cast once;
    with a ``layout`` (an einsum weight's factors, `lora.delta_layouts`), ``a @ b`` over the
    rank with its dims put in ``w``'s order instead of reshaped."""
    wide = np.float64 in (np.dtype(w.dtype), np.dtype(a.dtype), np.dtype(b.dtype))
    acc = np.float64 if wide else np.float32
    # In place only into a buffer of its own that a reshape views (not a strided view).
    own = inplace and w.flags.writeable and w.flags.c_contiguous
    out = w if own else np.empty(w.shape, w.dtype)
    if layout:
        d = np.tensordot(np.asarray(a, acc), np.asarray(b, acc), axes=([-1], [0]))
        d = np.transpose(d, layout)
        d *= acc(scale)
        d += w
        out[...] = d  # the one cast to the base dtype (nearest even)
        return out
    a = np.reshape(a, (-1, a.shape[-1]))
    b = np.reshape(b, (b.shape[0], -1))
    rows = a.shape[0]
    w2 = np.reshape(w, (rows, -1))
    o2 = np.reshape(out, (rows, -1))
    a32 = np.asarray(a, acc)
    b32 = np.asarray(b, acc)
    block = max(1, (4 << 20) // max(1, b32.shape[1] * np.dtype(acc).itemsize))
    # One scratch block per thread, reused: a fresh multi-MiB temporary per block is a
    # fresh mapping whose pages the kernel zeroes on first touch (most of a merge's time
    # went to those page faults).
    scratch = _scratch((min(block, rows), b32.shape[1]), acc)
    for r0 in range(0, rows, block):
        d = scratch[: min(block, rows - r0)]
        np.matmul(a32[r0 : r0 + block], b32, out=d)
        d *= acc(scale)
        d += w2[r0 : r0 + block]
        o2[r0 : r0 + block] = d  # the one cast to the base dtype (nearest even)
    return out


def merge_part(
    m: Move, i: int, start: tuple[int, ...], w: np.ndarray, read_layer: LayerReader
) -> np.ndarray | None:
    """The box at ``start`` of layer ``i`` of a merge_lora move's output, from the base's
    values there (``w``): ``w + scale * (A_i @ B_i)[box]``, the delta computed for the box
    alone from the factors' matching rows and columns. None where the box does not split
    onto the factors (a dense kernel's box that is not one run of its rows and columns):
    merge the layer whole (`merge_layer`)."""
    f = m.lora[i] if len(m.lora) > 1 else m.lora[0]
    li = m.index if m.index is not None else i
    a = read_layer(f.item, f.a, f.axis, li if f.axis is not None else None)
    b = read_layer(f.item, f.b, f.axis, li if f.axis is not None else None)
    full = m.spec.shape if m.layers else _layer_shape(m)
    boxes = factor_boxes(full, start, w.shape, a.shape, b.shape, layout=f.layout)
    if boxes is None:
        return None
    wide = np.float64 in (np.dtype(w.dtype), np.dtype(a.dtype), np.dtype(b.dtype))
    acc = np.float64 if wide else np.float32
    ka, kb = boxes
    d = np.tensordot(np.asarray(a[ka], acc), np.asarray(b[kb], acc), axes=([-1], [0]))
    if f.layout:
        d = np.transpose(d, f.layout)
    d = d.reshape(w.shape)
    d *= acc(f.scale)
    d += w
    return d.astype(w.dtype)


def _layer_shape(m: Move) -> tuple[int, ...]:
    s = m.spec.shape
    return s if m.axis is None else s[: m.axis] + s[m.axis + 1 :]


def factor_boxes(full, start, shape, a_shape, b_shape, *, layout) -> tuple | None:
    """The boxes of factors ``a`` and ``b`` whose product is the box ``start`` (``shape``
    long) of a layer of ``full`` shape; None if there are none."""
    box = [(s, s + n) for s, n in zip(start, shape, strict=True)]
    if layout:  # an einsum weight: the delta's dims are a's, then b's, permuted
        back = [None] * len(full)
        for j, q in enumerate(layout):
            back[q] = box[j]
        na = len(a_shape) - 1
        ka = tuple(slice(*r) for r in back[:na]) + (slice(None),)
        kb = (slice(None),) + tuple(slice(*r) for r in back[na:])
        return ka, kb
    p, rows = 0, 1  # a dense kernel: its leading dims flattened into a's rows
    while p < len(full) and rows < a_shape[0]:
        rows *= full[p]
        p += 1
    if rows != a_shape[0] or len(a_shape) != 2 or len(b_shape) != 2:
        return None
    r = flat_run(box[:p], full[:p])
    c = flat_run(box[p:], full[p:])
    if r is None or c is None:
        return None
    return (slice(*r), slice(None)), (slice(None), slice(*c))


def _scratch(shape: tuple[int, int], dtype: type) -> np.ndarray:
    """This thread's scratch block of at least ``shape`` (`scratch`: kept for the next call)."""
    need = shape[0] * shape[1]
    item = np.dtype(dtype).itemsize
    return scratch_buffer("merge", need * item).view(dtype)[:need].reshape(shape)
