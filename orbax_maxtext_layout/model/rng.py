"""RNG state in a model tree: which leaves are RNG state, and fresh RNG state for the
leaves a checkpoint lacks.

Stacking an unscanned model (`scan_trees.stack` in memory, ``convert --stack`` on disk
through the plan's ``stack``/``fresh`` ops) has to initialise RNG state the unscanned checkpoint
never held (DOMAIN.md section 6: unscanned models store a shared stream once). Both
derive it here, so the same missing leaf gets the same key however it is stacked.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import numpy as np

from ..base.treepaths import Path, keystr
from ..orbax_io.spec import LeafSpec

__all__ = ["fresh_rng", "is_rng"]


def is_rng(path: Path) -> bool:
    """RNG state: ``.../rngs/<stream>/{count,key}`` (a model path, no ``value`` level)."""
    return len(path) >= 3 and path[-3] == "rngs" and path[-1] in ("count", "key")


def fresh_rng(
    spec: LeafSpec, path: Path, layer: int = 0, *, seed: int = 0, axis: int | None = None
) -> np.ndarray:
    """Fresh RNG state in stored form (keys as raw data): a count is 0, a key is derived.

    ``path`` is the leaf's full MaxText items path (``nnx_aux/model/...``, whatever tree
    it sits in) and ``layer`` its layer in a scanned block (0 outside one). The key is
    ``fold_in(key(crc32(path)), layer)``: deterministic, so a replay (`verify`) produces
    the same bits. This is the derivation ``convert --stack`` has always written, kept so
    that keys already on disk stay reproducible. ``seed`` (`scan_trees.stack`'s
    ``rng_seed``) is folded in first when not 0, so seed 0 gives exactly those keys. A spec holding
    several keys per layer gets them split from that one key. With ``axis``, ``spec`` is
    a leaf stacked on ``axis`` and layer ``i`` is derived as layer ``i`` (the stack of
    the per-layer leaves, as when only some layers are missing).
    """
    if path[-1] == "count" or not spec.key_impl:
        return np.zeros(spec.shape, spec.dtype)
    if axis is not None:
        one = dataclasses.replace(spec, shape=spec.shape[:axis] + spec.shape[axis + 1 :])
        layers = [fresh_rng(one, path, i, seed=seed) for i in range(spec.shape[axis])]
        return np.stack(layers, axis=axis)
    import jax  # only needed for keys

    key = jax.random.key(zlib.crc32(keystr(path).encode()), impl=spec.key_impl)
    if seed:
        key = jax.random.fold_in(key, seed)
    key = jax.random.fold_in(key, layer)
    n = math.prod(spec.shape[:-1])  # keys per layer; the last axis is one key's data
    if n != 1:
        key = jax.random.split(key, n)
    return np.asarray(jax.random.key_data(key)).reshape(spec.shape).astype(spec.dtype)
