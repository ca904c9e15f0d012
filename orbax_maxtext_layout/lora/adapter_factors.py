"""A LoRA module's factors carried through MaxText's Hugging Face hooks onto PEFT's factors.

A merged weight goes out through MaxText's hooks: reshapes, transposes, a permutation of a
head's rows (llama's RoPE order), a constant scale (the query's depth scaling). Each such
hook is linear and moves every element of the kernel to one place in the HF matrix, times
a constant. When the places and the constants split into an input side and an output side,
``hook(reshape(a @ b))`` is again a product, ``lora_B @ lora_A``: each hook belongs to the
factor whose side it acts on. MaxText's own Adapter mode skips the hooks (its ``q_proj`` and
``k_proj`` are wrong for llama3.1); here they are carried, or the module is refused.

`carry` learns where a hook sends each factor's entries from four probes through the real
hook (one factor a one-hot vector, the other ones or the entry numbers), so that the map
holds for any hook made of such moves, and nothing about MaxText's hooks is assumed.
Each probe's input is zero but on one line, so a caller that can put one line of a
matrix through the hooks (``line``: `import-hf --as-lora`, MaxText's hooks traced and run
on a box, `hf/hooks_by_box`) spares the four kernel-size calls; where it cannot, the hook
runs on the whole matrix. `check` then compares ``hook(delta)`` with the carried product
on a real layer, through the real hook: a hook the probes misread (one that mixes
entries) fails there, and the module is refused. Nothing here is approximate: a map either
reproduces the hooked delta to float32 rounding or is not used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

Hook = Callable[[np.ndarray], np.ndarray]  # a kernel -> its HF matrix (out, in)
Delta = Callable[[np.ndarray, np.ndarray], np.ndarray]  # a (in, r), b (r, out) -> a kernel

# The carried product must equal the hooked delta to this, relative to the delta's largest
# entry: float32 rounding of a sum over the rank, with room for a constant's rounding.
TOLERANCE = 1e-5
CHECK_BLOCK = 32 << 20  # bytes of the carried product held at once by `check`


@dataclasses.dataclass(frozen=True)
class FactorMap:
    """Where a module's factors go in PEFT's: ``lora_A[k, c] = in_scale[c] * a[in_index[c],
    k]`` and ``lora_B[r, k] = out_scale[r] * b[k, out_index[r]]``, so that ``lora_B @
    lora_A`` is the hooked ``reshape(a @ b)``."""

    in_index: np.ndarray
    in_scale: np.ndarray
    out_index: np.ndarray
    out_scale: np.ndarray

    def peft(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """PEFT's ``lora_A (r, in)`` and ``lora_B (out, r)`` of one layer's ``a (in, r)`` and
        ``b (r, out)``, in the factors' dtype."""
        dt = np.result_type(a.dtype, b.dtype)
        lora_a = (np.asarray(a, np.float64)[self.in_index, :] * self.in_scale[:, None]).T
        lora_b = np.asarray(b, np.float64)[:, self.out_index].T * self.out_scale[:, None]
        return np.ascontiguousarray(lora_a, dt), np.ascontiguousarray(lora_b, dt)


@dataclasses.dataclass(frozen=True)
class Entries:
    """The nonzero entries of a hooked probe, a matrix of ``shape`` (the hook's output,
    ``(out, in)``): ``values`` at ``(rows, cols)``, each place once."""

    rows: np.ndarray
    cols: np.ndarray
    values: np.ndarray
    shape: tuple[int, int]


# The hooked delta of a probe: ``axis`` 0: factor ``a`` the one-hot ``e_0`` and ``b`` the
# row ``vec`` (n_out); 1: ``a`` the column ``vec`` (n_in) and ``b`` the one-hot. None: it
# cannot be had on the line alone (`carry` runs the hook on the whole matrix then).
Line = Callable[[int, np.ndarray], "Entries | None"]


def carry(
    hook: Hook, delta: Delta, n_in: int, n_out: int, *, line: Line | None = None
) -> FactorMap | str:
    """The `FactorMap` of a module whose per-layer factors are ``a (n_in, r)`` and ``b (r,
    n_out)``, or why the hook cannot be carried onto them (a sentence). ``line``: the
    hooked probes a line at a time, where the caller can (`Line`)."""

    def hooked(axis: int, vec: np.ndarray) -> np.ndarray | Entries:
        got = None if line is None else line(axis, vec)
        if got is not None:
            return got
        if axis == 0:
            return np.asarray(hook(delta(_one_hot(n_in), vec[None, :])))
        return np.asarray(hook(delta(vec[:, None], _one_hot(n_out).T)))

    codes_in = np.arange(1, n_in + 1, dtype=np.float64)
    codes_out = np.arange(1, n_out + 1, dtype=np.float64)
    b_side = _probe(hooked, np.ones(n_out), codes_out, axis=0)
    a_side = _probe(hooked, np.ones(n_in), codes_in, axis=1)
    for side, got in (("output", b_side), ("input", a_side)):
        if isinstance(got, str):
            return f"its hooks do not act on the {side} side alone ({got})"
    (j0, out_raw, out_index), (r0, in_scale, in_index) = b_side, a_side
    if sorted(out_index.tolist()) != list(range(n_out)):
        return "its hooks do not move the output entries one to one"
    if sorted(in_index.tolist()) != list(range(n_in)):
        return "its hooks do not move the input entries one to one"
    if out_index[r0] != 0 or in_index[j0] != 0:
        return "its hooks place the two sides inconsistently"
    s = out_raw[r0]  # both probes hold c_in[0] * c_out[0] at (r0, j0)
    if not np.isclose(in_scale[j0], s, rtol=TOLERANCE, atol=0):
        return "its hooks scale the two sides inconsistently"
    return FactorMap(in_index, in_scale, out_index, out_raw / s)


def _one_hot(n: int) -> np.ndarray:
    e = np.zeros((n, 1))
    e[0, 0] = 1.0
    return e


def _probe(hooked: Callable, ones: np.ndarray, codes: np.ndarray, *, axis: int):
    """One side's map: the hooked delta of a one-hot on the other side with ones, then with
    the entry numbers (``codes``) on this side. ``axis`` 0: this side is the HF matrix's
    rows (the output), 1: its columns. Returns ``(line, scale, index)``: the one HF column
    (or row) the one-hot lands in, each entry's constant and its source entry; or why not."""
    # Kernel-size matrices (without ``line``): only the one line is kept (float64).
    got = hooked(axis, ones)
    if not isinstance(got, Entries) and got.ndim != 2:
        return f"the Hugging Face tensor is {got.ndim}-dimensional, not a matrix"
    lines = _lines(got, axis)
    if len(lines) != 1:
        return f"one entry lands in {len(lines)} {'columns' if axis == 0 else 'rows'}"
    line = int(lines[0])
    scale = _on_line(got, axis, line)
    del got
    if np.any(scale == 0):
        return "an entry is lost"
    numbered = hooked(axis, codes)
    got = _on_line(numbered, axis, line)
    del numbered
    index = np.rint(got / scale) - 1
    if np.any(np.abs(got / scale - 1 - index) > 1e-3) or np.any(index < 0):
        return "an entry is not moved whole"
    return line, scale, index.astype(np.int64)


def _lines(got: np.ndarray | Entries, axis: int) -> np.ndarray:
    """The columns (``axis`` 0) or rows (1) holding a nonzero entry."""
    if isinstance(got, Entries):
        return np.unique(got.cols if axis == 0 else got.rows)
    return np.flatnonzero(np.any(got, axis=axis))


def _on_line(got: np.ndarray | Entries, axis: int, line: int) -> np.ndarray:
    """Column (``axis`` 0) or row (1) ``line`` of the hooked probe, float64."""
    if not isinstance(got, Entries):
        return np.array(got[:, line] if axis == 0 else got[line, :], np.float64)
    out = np.zeros(got.shape[axis], np.float64)
    on = (got.cols if axis == 0 else got.rows) == line
    out[(got.rows if axis == 0 else got.cols)[on]] = got.values[on]
    return out


def check(hook: Hook, delta: Delta, fmap: FactorMap, a: np.ndarray, b: np.ndarray) -> float:
    """How far the carried product of one layer's factors is from the hooked delta, relative
    to the delta's largest entry (0 when both are zero). At most `TOLERANCE` to be used."""
    want = np.asarray(hook(delta(np.asarray(a, np.float32), np.asarray(b, np.float32))))
    return check_hooked(want, fmap, a, b)


def check_hooked(want: np.ndarray, fmap: FactorMap, a: np.ndarray, b: np.ndarray) -> float:
    """`check` against ``want``, the hooked delta computed by the caller (an expert's: its
    slice of the delta the merge adds to the whole layer)."""
    want = np.asarray(want)
    lora_a, lora_b = fmap.peft(a, b)
    la, lb = np.asarray(lora_a, np.float64), np.asarray(lora_b, np.float64)
    if want.ndim != 2 or want.shape != (lb.shape[0], la.shape[1]):
        return float("inf")
    top = err = 0.0
    rows = max(1, CHECK_BLOCK // max(1, 8 * la.shape[1]))  # the product, a block of rows
    for r0 in range(0, want.shape[0], rows):
        w = want[r0 : r0 + rows]
        top = max(top, float(np.max(np.abs(w), initial=0.0)))
        err = max(err, float(np.max(np.abs(lb[r0 : r0 + rows] @ la - w), initial=0.0)))
    return 0.0 if top == 0 and err == 0 else err / (top or 1.0)
