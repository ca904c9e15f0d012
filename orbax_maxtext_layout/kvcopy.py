"""Raw-chunk copy at the key-value level: the streaming half of the engine.

A layout change renames arrays; it does not change their bytes. So wherever the
source and destination codecs agree, the stored chunks (and the zarr metadata
beside them) are copied under their new keys with tensorstore KvStore reads and
writes, in batches bounded by a memory budget, and the Orbax metadata files are
written for the new tree. Only a dtype cast (``step``) is decoded and re-encoded.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts
from etils import epath

from ._tree import Path
from .errors import CheckpointReadError
from .plan import Move

ARRAY_METADATA_FILE = "array_metadatas/process_0"
# Source databases are cloned under the new item with this prefix, like Orbax's
# own per-process sub-databases (which it also grafts into the root database).
CHILD_PREFIX = "ocdbt.src_"
_SINGLE_DEVICE = json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": "cpu:0"})


def ts_context() -> ts.Context:
    """Orbax's OCDBT context (the graft needs the shared resources it names), without caches.

    Every byte is read once and written once, so a cache only costs memory: Orbax's
    100 MB OCDBT cache would sit on top of the memory budget.
    """
    from orbax.checkpoint._src.serialization import tensorstore_utils as tu

    spec = tu.get_ts_context(use_ocdbt=True).spec.to_json()
    for name in list(spec):
        if name.startswith("cache_pool"):
            spec[name] = {"total_bytes_limit": 0}
    return ts.Context(spec)


def open_ocdbt(item_dir: epath.Path, context: ts.Context, *, merge: bool = False) -> ts.KvStore:
    """Opens an item's OCDBT database with Orbax's own spec (``merge`` for a graft target)."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as tu

    opts = tu.OcdbtKvStoreWriteOptions(mode=tu.OcdbtWriteMode.MERGE) if merge else None
    spec = tu.build_kvstore_tspec(str(_abs(item_dir)), use_ocdbt=True, ocdbt_write_options=opts)
    return ts.KvStore.open(spec, context=context).result()


def _abs(p: epath.Path) -> str:
    s = str(p)
    return s if "://" in s else os.path.abspath(s)


def graft(moves: Sequence[Move], children: Mapping[str, ts.KvStore], parent: ts.KvStore) -> None:
    """Adds each moved array of a cloned child database to ``parent`` under its new name.

    One atomic transaction; only B-tree nodes are written (the values stay in the
    child's data files, which the parent references by relative path).
    """
    if not moves:
        return
    txn = ts.Transaction(atomic=True)
    target = parent.with_transaction(txn)
    futures = [
        (children[m.item] / f"{param_name(m.src)}/").experimental_copy_range_to(
            target / f"{param_name(m.dst)}/"
        )
        for m in moves
    ]
    for f in futures:
        f.result()
    txn.commit_async().result()


def param_name(path: Path) -> str:
    """Orbax's name for a leaf: keys joined by dots (also its KvStore key prefix)."""
    return ".".join(str(k) for k in path)


@dataclasses.dataclass
class SourceItem:
    """An Orbax item opened at the KvStore level, with its metadata files parsed."""

    dir: epath.Path
    meta: dict
    value_meta: dict[str, dict]  # param name -> value_metadata
    shardings: dict[str, str]  # param name -> sharding JSON
    array_meta: dict[str, dict]  # param name -> array_metadata
    kv: ts.KvStore

    @property
    def use_zarr3(self) -> bool:
        return bool(self.meta.get("use_zarr3", False))

    @classmethod
    def open(cls, item_dir: epath.Path, context: ts.Context) -> SourceItem:
        item_dir = epath.Path(item_dir)
        try:
            meta = json.loads((item_dir / "_METADATA").read_text())
            tree = meta["tree_metadata"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointReadError(f"{item_dir}/_METADATA: missing or invalid ({e}).") from e
        try:
            value_meta = {
                ".".join(str(k["key"]) for k in entry["key_metadata"]): entry["value_metadata"]
                for entry in tree.values()
            }
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointReadError(
                f"{item_dir}/_METADATA: invalid tree metadata ({e!r})."
            ) from e
        shardings = {}
        if (item_dir / "_sharding").exists():
            try:
                raw = json.loads((item_dir / "_sharding").read_text())
                shardings = {base64.urlsafe_b64decode(k).decode(): v for k, v in raw.items()}
            except (ValueError, TypeError, AttributeError) as e:
                raise CheckpointReadError(f"{item_dir}/_sharding: invalid ({e!r}).") from e
        array_meta = {}
        if (item_dir / ARRAY_METADATA_FILE).exists():
            f = item_dir / ARRAY_METADATA_FILE
            try:
                for e in json.loads(f.read_text())["array_metadatas"]:
                    array_meta[str(e["array_metadata"]["param_name"])] = dict(e["array_metadata"])
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointReadError(f"{f}: invalid array metadata ({e!r}).") from e
        if meta.get("use_ocdbt", True):
            kv = open_ocdbt(item_dir, context)
        else:  # Pathways style: one zarr directory per array
            kv = ts.KvStore.open(_url(item_dir) + "/", context=context).result()
        return cls(item_dir, meta, value_meta, shardings, array_meta, kv)

    @property
    def is_ocdbt(self) -> bool:
        return bool(self.meta.get("use_ocdbt", True))


def _url(path: epath.Path) -> str:
    s = str(path)
    return s if "://" in s else f"file://{os.path.abspath(s)}"


def _keys(kv: ts.KvStore, name: str) -> list[bytes]:
    prefix = name.encode() + b"/"
    rng = ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=prefix[:-1] + b"0")
    return list(kv.list(rng).result())


def check_complete(moves: Sequence[Move], sources: Mapping[str, SourceItem]) -> None:
    """Every moved array must have all its chunks stored; else nothing is written.

    Orbax stores every chunk (``store_array_data_equal_to_fill_value``), so a
    missing one means a truncated or damaged source. Copying it would silently
    turn the missing values into the fill value (zeros) in the converted step.
    """
    problems = []
    for m in moves:
        src = sources[m.item]
        name = param_name(m.src)
        chunk = (src.array_meta.get(name) or {}).get("chunk_shape") or list(m.spec.shape)
        want = math.prod(-(-d // max(c, 1)) for d, c in zip(m.spec.shape, chunk, strict=False))
        keys = _keys(src.kv, name)
        meta_keys = [k for k in keys if k.rsplit(b"/", 1)[-1] in (b".zarray", b"zarr.json")]
        if not meta_keys or len(keys) - len(meta_keys) < want:
            problems.append(f"{name}: {len(keys) - len(meta_keys)} of {want} chunks stored")
    if problems:
        raise CheckpointReadError(
            f"{sources[moves[0].item].dir.parent}: source arrays are incomplete (truncated or "
            "damaged files); nothing was written:\n  - " + "\n  - ".join(problems)
        )


def _release_large_buffers() -> None:
    """Make glibc return large freed buffers to the OS at once.

    glibc raises its mmap threshold after freeing a large block (up to 32 MiB), so
    later chunk-sized buffers come from the heap and stay resident: copying many
    multi-MiB chunks then grows RSS far past the budget. A fixed 1 MiB threshold
    keeps every chunk buffer in its own mapping. No-op off glibc.
    """
    import ctypes
    import ctypes.util

    global _TUNED
    if _TUNED:
        return
    _TUNED = True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except OSError:
        pass


_TUNED = False


def copy_chunks(
    moves: Sequence[Move],
    sources: Mapping[str, SourceItem],
    dst: ts.KvStore,
    *,
    budget: int,
) -> int:
    """Copies the stored keys of each moved array under its new name; returns bytes written.

    Reads are batched so that at most ``budget`` bytes of stored values are read
    ahead; an array larger than that is copied alone. While a value is in flight
    it exists as the bytes read and as tensorstore's write buffer, so the peak is
    about ``budget`` plus two to three times the largest stored array.
    """
    if not moves:
        return 0
    _release_large_buffers()
    written = 0
    batch: list[tuple[Move, list[bytes]]] = []
    held = 0
    for m in moves:
        keys = _keys(sources[m.item].kv, param_name(m.src))
        if not keys:
            raise CheckpointReadError(
                f"{sources[m.item].dir}: no stored data for {param_name(m.src)} "
                "(truncated or damaged item)."
            )
        if batch and held + m.spec.nbytes > budget:
            written += _flush(batch, sources, dst)
            batch, held = [], 0
        batch.append((m, keys))
        held += m.spec.nbytes
    if batch:
        written += _flush(batch, sources, dst)
    return written


def _flush(batch: list[tuple[Move, list[bytes]]], sources: Mapping[str, SourceItem], dst) -> int:
    # All reads are issued before any is awaited, so tensorstore overlaps the I/O;
    # writes go out as each read lands, and the batch is awaited as a whole. The
    # OCDBT driver coalesces concurrent writes into few commits.
    reads = [(m, key, sources[m.item].kv.read(key)) for m, keys in batch for key in keys]
    writes = []
    written = 0
    for m, key, fut in reads:
        r = fut.result()
        if r.state != "value":
            raise CheckpointReadError(f"{sources[m.item].dir}: key {key!r} vanished while copying.")
        new_key = param_name(m.dst).encode() + key[len(param_name(m.src)) :]
        writes.append(dst.write(new_key, r.value))
        written += len(r.value)
    for w in writes:
        w.result()
    return written


def cast_array(m: Move, src: SourceItem, dst_spec: dict, context: ts.Context) -> int:
    """Decodes one (small) array, casts it to ``m.cast`` and writes it under its new name."""
    driver = "zarr3" if src.use_zarr3 else "zarr"
    spec = {"driver": driver, "kvstore": sub_kv(src.kv.spec().to_json(), param_name(m.src))}
    # A missing chunk must fail, not read as the fill value (a `step` of 0).
    spec["fill_missing_data_reads"] = False
    try:
        source = ts.open(spec, open=True, context=context).result()
        data = np.asarray(source.read().result()).astype(m.cast)
    except ValueError as e:
        raise CheckpointReadError(f"{src.dir}: cannot read {param_name(m.src)}: {e}") from e
    spec = source.spec(minimal_spec=True).to_json()
    spec["kvstore"] = sub_kv(dst_spec, param_name(m.dst))
    spec["dtype"] = np.dtype(m.cast).name
    spec.get("metadata", {}).pop("data_type", None)
    spec.get("metadata", {}).pop("dtype", None)
    out = ts.open(spec, create=True, context=context).result()
    out.write(data).result()
    return data.nbytes


def sub_kv(spec: dict, name: str) -> dict:
    """The KvStore spec of array ``name`` inside ``spec`` (paths are prefixes: append)."""
    return {**spec, "path": spec.get("path", "") + name + "/"}


def write_metadata(
    item_dir: epath.Path,
    moves: Sequence[Move],
    sources: Mapping[str, SourceItem],
    *,
    use_zarr3: bool,
    gaps: Iterable[Path] = (),
) -> None:
    """Writes ``_METADATA``, ``_sharding`` and ``array_metadatas`` for the new tree.

    Value metadata, shardings and ext-metadata (``random_key_impl``, so keys come
    back typed) are carried over from each leaf's source entry under its new name.
    ``gaps`` are ``None`` entries of lists (EmptyState slots of a Linen chain).
    """
    tree: dict[str, Any] = {}
    shardings: dict[str, str] = {}
    arrays = []
    for m in moves:
        src = sources[m.item]
        sname, dname = param_name(m.src), param_name(m.dst)
        tree[str(tuple(str(k) for k in m.dst))] = {
            "key_metadata": _key_meta(m.dst),
            "value_metadata": dict(src.value_meta[sname]),
        }
        if sname in src.shardings:
            shardings[base64.urlsafe_b64encode(dname.encode()).decode()] = src.shardings[sname]
        am = dict(src.array_meta.get(sname) or _default_array_meta(m))
        am["param_name"] = dname
        vm = tree[str(tuple(str(k) for k in m.dst))]["value_metadata"]
        if list(m.spec.shape) != list(am.get("write_shape") or m.spec.shape):
            # Re-sliced by a scan change: one chunk of the new shape, and no sharding
            # to carry over (the source's has another rank).
            am.update(write_shape=list(m.spec.shape), chunk_shape=list(m.spec.shape))
            vm["write_shape"] = list(m.spec.shape)
            shardings[base64.urlsafe_b64encode(dname.encode()).decode()] = _SINGLE_DEVICE
        arrays.append({"array_metadata": am})
    for g in gaps:
        tree[str(tuple(str(k) for k in g))] = {
            "key_metadata": _key_meta(g),
            "value_metadata": {"value_type": "None", "skip_deserialize": True},
        }
    meta = {
        "tree_metadata": tree,
        "use_ocdbt": True,
        "use_zarr3": use_zarr3,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    (item_dir / "_METADATA").write_text(json.dumps(meta))
    (item_dir / "_sharding").write_text(json.dumps(shardings))
    (item_dir / "array_metadatas").mkdir(exist_ok=True)
    (item_dir / ARRAY_METADATA_FILE).write_text(json.dumps({"array_metadatas": arrays}))


def _key_meta(path: Path) -> list[dict]:
    # key_type 1 = sequence index, 2 = mapping key (Orbax's KeyType enum).
    return [{"key": str(k), "key_type": 1 if isinstance(k, int) else 2} for k in path]


def _default_array_meta(m: Move) -> dict:
    return {
        "write_shape": list(m.spec.shape),
        "chunk_shape": list(m.spec.shape),
        "ext_metadata": None,
    }


def list_gaps(paths: Iterable[Path]) -> list[Path]:
    """``None`` slots of the lists implied by int keys (e.g. a chain's EmptyState members)."""
    seen: dict[Path, set[int]] = {}
    for p in paths:
        for i, k in enumerate(p):
            if isinstance(k, int):
                seen.setdefault(p[:i], set()).add(k)
    return [prefix + (i,) for prefix, idx in seen.items() for i in range(max(idx)) if i not in idx]


def clone_tree(src: epath.Path, dst: epath.Path, *, link: bool) -> None:
    """Clones an item directory: hard links (``link``) or a streaming file copy.

    Hard links are safe because OCDBT never modifies a data file once written and
    the clone is only ever read; they fall back to copies across file systems.
    Object stores (``gs://``) get an object-by-object copy through epath.
    """
    if "://" in str(src):
        dst.mkdir(parents=True, exist_ok=True)
        for child in src.iterdir():
            if child.is_dir():
                clone_tree(child, dst / child.name, link=False)
            else:
                child.copy(dst / child.name)
        return
    for root, _, files in os.walk(str(src)):
        rel = os.path.relpath(root, str(src))
        os.makedirs(os.path.join(str(dst), rel), exist_ok=True)
        for f in files:
            a, b = os.path.join(root, f), os.path.join(str(dst), rel, f)
            if link:
                try:
                    os.link(a, b)
                    continue
                except OSError:
                    pass
            shutil.copyfile(a, b)


def write_array(dst_spec: dict, name: str, data: np.ndarray, *, use_zarr3: bool, context) -> None:
    """Writes one re-sliced array as a zarr array (one chunk, zstd) under ``name``."""
    shape = list(data.shape)
    if use_zarr3:
        meta = {
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shape}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}],
        }
    else:
        meta = {"chunks": shape, "compressor": {"id": "zstd", "level": 1}}
    spec = {"driver": "zarr3" if use_zarr3 else "zarr", "kvstore": sub_kv(dst_spec, name)}
    spec["metadata"] = {**meta, "shape": shape}
    store = ts.open(spec, create=True, dtype=ts.dtype(data.dtype.name), context=context).result()
    store.write(data).result()
