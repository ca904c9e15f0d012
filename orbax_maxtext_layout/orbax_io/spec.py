"""Leaf specs: what a leaf looks like on disk, read from Orbax metadata only."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from ..base.treepaths import FlatTree, Path, flatten, norm_key
from ..errors import CheckpointReadError
from ..storage.store import StepStore, store_for
from .ocdbt import value_locations
from .orbax_files import (
    ITEM_JSON_LIMIT,
    SHARDING_FILE,
    CheckpointRefusedError,
    ItemFiles,
    absolute,
    key_impls,
    known_metadata,
    open_kvstore,
    parse_json,
    parse_zarr_metadata,
    prefetch_item,
    read_context,
    read_limited,
    read_zarr_metadata,
    remembers,
    zarr_metadata_key,
)
from .zarr import check_zarr_metadata


@dataclasses.dataclass(frozen=True, slots=True)
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
            return jax.ShapeDtypeStruct(self.shape[:-1], _key_dtype(self.key_impl))
        return jax.ShapeDtypeStruct(self.shape, self.dtype)

    def same_layout(self, other: LeafSpec) -> bool:
        """Same stored shape and dtype; ``key_impl`` is compared separately."""
        return self.shape == other.shape and np.dtype(self.dtype) == np.dtype(other.dtype)

    def __str__(self) -> str:
        key = f" key<{self.key_impl}>" if self.key_impl else ""
        return f"{np.dtype(self.dtype).name}{list(self.shape)}{key}"


@functools.cache
def _key_dtype(impl: str) -> Any:
    """The dtype of typed keys of ``impl`` (traced, not computed: making a key would run a
    computation on a device)."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


def spec_of(x: Any) -> LeafSpec:
    """The stored-form spec of an array, ShapeDtypeStruct, scalar or Orbax metadata leaf."""
    dtype = getattr(x, "dtype", None)
    shape = tuple(getattr(x, "shape", ()))
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x) if isinstance(x, jax.Array) else _impl_of_dtype(dtype)
        return LeafSpec(shape + _key_data_shape(dtype), np.dtype(np.uint32), _impl_name(impl))
    if dtype is None:
        dtype = np.asarray(x).dtype
    return LeafSpec(shape, np.dtype(dtype))


@functools.cache
def _key_data_shape(dtype: Any) -> tuple[int, ...]:
    """The trailing shape of one key's data (``(2,)`` for threefry), traced once per dtype."""
    return tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype)).shape)


def _impl_of_dtype(dtype: Any) -> Any:
    return dtype._impl  # the only handle on a key dtype's implementation


def _impl_name(impl: Any) -> str:
    # PRNGImpl.name is the registered name ("threefry2x32") that Orbax records as
    # random_key_impl; str() of a dtype's impl is only its short tag ("fry").
    return getattr(impl, "name", None) or str(impl)


def _is_meta_leaf(x: Any) -> bool:
    return (hasattr(x, "shape") and hasattr(x, "dtype")) or type(x).__name__.endswith("Metadata")


def read_specs(item_dir: epath.Path) -> FlatTree:
    """``{path: LeafSpec}`` of one Orbax PyTree item, from its metadata alone (no array bytes).

    Reads the item's JSON files and every array's zarr metadata, in one batch of reads
    through a bounded OCDBT cache (`orbax_files.read_zarr_metadata`): the cost per leaf
    stays flat however many leaves the item holds. The result (leaves, order, shapes,
    dtypes, key impls) is `orbax_specs`'s. An item this reader does not know (a custom
    value type) or cannot read (damage) goes through `orbax_specs`, so errors are
    Orbax's own, wrapped as before.
    """
    item_dir = epath.Path(item_dir)
    store = store_for(item_dir)  # decided once for every file of the item, handed down
    meta = _item_metadata(item_dir, store)
    try:
        specs = _specs_from_files(item_dir, meta, store)
    except CheckpointRefusedError:  # damaged or forged past a limit: no other reader is given it
        raise
    except Exception:  # damaged or unusual: Orbax's reader names the problem, as always
        specs = None
    return specs if specs is not None else orbax_specs(item_dir, store=store)


def orbax_specs(item_dir: epath.Path, *, store: StepStore) -> FlatTree:
    """`read_specs` through Orbax's own ``PyTreeCheckpointHandler.metadata`` (which opens
    every array with tensorstore, one by one, and reads ``_sharding`` for each). ``store``:
    the root's, as `read_specs` decided it."""
    item_dir = epath.Path(item_dir)
    _item_metadata(item_dir, store)
    try:
        tree = ocp.PyTreeCheckpointHandler().metadata(absolute(item_dir)).tree
    except Exception as e:  # Orbax raises many types for a damaged item
        raise CheckpointReadError(f"{item_dir}: cannot read Orbax metadata: {e}") from e
    impls = key_impls(item_dir, store=store)
    out: FlatTree = {}
    for raw_path, leaf in flatten(tree, is_leaf=_is_meta_leaf).items():
        path: Path = tuple(norm_key(k) for k in raw_path)
        shape = tuple(getattr(leaf, "shape", None) or ())
        dtype = np.dtype(getattr(leaf, "dtype", None) or np.int64)
        out[path] = LeafSpec(shape, dtype, impls.get(".".join(str(k) for k in path)))
    return out


def _item_metadata(item_dir: epath.Path, store: StepStore) -> dict:
    """The item's parsed ``_METADATA``, after the checks every reader makes first."""
    prefetch_item(item_dir, store=store)  # on an object store: the files below read together
    if not store.exists(item_dir / "_METADATA"):
        raise CheckpointReadError(
            f"{item_dir}: no _METADATA; this is not a complete Orbax PyTree item "
            "(an interrupted save, or the wrong directory)."
        )
    f = item_dir / "_METADATA"
    meta = known_metadata(item_dir, store=store)  # this operation read it already
    if meta is None:
        try:  # bounded (`ITEM_JSON_LIMIT`): checkpoints are untrusted input
            raw = read_limited(f, ITEM_JSON_LIMIT, "Orbax metadata", store=store)
        except OSError as e:  # gone since the check: e.g. moved by another converter meanwhile
            raise CheckpointReadError(f"{item_dir}/_METADATA: cannot be read ({e}).") from e
        meta = parse_json(raw, f, "JSON")  # also JSON nested too deeply for Python's parser
    if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
        raise CheckpointReadError(
            f"{item_dir}/_METADATA: not an Orbax PyTree metadata file (no tree_metadata object)."
        )
    if meta.get("use_ocdbt", True) and not store.exists(item_dir / "manifest.ocdbt"):
        raise CheckpointReadError(
            f"{item_dir}/manifest.ocdbt: missing; the item's OCDBT database cannot be opened."
        )
    return meta


# Orbax's value types: those stored as a zarr array, and the empty ones (None, {}, [], ...),
# which hold no leaf.
_ZARR_VALUE_TYPES = frozenset({"jax.Array", "np.ndarray", "scalar"})
_EMPTY_VALUE_TYPES = frozenset({"None", "Dict", "List", "Tuple", "NamedTuple"})
_UNREAD = LeafSpec((), np.dtype(np.int64))  # a leaf Orbax's metadata gives no shape or dtype


def _specs_from_files(item_dir: epath.Path, meta: dict, store: StepStore) -> FlatTree | None:
    """What `orbax_specs` returns, read as Orbax's metadata reader does but in one batch
    (its JSON files, then every array's zarr metadata at once); None for an item holding
    a value type it does not know. Raises on anything unreadable."""
    files = ItemFiles.read(item_dir, meta, store=store)
    entries: list[tuple[Path, dict]] = []
    for entry in meta["tree_metadata"].values():
        path: list[str | int] = []
        for k in entry["key_metadata"]:
            if k["key_type"] not in (1, 2):  # 1: a sequence index, 2: a mapping key
                return None
            path.append(int(k["key"]) if k["key_type"] == 1 else str(k["key"]))
        entries.append((tuple(path), entry["value_metadata"]))
    # As Orbax builds its tree: an entry that is a prefix of another holds no leaf.
    inner = {p[:i] for p, _ in entries for i in range(1, len(p))}
    out: FlatTree = {}
    arrays: dict[Path, tuple[str, dict]] = {}
    for path, vm in entries:
        vtype, skip = vm["value_type"], bool(vm.get("skip_deserialize", False))
        if path in inner or (skip and vtype in _EMPTY_VALUE_TYPES):
            continue
        if skip or vtype == "string":
            out[path] = _UNREAD
        elif vtype in _ZARR_VALUE_TYPES:
            arrays[path] = (".".join(str(k) for k in path), vm)
        else:
            return None
    _check_shardings(files, [n for n, vm in arrays.values() if vm["value_type"] == "jax.Array"])
    use_ocdbt = meta["use_ocdbt"] if "use_ocdbt" in meta else (item_dir / "manifest.ocdbt").exists()
    names = [n for n, _ in arrays.values()]
    zarr = _walked_zarr_metadata(item_dir, names, files.use_zarr3) if use_ocdbt else None
    if zarr is None:
        kv = open_kvstore(item_dir, read_context(), use_ocdbt=bool(use_ocdbt))
        zarr = read_zarr_metadata(kv, names, use_zarr3=files.use_zarr3)
    impls = {
        n: am["ext_metadata"]["random_key_impl"]
        for n, am in files.array_meta.items()
        if (am.get("ext_metadata") or {}).get("random_key_impl")
    }
    for path, (name, vm) in arrays.items():
        z = zarr[name]
        if z is None:
            raise CheckpointReadError(f"{item_dir}: no zarr metadata for {name}")
        key = zarr_metadata_key(name, use_zarr3=files.use_zarr3)
        check_zarr_metadata(  # what every reader will allocate from: refused if forged
            z,
            f"{item_dir}/{key}",
            use_zarr3=files.use_zarr3,
            value_meta=vm,
            array_meta=files.array_meta.get(name),
        )
        dtype = _zarr_dtype(z["data_type"] if files.use_zarr3 else z["dtype"])
        shape = () if vm["value_type"] == "scalar" else tuple(int(d) for d in z["shape"])
        out[path] = LeafSpec(shape, dtype, str(impls[name]) if name in impls else None)
    return {p: out[p] for p in _tree_order(out)}


def _walked_zarr_metadata(
    item_dir: epath.Path, names: list[str], use_zarr3: bool
) -> dict[str, dict | None] | None:
    """What `read_zarr_metadata` returns, from the values OCDBT stored inline in the item's
    B-tree, where this restore walks it once on an object store anyway (`ocdbt.value_locations`,
    `orbax_files.remembers`): no database opened a second time (its manifest and root node
    read again, each a round trip). None elsewhere, or where a value is not inline."""
    if not remembers(item_dir):
        return None
    walked = value_locations(item_dir)
    if not walked:
        return None  # unreadable: the kvstore's reads report it
    out: dict[str, dict | None] = {}
    for name in names:
        key = zarr_metadata_key(name, use_zarr3=use_zarr3)
        value = walked.get(key.encode())
        if value is None:
            out[name] = None
        elif isinstance(value, bytes):
            out[name] = parse_zarr_metadata(value, f"{item_dir}/{key}")
        else:
            return None  # stored in a data file: read through the kvstore
    return out


def _tree_order(paths: Iterable[Path]) -> list[Path]:
    """``paths`` in the order of Orbax's tree, a jax pytree: mapping keys sorted, sequences
    in order. Paths of string keys alone (most items) sort as they are; only where an
    index appears is each key tagged with its kind (a key per path of several tuples is
    that many more objects for the collector)."""
    paths = list(paths)
    if all(isinstance(k, str) for p in paths for k in p):
        return sorted(paths)
    return sorted(paths, key=lambda p: tuple((isinstance(k, str), k) for k in p))


def _check_shardings(files: ItemFiles, names: list[str]) -> None:
    """Parses the sharding of each ``jax.Array`` leaf as Orbax's metadata reader does (it
    fails on a missing or unreadable one, so this does too)."""
    if not names or not files.store.exists(files.dir / SHARDING_FILE):
        return
    from orbax.checkpoint._src.metadata import sharding  # Orbax's parser (private; pinned)

    for text in {files.shardings[name] for name in names}:  # each distinct one once
        if text:
            sharding.from_serialized_string(text)


def _zarr_dtype(name: Any) -> np.dtype:
    """The dtype tensorstore opens a zarr array with (zarr2's ``<f4``, zarr3's ``float32``)."""
    if not isinstance(name, str):  # e.g. a zarr2 structured dtype (a list)
        raise ValueError(f"unsupported zarr dtype {name!r}")
    return _named_dtype(name)


@functools.cache  # one per dtype name: an item has few, its leaves many
def _named_dtype(name: str) -> np.dtype:
    if name[:1] in "<>|=":
        return np.dtype(jax.numpy.dtype(np.dtype(name).newbyteorder("=").name))
    return np.dtype(jax.numpy.dtype(name))
