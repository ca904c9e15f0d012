"""The transposing copy of 2-byte items, compiled (``_transpose.c``), without the GIL.

import-hf copies every Hugging Face kernel (``[out, in]``) into MaxText's ``[in, out]``
before it is encoded: 13 of an 8B llama's 15 GiB. NumPy's word-packing copy
(`hf.import_hf._transpose`) moves 1.8 to 2.0 GiB/s a thread here and holds the GIL between
its many calls; the compiled one moves 4.1, and two workers run it side by side. The package
builds it where it is installed with a C compiler (``setup.py``: optional); without it every
copy goes NumPy's way, with the same result.
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
