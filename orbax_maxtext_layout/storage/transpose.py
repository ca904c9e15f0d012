"""The transposing copy of 2-byte items, and the bfloat16 sum of a merged adapter, compiled
(``_transpose.c``), without the GIL.

import-hf copies every Hugging Face kernel (``[out, in]``) into MaxText's ``[in, out]``
before it is encoded: 13 of an 8B llama's 15 GiB. NumPy's word-packing copy
(`hf.import_hf._transpose`) moves 1.8 to 2.0 GiB/s a thread here and holds the GIL between
its many calls; the compiled one moves 4.1, and two workers run it side by side. The package
builds it where it is installed with a C compiler (``setup.py``: optional); without it every
copy goes NumPy's way, with the same result.

`add_scaled_bf16` is ``import-hf --adapter``'s sum of a bfloat16 weight and a scaled float32
delta, rounded to bfloat16, in one pass (`lora.peft_adapter.AdapterPlan.merge`): bit for bit
NumPy's three passes (the scale, the sum, ml_dtypes' cast), which took 1.6 ns an item here,
most of an 8B merge; without it, NumPy's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    from . import _transpose as _native
except ImportError:  # not built here (no compiler at install, or run from a source tree)
    _native = None


def native() -> Any:
    """The compiled module, or None where it was not built."""
    return _native


def transpose_into(out: np.ndarray, src: np.ndarray) -> bool:
    """``out[...] = src`` by the compiled copy, where it applies: ``out`` C-contiguous 2-D,
    ``src`` a 2-D transposed view (``src.T``'s rows contiguous) of 2-byte items of the same
    shape. False (nothing copied) where it does not, or where it was not built."""
    if (
        _native is None
        or out.ndim != 2
        or src.shape != out.shape
        or out.itemsize != 2
        or src.itemsize != 2
        or not out.flags.c_contiguous
    ):
        return False
    # the buffer protocol knows no ml_dtypes bfloat16: the same bytes as uint16
    _native.transpose(out.view(np.uint16), src.view(np.uint16))
    return True


def add_scaled_bf16(out: np.ndarray, d: np.ndarray, w: np.ndarray, scale: float) -> bool:
    """``out[...] = bfloat16(d * float32(scale) + w)`` by the compiled loop: ``d`` float32,
    ``w`` and ``out`` bfloat16 (``out`` may be ``w``), all C-contiguous of one shape; the
    product and the sum each rounded in float32 and the sum to bfloat16 to nearest even, as
    NumPy's ``d *= scale; d += w; out[...] = d`` rounds them. False (nothing written) where
    it does not apply, or where it was not built (or built before it had the loop)."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    if (
        getattr(_native, "add_scaled_bf16", None) is None
        or out.dtype != bf16
        or w.dtype != bf16
        or d.dtype != np.float32
        or not (out.shape == d.shape == w.shape)
        or not (out.flags.c_contiguous and d.flags.c_contiguous and w.flags.c_contiguous)
    ):
        return False
    _native.add_scaled_bf16(
        out.view(np.uint16), d, w.view(np.uint16), float(np.float32(scale))
    )  # fmt: skip
    return True
