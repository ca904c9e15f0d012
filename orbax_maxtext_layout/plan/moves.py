"""What a conversion writes: one `Move` per destination leaf, each with one named op.

A `Plan` is a list of moves plus the source leaves deliberately left behind
(`Drop`, each with its reason). Like a Hugging Face weight conversion, every
destination leaf is described by a small named operation on its source leaves:

======== =====================================================================
op       destination leaf
======== =====================================================================
copy     the source leaf, stored bytes unchanged (PRNG keys keep their impl)
cast     the source leaf cast to ``cast`` (``step``: uint32 -> int32)
constant ``value``, no source (``step`` from the step directory's number)
slice    layer ``index`` of a stacked source, taken on ``axis`` (unroll)
stack    the sources (one per layer) joined on ``axis`` (stack); a ``None``
         layer is RNG state the source never had, initialised fresh
fresh    no source: RNG state initialised fresh (count 0, a derived key; with
         ``axis``, a stacked leaf whose layers are derived one by one, as for stack)
merge_lora  a base weight plus its LoRA delta, per layer ``l``:
         ``W_l + scale * reshape(A_l @ B_l, W_l.shape)`` (``lora``: the factors of
         each layer, in another item); the base layer comes as for copy, slice
         (``index``) or stack (``layers``), on ``axis``
======== =====================================================================

The same plan drives the dry-run report, the writer, the in-memory restore and
`verify`, which checks every written leaf against `apply_op` of its sources.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator

import numpy as np

from ..base.boxes import flat_run
from ..base.names import Dest
from ..base.treepaths import Path, keystr
from ..model.rng import fresh_rng
from ..orbax_io import casts
from ..orbax_io.spec import LeafSpec
from ..storage.scratch import scratch_buffer


class Op(enum.Enum):
    COPY = "copy"
    CAST = "cast"
    CONSTANT = "constant"
    SLICE = "slice"
    STACK = "stack"
    FRESH = "fresh"
    MERGE_LORA = "merge_lora"


@dataclasses.dataclass(frozen=True)
class LoraFactor:
    """The LoRA factors of a weight, read from ``item``: ``a`` (in, r) and ``b`` (r, out).

    Scanned factors stack their layers on ``axis`` (the weight's layer axis);
    ``scale`` is alpha / rank; ``layout`` places ``a @ b`` on the weight
    (`lora.delta_layouts`: ``()`` a reshape, else the permutation of an einsum weight's dims).
    """

    item: str
    a: Path
    b: Path
    a_spec: LeafSpec
    b_spec: LeafSpec
    axis: int | None
    scale: float
    layout: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    """One destination leaf ``dst`` (a full items path) and how it is made.

    ``item``/``src`` name the source leaf (for ``stack``: the first present layer,
    all layers in ``layers``); ``spec`` is the stored form of that source leaf (for
    ``constant``/``fresh``: of the leaf written). `out_spec` is what is written.
    """

    item: str
    src: Path
    dst: Path
    dest: Dest
    spec: LeafSpec
    cast: np.dtype | None = None  # stored dtype to cast to (step: uint32 -> int32)
    note: str = ""  # e.g. "synthesized from ..." for a leaf copied to a second place
    op: Op = Op.COPY
    axis: int | None = None  # slice / stack / fresh: the layer axis of the stacked side
    index: int | None = None  # slice: the layer taken
    layers: tuple[Path | None, ...] = ()  # stack: source path of each layer
    value: int | None = None  # constant
    lora: tuple[LoraFactor, ...] = ()  # merge_lora: one per layer (or one for all)

    def __post_init__(self) -> None:
        if self.cast is not None and self.op is Op.COPY:
            object.__setattr__(self, "op", Op.CAST)

    @property
    def sources(self) -> tuple[Path, ...]:
        """The source leaves read (all in ``item``)."""
        if self.op is Op.STACK or (self.op is Op.MERGE_LORA and self.layers):
            return tuple(p for p in self.layers if p is not None)
        if self.op in (Op.CONSTANT, Op.FRESH):
            return ()
        return (self.src,)

    @property
    def reads(self) -> tuple[tuple[str, Path, LeafSpec], ...]:
        """Every source leaf read, as ``(item, path, stored spec)``: `sources` in
        ``item``, plus a merge's LoRA factors (in their own item)."""
        out = [(self.item, p, self.spec) for p in self.sources]
        for f in dict.fromkeys(self.lora):
            out += [(f.item, f.a, f.a_spec), (f.item, f.b, f.b_spec)]
        return tuple(out)

    @property
    def layer_count(self) -> int | None:
        """merge_lora: how many layers the written leaf stacks on ``axis`` (None: one layer)."""
        if self.layers:
            return len(self.layers)
        if self.axis is None or self.index is not None:
            return None
        return self.spec.shape[self.axis]

    @property
    def out_spec(self) -> LeafSpec:
        """The stored form of the leaf written."""
        s = self.spec
        if self.op is Op.CAST:
            return dataclasses.replace(s, dtype=np.dtype(self.cast))
        if self.op is Op.SLICE or (self.op is Op.MERGE_LORA and self.index is not None):
            assert self.axis is not None
            return dataclasses.replace(s, shape=s.shape[: self.axis] + s.shape[self.axis + 1 :])
        if self.op is Op.STACK or (self.op is Op.MERGE_LORA and self.layers):
            assert self.axis is not None
            n = (len(self.layers),)
            return dataclasses.replace(s, shape=s.shape[: self.axis] + n + s.shape[self.axis :])
        return s

    def describe(self) -> str:
        """One line for reports: ``dst <- op(sources)``."""
        src = ", ".join(f"{self.item}/{keystr(p)}" for p in self.sources[:2])
        more = f", ... ({len(self.sources)} scan steps)" if len(self.sources) > 2 else ""
        extra = {
            Op.CAST: f" to {np.dtype(self.cast).name if self.cast is not None else ''}",
            Op.CONSTANT: f" {self.value}",
            Op.SLICE: f" scan step {self.index} on axis {self.axis}",
            Op.STACK: f" on axis {self.axis}",
            Op.MERGE_LORA: (
                f" + {self.lora[0].scale:g} * {self.lora[0].item}/"
                f"{keystr(self.lora[0].a).removesuffix('_a')}_{{a@b}}"
                + (f" scan step {self.index} on axis {self.axis}" if self.index is not None else "")
                + (
                    f", {self.layer_count} scan steps on axis {self.axis}"
                    if self.layer_count
                    else ""
                )
                if self.lora
                else ""
            ),
        }.get(self.op, "")
        return f"{keystr(self.dst)} <- {self.op.value}({src}{more}){extra}"


@dataclasses.dataclass(frozen=True, slots=True)
class Drop:
    item: str
    src: Path
    spec: LeafSpec
    reason: str


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every destination leaf (`moves`) and every source leaf left behind (`drops`).

    ``rules`` are the tree rules applied, ``step``/``step_source`` where ``step``
    comes from, ``scan`` the scan change (``"unroll"``/``"stack"``) if any, with
    ``scan_axes`` (stacked model path -> layer axis of the Params, what a replay needs).
    """

    moves: tuple[Move, ...]
    drops: tuple[Drop, ...]
    rules: tuple[str, ...]
    step: int | None
    step_source: str
    notes: tuple[str, ...] = ()
    scan: str | None = None
    scan_axes: tuple[tuple[str, int], ...] = ()

    def summary(self) -> dict[str, dict[str, int]]:
        """Leaves and bytes written per destination (and dropped): the core of every report."""
        out = {d.value: {"leaves": 0, "bytes": 0} for d in Dest}
        for m in self.moves:
            out[m.dest.value]["leaves"] += 1
            out[m.dest.value]["bytes"] += m.out_spec.nbytes
        for d in self.drops:
            out[Dest.DROPPED.value]["leaves"] += 1
            out[Dest.DROPPED.value]["bytes"] += d.spec.nbytes
        return out

    def moves_from(self, item: str) -> list[Move]:
        return [m for m in self.moves if any(i == item for i, _, _ in m.reads)]

    def source_bytes(self) -> int:
        """Bytes of source leaves the plan reads (the progress total of a conversion)."""
        seen = {(i, p): s.nbytes for m in self.moves for i, p, s in m.reads}
        return sum(seen.values())


# -- what each op computes ----------------------------------------------------------------
Reader = Callable[[str, Path], np.ndarray]


def apply_op(m: Move, read: Reader) -> np.ndarray:
    """The destination leaf of ``m`` in stored form (keys as raw data), from ``read``."""
    if m.op is Op.COPY:
        return np.asarray(read(m.item, m.src))
    if m.op is Op.CAST:
        return casts.astype(read(m.item, m.src), m.cast)  # as Orbax casts
    if m.op is Op.CONSTANT:
        return np.asarray(m.value, dtype=m.spec.dtype).reshape(m.spec.shape)
    if m.op is Op.FRESH:
        return fresh_rng(m.spec, m.dst, axis=m.axis)
    if m.op is Op.SLICE:
        return np.take(np.asarray(read(m.item, m.src)), m.index, axis=m.axis)
    if m.op is Op.MERGE_LORA:
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
    assert m.op is Op.STACK
    one = m.spec
    arrays = [
        np.asarray(read(m.item, p)) if p is not None else fresh_rng(one, m.dst, i)
        for i, p in enumerate(m.layers)
    ]
    return np.stack(arrays, axis=m.axis)


def piece_parts(
    m: Move, path: Path, start: tuple[int, ...], data: np.ndarray
) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
    """What a box of source leaf ``path`` (at ``start``, holding ``data``) puts in the leaf
    ``m`` writes: ``(start in the written leaf, values)``, for the ops that move values
    without combining them (copy, cast, slice, stack). A chunk-once writer or check walks
    each source's stored chunks once and routes every box through this."""
    if m.op is Op.COPY:
        yield start, data
    elif m.op is Op.CAST:
        yield start, casts.astype(data, m.cast)
    elif m.op is Op.SLICE:
        a = m.axis
        assert a is not None and m.index is not None
        if start[a] <= m.index < start[a] + data.shape[a]:
            yield start[:a] + start[a + 1 :], data[(slice(None),) * a + (m.index - start[a],)]
    elif m.op is Op.STACK:
        a = m.axis
        assert a is not None
        for j, p in enumerate(m.layers):
            if p == path:
                yield start[:a] + (j,) + start[a:], np.expand_dims(data, a)
    else:
        raise ValueError(f"{m.op.value} is not routed by pieces")


def part_shape(m: Move, piece: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the box a piece of a source of ``m`` (``piece`` long) puts in the leaf
    ``m`` writes: one layer of it (a slice, a merge unrolled), a layer of the leaf (a stack,
    a merge of per-layer bases), or the piece itself."""
    if m.op is Op.SLICE or (m.op is Op.MERGE_LORA and m.index is not None):
        assert m.axis is not None
        return piece[: m.axis] + piece[m.axis + 1 :]
    if m.op is Op.STACK or (m.op is Op.MERGE_LORA and m.layers):
        assert m.axis is not None
        return piece[: m.axis] + (1,) + piece[m.axis :]
    return piece


ROUTED = (Op.COPY, Op.CAST, Op.SLICE, Op.STACK)


# -- merge_lora, one layer at a time ----------------------------------------------------------
LayerReader = Callable[[str, Path, "int | None", "int | None"], np.ndarray]
"""``read_layer(item, path, axis, index)``: layer ``index`` of a stored array on ``axis``
(the whole array when ``axis`` or ``index`` is None)."""


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
