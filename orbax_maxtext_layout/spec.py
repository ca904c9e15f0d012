"""Leaf specs: what a leaf looks like on disk, read from Orbax metadata only."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from .errors import CheckpointReadError
from .orbax_files import absolute, key_impls
from .paths import FlatTree, Path, flatten, norm_key


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Shape and dtype of a leaf *as stored*.

    A typed PRNG key array of shape ``S`` is stored as uint32 ``S + (2,)`` and is
    told apart only by ``key_impl`` (Orbax's ``random_key_impl`` ext-metadata),
    so specs always compare in that stored form.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    key_impl: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def abstract(self) -> jax.ShapeDtypeStruct:
        """The in-memory abstract value: a typed key array for key specs."""
        if self.key_impl:
            dtype = jax.random.key(0, impl=self.key_impl).dtype
            return jax.ShapeDtypeStruct(self.shape[:-1], dtype)
        return jax.ShapeDtypeStruct(self.shape, self.dtype)

    def same_layout(self, other: LeafSpec) -> bool:
        """Same stored shape and dtype; ``key_impl`` is compared separately."""
        return self.shape == other.shape and np.dtype(self.dtype) == np.dtype(other.dtype)

    def __str__(self) -> str:
        key = f" key<{self.key_impl}>" if self.key_impl else ""
        return f"{np.dtype(self.dtype).name}{list(self.shape)}{key}"


def spec_of(x: Any) -> LeafSpec:
    """The stored-form spec of an array, ShapeDtypeStruct, scalar or Orbax metadata leaf."""
    dtype = getattr(x, "dtype", None)
    shape = tuple(getattr(x, "shape", ()))
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x) if isinstance(x, jax.Array) else _impl_of_dtype(dtype)
        trailing = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype)).shape
        return LeafSpec(shape + tuple(trailing), np.dtype(np.uint32), _impl_name(impl))
    if dtype is None:
        dtype = np.asarray(x).dtype
    return LeafSpec(shape, np.dtype(dtype))


def _impl_of_dtype(dtype: Any) -> Any:
    return dtype._impl  # the only handle on a key dtype's implementation


def _impl_name(impl: Any) -> str:
    # PRNGImpl.name is the registered name ("threefry2x32") that Orbax records as
    # random_key_impl; str() of a dtype's impl is only its short tag ("fry").
    return getattr(impl, "name", None) or str(impl)


def _is_meta_leaf(x: Any) -> bool:
    return (hasattr(x, "shape") and hasattr(x, "dtype")) or type(x).__name__.endswith("Metadata")


def read_specs(item_dir: epath.Path) -> FlatTree:
    """``{path: LeafSpec}`` of one Orbax PyTree item, from its metadata alone (no array bytes)."""
    item_dir = epath.Path(item_dir)
    if not (item_dir / "_METADATA").exists():
        raise CheckpointReadError(
            f"{item_dir}: no _METADATA; this is not a complete Orbax PyTree item "
            "(an interrupted save, or the wrong directory)."
        )
    try:
        meta = json.loads((item_dir / "_METADATA").read_text())
    except ValueError as e:
        raise CheckpointReadError(f"{item_dir}/_METADATA: invalid JSON ({e}).") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
        raise CheckpointReadError(
            f"{item_dir}/_METADATA: not an Orbax PyTree metadata file (no tree_metadata object)."
        )
    if meta.get("use_ocdbt", True) and not (item_dir / "manifest.ocdbt").exists():
        raise CheckpointReadError(
            f"{item_dir}/manifest.ocdbt: missing; the item's OCDBT database cannot be opened."
        )
    try:
        tree = ocp.PyTreeCheckpointHandler().metadata(absolute(item_dir)).tree
    except Exception as e:  # Orbax raises many types for a damaged item
        raise CheckpointReadError(f"{item_dir}: cannot read Orbax metadata: {e}") from e
    impls = key_impls(item_dir)
    out: FlatTree = {}
    for raw_path, leaf in flatten(tree, is_leaf=_is_meta_leaf).items():
        path: Path = tuple(norm_key(k) for k in raw_path)
        shape = tuple(getattr(leaf, "shape", None) or ())
        dtype = np.dtype(getattr(leaf, "dtype", None) or np.int64)
        out[path] = LeafSpec(shape, dtype, impls.get(".".join(str(k) for k in path)))
    return out
