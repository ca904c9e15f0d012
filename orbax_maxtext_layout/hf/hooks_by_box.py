"""A function of a whole array (MaxText's Hugging Face hooks) applied to a box of it.

`export_hf` gets a param as `chunks.Piece`s: boxes of a layer, one stored chunk at a time.
MaxText's hooks take a whole layer. They are made of structural ops (reshapes,
transposes, strided slices and concatenations, as the RoPE permutation) and elementwise
arithmetic with constants (the query scaling): each output element comes from one input
element. So a box of the input goes to a box of each output, and the values there are the
hooks applied to the box alone. `PieceFn.trace` records the hooks as a jaxpr (the hooks
are MaxText's, traced, never rewritten); `PieceFn.apply` runs the jaxpr on a box with
numpy, carrying the box through each op. An op it cannot carry (a gather, a scatter, a
reshape that would scatter the box) makes ``trace`` or ``apply`` say so (None), and the
caller reads the layer whole instead: never an output that is only close.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..base.array_boxes import Box, flat_run


@dataclasses.dataclass
class _Boxed:
    """A value derived from the input: ``data`` at ``box`` of a ``full``-shaped array."""

    box: Box
    data: np.ndarray
    full: tuple[int, ...]


class _Cannot(Exception):
    """The box cannot be carried through an op."""


# Elementwise ops on a box and constants (sliced to the box), run by JAX (`_elementwise`).
_ELEMENTWISE = {"mul", "div", "add", "sub", "max", "min"}
_STRUCTURAL = {
    "reshape", "transpose", "slice", "concatenate", "stack", "squeeze", "expand_dims"
}  # fmt: skip
_NESTED = {"pjit", "jit", "closed_call"}


@dataclasses.dataclass(frozen=True)
class PieceFn:
    """``fn`` (arrays -> array or tuple of arrays) traced on one input of ``shape``."""

    jaxpr: Any  # a ClosedJaxpr
    shape: tuple[int, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    held: float  # what applying it holds at most, in times the input box's bytes

    @classmethod
    def trace(
        cls, fn: Callable, shape: Sequence[int], dtype: Any, out_shapes: Sequence[Sequence[int]]
    ) -> PieceFn | None:
        """``fn`` traced on an array of ``shape`` and ``dtype``, its outputs reshaped to
        ``out_shapes``; None where it holds an op a box cannot go through."""
        import jax

        try:
            closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(tuple(shape), dtype))
        except Exception:
            return None
        if not _supported(closed.jaxpr):
            return None
        outs = tuple(tuple(int(d) for d in s) for s in out_shapes)
        got = [tuple(v.aval.shape) for v in closed.jaxpr.outvars]
        if len(got) != len(outs) or any(
            math.prod(a) != math.prod(b) for a, b in zip(got, outs, strict=True)
        ):
            return None
        return cls(closed, tuple(shape), outs, _held(closed.jaxpr, tuple(shape), dtype))

    def apply(
        self, start: Sequence[int], data: np.ndarray
    ) -> list[tuple[tuple[int, ...], np.ndarray]] | None:
        """For each output: (its box's start, its values) from the input box at ``start``
        holding ``data``; None if the box cannot be carried (then read the whole input)."""
        box = tuple((s, s + n) for s, n in zip(start, data.shape, strict=True))
        try:
            outs = _run(self.jaxpr.jaxpr, self.jaxpr.consts, [_Boxed(box, data, self.shape)])
            res = []
            for v, shape in zip(outs, self.out_shapes, strict=True):
                if not isinstance(v, _Boxed):
                    raise _Cannot("an output does not depend on the input")
                v = _reshape(v, shape)
                res.append((tuple(a for a, _ in v.box), v.data))
            return res
        except _Cannot:
            return None


_VIEWS = {"transpose", "slice", "reshape", "squeeze", "expand_dims", "copy", "copy_p"}


def _held(jaxpr: Any, shape: tuple[int, ...], dtype: Any) -> float:
    """An upper bound of what `PieceFn.apply` holds, in times the input's bytes: the input,
    every op's output that is not a view of its input (as if none were freed), and one
    contiguous copy of each output (for the writer)."""
    import numpy as np

    size = max(1, math.prod(shape) * np.dtype(dtype).itemsize)

    return 1 + (_made(jaxpr) + sum(_nbytes(v) for v in jaxpr.outvars)) / size


def _nbytes(v: Any) -> int:
    import numpy as np

    return math.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize


def _made(jaxpr: Any) -> int:
    """Bytes of every output of ``jaxpr``'s ops that is not a view of its input (nested
    jaxprs included; a module function: a closure calling itself is a reference cycle)."""
    n = 0
    for e in jaxpr.eqns:
        if e.primitive.name in _NESTED:
            n += _made(getattr(e.params["jaxpr"], "jaxpr", e.params["jaxpr"]))
        elif e.primitive.name not in _VIEWS:
            n += sum(_nbytes(v) for v in e.outvars)
    return n


def _supported(jaxpr: Any) -> bool:
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name in _NESTED:
            inner = e.params.get("jaxpr")
            if inner is None or not _supported(getattr(inner, "jaxpr", inner)):
                return False
        elif name not in _ELEMENTWISE and name not in _STRUCTURAL and not _const_only(e):
            if name not in ("convert_element_type", "neg", "copy", "copy_p"):
                return False
    return True


def _const_only(eqn: Any) -> bool:
    """An op that makes a constant (iota, broadcast of a literal): no input flows in; its
    inputs are checked when it runs (`_run` evaluates it only if all its inputs are constant)."""
    return eqn.primitive.name in ("broadcast_in_dim", "iota", "full", "empty")


def _run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if type(v).__name__ == "Literal" else env[v]

    for var, c in zip(jaxpr.constvars, consts, strict=True):
        env[var] = np.asarray(c)
    for var, a in zip(jaxpr.invars, args, strict=True):
        env[var] = a
    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        outs = _eqn(e, ins)
        for var, o in zip(e.outvars, outs, strict=True):
            env[var] = o
    return [read(v) for v in jaxpr.outvars]


def _eqn(e: Any, ins: list[Any]) -> list[Any]:
    name = e.primitive.name
    if not any(isinstance(x, _Boxed) for x in ins):  # constants only: evaluate as JAX does
        got = e.primitive.bind(*ins, **e.params)
        return [np.asarray(g) for g in (got if e.primitive.multiple_results else [got])]
    if name in _NESTED:
        inner = e.params["jaxpr"]
        return _run(inner.jaxpr, inner.consts, ins)
    if name in ("copy", "copy_p"):
        return [ins[0]]
    if name in _ELEMENTWISE or name in ("convert_element_type", "neg"):
        return [_elementwise(e, ins)]
    if name == "transpose":
        x, perm = ins[0], e.params["permutation"]
        return [
            _Boxed(
                tuple(x.box[p] for p in perm),
                np.transpose(x.data, perm),
                tuple(x.full[p] for p in perm),
            )
        ]
    if name in ("reshape", "squeeze", "expand_dims"):
        if e.params.get("dimensions") not in (None, ()) and name == "reshape":
            raise _Cannot("reshape with dimensions")
        return [_reshape(ins[0], tuple(e.outvars[0].aval.shape))]
    if name == "slice":
        return [_slice(ins[0], e.params)]
    if name == "concatenate":
        return [_concatenate(ins, e.params["dimension"])]
    if name == "stack":  # MaxText's import of llama's RoPE order (``jnp.stack``, jax 0.10+)
        return [_stack(ins, e.params["axis"])]
    raise _Cannot(name)


def _elementwise(e: Any, ins: list[Any]) -> _Boxed:
    """An arithmetic op on a box: run by JAX, as MaxText runs its hooks (XLA divides by
    multiplying with the reciprocal: NumPy's division differs in the last bit), on the
    box's values and the constants' part in the box."""
    import jax.numpy as jnp

    boxed = [x for x in ins if isinstance(x, _Boxed)]
    ref = boxed[0]
    if any(b.box != ref.box for b in boxed):
        raise _Cannot("elementwise on different boxes")
    args = []
    for x in ins:
        if isinstance(x, _Boxed):
            args.append(jnp.asarray(x.data))
            continue
        c = np.asarray(x)
        if c.ndim:  # a constant of the full shape (or broadcastable): its part in the box
            box = zip(ref.box, c.shape, strict=False)
            c = c[tuple(slice(a, b) if n > 1 else slice(None) for (a, b), n in box)]
        args.append(c)
    out = e.primitive.bind(*args, **e.params)
    return _Boxed(ref.box, np.asarray(out), ref.full)


def _full(x: _Boxed, axis: int) -> bool:
    return x.box[axis] == (0, x.full[axis])


def _slice(x: _Boxed, params: dict) -> _Boxed:
    starts, limits = params["start_indices"], params["limit_indices"]
    strides = params.get("strides") or (1,) * len(starts)
    idx, box, full = [], list(x.box), list(x.full)
    for a, (s, lim, st) in enumerate(zip(starts, limits, strides, strict=True)):
        if (s, lim, st) == (0, x.full[a], 1):
            idx.append(slice(None))
            continue
        if not _full(x, a):
            raise _Cannot("a slice across a cut axis")
        idx.append(slice(s, lim, st))
        full[a] = len(range(s, lim, st))
        box[a] = (0, full[a])
    return _Boxed(tuple(box), x.data[tuple(idx)], tuple(full))


def _concatenate(ins: list[Any], axis: int) -> _Boxed:
    if not all(isinstance(x, _Boxed) for x in ins):
        raise _Cannot("a concatenation with a constant")
    ref = ins[0]
    for x in ins:
        if not _full(x, axis) or any(
            x.box[a] != ref.box[a] for a in range(len(ref.box)) if a != axis
        ):
            raise _Cannot("a concatenation across a cut axis")
    full = list(ref.full)
    full[axis] = sum(x.full[axis] for x in ins)
    box = list(ref.box)
    box[axis] = (0, full[axis])
    data = np.concatenate([x.data for x in ins], axis=axis)
    return _Boxed(tuple(box), data, tuple(full))


def _stack(ins: list[Any], axis: int) -> _Boxed:
    """Boxes of the same place in equal arrays, stacked on a new axis (all of it)."""
    if not all(isinstance(x, _Boxed) for x in ins):
        raise _Cannot("a stack with a constant")
    ref = ins[0]
    if any(x.box != ref.box or x.full != ref.full for x in ins):
        raise _Cannot("a stack of different boxes")
    box = (*ref.box[:axis], (0, len(ins)), *ref.box[axis:])
    full = (*ref.full[:axis], len(ins), *ref.full[axis:])
    return _Boxed(box, np.stack([x.data for x in ins], axis=axis), full)


def _reshape(x: _Boxed, shape: tuple[int, ...]) -> _Boxed:
    """``x`` reshaped: each group of axes whose sizes multiply to the same number in both
    shapes must hold a contiguous run of the group's elements that is a box again."""
    if tuple(shape) == x.full:
        return x
    if math.prod(shape) != math.prod(x.full) or 0 in shape:
        raise _Cannot("reshape")
    box: list[tuple[int, int]] = []
    for ins, outs in _groups(x.full, shape):
        run = flat_run([x.box[a] for a in ins], [x.full[a] for a in ins])
        if run is None:
            raise _Cannot("a box that is not one run of the reshaped axes")
        lo, hi = run
        box += _as_box(lo, hi, [shape[a] for a in outs])
    new = tuple(b - a for a, b in box)
    return _Boxed(tuple(box), x.data.reshape(new), tuple(shape))


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[range, range]]:
    """Runs of axes of ``a`` and ``b`` with equal products (size-1 axes go with a run)."""
    out, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        i0, j0 = i, j
        pa = pb = 1
        if i < len(a):
            pa, i = a[i], i + 1
        if j < len(b):
            pb, j = b[j], j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
            elif pb < pa and j < len(b):
                pb, j = pb * b[j], j + 1
            else:
                raise _Cannot("reshape groups")
        while i < len(a) and a[i] == 1 and j == len(b):
            i += 1
        while j < len(b) and b[j] == 1 and i == len(a):
            j += 1
        out.append((range(i0, i), range(j0, j)))
    return out


def _as_box(lo: int, hi: int, sizes: list[int]) -> list[tuple[int, int]]:
    """The box of ``sizes`` whose C-order run is ``[lo, hi)``; `_Cannot` if it is none."""
    n = len(sizes)
    inner = 1
    for j in reversed(range(n)):
        size = sizes[j]
        if (
            lo % inner == 0
            and hi % inner == 0
            and lo // (inner * size) == (hi - 1) // (inner * size)
        ):
            box = []
            for a in range(n):
                below = math.prod(sizes[a + 1 :])
                if a < j:
                    i = (lo // below) % sizes[a]
                    box.append((i, i + 1))
                elif a == j:
                    box.append(((lo // below) % size, (hi - 1) // below % size + 1))
                else:
                    box.append((0, sizes[a]))
            return box
        inner *= size
    if n == 0 or (lo, hi) == (0, math.prod(sizes)):
        return [(0, s) for s in sizes]
    raise _Cannot("a run that is not a box of the reshaped axes")
