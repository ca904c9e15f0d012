"""The LoRA delta's numerics: ``W + scale * reshape(A @ B, W.shape)``, a layer at a time
(`merge_layer`, in row blocks, in place in the writer's buffer) or a box at a time
(`merge_part`, the factors' matching rows and columns: `factor_boxes`)."""

from __future__ import annotations

import numpy as np

from ..base.array_boxes import flat_run
from ..plan.moves import LayerReader, Move
from ..storage.scratch import scratch_buffer


def merge_layer(m: Move, i: int, read_layer: LayerReader, *, inplace: bool = False) -> np.ndarray:
    """Layer ``i`` of a merge_lora move's output: ``W_i + scale * reshape(A_i @ B_i, W_i.shape)``.

    Computed in at least float32 and cast to the base dtype once (a bf16 base gives a
    bf16 result, rounded to nearest even), in row blocks so that no temporary is larger
    than a few MiB. With ``inplace`` the result overwrites the layer just read (the
    writer's own buffer), so a layer costs one slice of memory plus the blocks.
    """
    w = merge_base(m, i, read_layer)
    g = m.args  # `merge_op.MergeArgs`
    f = g.lora[i] if len(g.lora) > 1 else g.lora[0]
    li = g.index if g.index is not None else i
    a = read_layer(f.item, f.a, f.axis, li if f.axis is not None else None)
    b = read_layer(f.item, f.b, f.axis, li if f.axis is not None else None)
    return lora_delta_added(w, a, b, f.scale, inplace=inplace, layout=f.layout)


def merge_base(m: Move, i: int, read_layer: LayerReader) -> np.ndarray:
    """Layer ``i`` of a merge_lora move's base weight, as stored."""
    g = m.args
    if g.layers:
        return read_layer(m.item, g.layers[i], None, None)  # type: ignore[arg-type]
    if g.index is not None:
        return read_layer(m.item, m.src, g.axis, g.index)
    return read_layer(m.item, m.src, g.axis, i if g.axis is not None else None)


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
    g = m.args
    f = g.lora[i] if len(g.lora) > 1 else g.lora[0]
    li = g.index if g.index is not None else i
    a = read_layer(f.item, f.a, f.axis, li if f.axis is not None else None)
    b = read_layer(f.item, f.b, f.axis, li if f.axis is not None else None)
    full = m.spec.shape if g.layers else _layer_shape(m)
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
    s, a = m.spec.shape, m.args.axis
    return s if a is None else s[:a] + s[a + 1 :]


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
