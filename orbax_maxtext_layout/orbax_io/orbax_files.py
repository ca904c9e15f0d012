"""The one reader and writer of an Orbax PyTree item's JSON files.

An item directory holds ``_METADATA`` (the tree, value metadata, format flags),
``_sharding`` (base64url param name -> sharding JSON) and
``array_metadatas/process_<i>`` (per-array write/chunk shapes and ext-metadata such
as ``random_key_impl``, which is all that marks a stored PRNG key). Each array's own
zarr metadata (``<name>/.zarray`` or ``<name>/zarr.json``: its shape and dtype) is a
JSON value in the item's key-value store (its OCDBT database, or one directory per
array): `read_zarr_metadata` reads all of them at once, through a `read_context`.
Everything in this package that reads or writes those files goes through here.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import contextvars
import dataclasses
import functools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from ..base.treepaths import Path
from ..errors import CheckpointReadError, CheckpointRefusedError
from ..storage.store import StepStore, TooLarge, store_for
from ..storage.store import read_only as _store_read_only

METADATA_FILE = "_METADATA"
SHARDING_FILE = "_sharding"
ARRAY_METADATA_DIR = "array_metadatas"
ARRAY_METADATA_FILE = f"{ARRAY_METADATA_DIR}/process_0"
MANIFEST_FILE = "manifest.ocdbt"
SINGLE_DEVICE_SHARDING = json.dumps(
    {"sharding_type": "SingleDeviceSharding", "device_str": "cpu:0"}
)
# The OCDBT cache of a reader (`read_context`): B-tree nodes and manifests only.
READ_CACHE_BYTES = 64 << 20
# Checkpoints are untrusted input (issue 46): an item's JSON files are parsed whole, so each
# is refused past a size, checked before it is read (`read_limited`). Real files are far
# smaller: a ``_METADATA`` holds ~300 bytes per leaf (100k leaves: 30 MB), ``_sharding`` and
# each ``array_metadatas/process_*`` less. A zarr metadata value is under 1 KB.
ITEM_JSON_LIMIT = 256 << 20  # _METADATA, _sharding, array_metadatas/process_*
ZARR_METADATA_LIMIT = 1 << 20  # one array's .zarray / zarr.json


def absolute(p: epath.PathLike) -> epath.Path:
    """``p`` made absolute (Orbax's OCDBT reader refuses relative paths); URLs unchanged."""
    p = epath.Path(p)
    return p if "://" in str(p) or str(p).startswith("/") else p.resolve()


def param_name(path: Path) -> str:
    """Orbax's name for a leaf: keys joined by dots (also its KvStore key prefix)."""
    return ".".join(str(k) for k in path)


def read_limited(f: epath.Path, limit: int, what: str, *, store: StepStore) -> bytes:
    """The bytes of file ``f`` (``what``), or `CheckpointReadError` naming ``limit`` when it
    holds more: on a disk its size is checked before it is read, and the read stops one
    byte past the limit (a file that grew meanwhile); on an object store one ranged request
    reads at most one byte past it (`StepStore.read_file`). `OSError`s pass through (the
    callers name them). ``store``: the root's, as the caller decided it."""
    try:
        return store.read_file(f, limit)
    except TooLarge:
        pass
    raise CheckpointRefusedError(
        f"{f}: the {what} is larger than {limit >> 20} MiB, the most this library reads "
        "(a damaged or forged file); refused."
    )


def parse_json(data: bytes | str, where: object, what: str) -> Any:
    """``data`` parsed as JSON; `CheckpointReadError` naming ``where`` for invalid JSON, for
    JSON nested too deeply for Python's parser (`RecursionError`) or too large (`MemoryError`)."""
    try:
        return json.loads(data)
    except ValueError as e:
        raise CheckpointReadError(f"{where}: invalid {what} ({e}).") from e
    except (RecursionError, MemoryError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else "too large to parse"
        raise CheckpointRefusedError(f"{where}: invalid {what} ({why}).") from e


def read_json(f: epath.Path, what: str, limit: int = ITEM_JSON_LIMIT, *, store: StepStore) -> Any:
    try:
        data = read_limited(f, limit, what, store=store)
    except OSError as e:
        raise CheckpointReadError(f"{f}: missing or invalid {what} ({e}).") from e
    return parse_json(data, f, f"JSON in the {what}")


def prefetch_item(item_dir: epath.Path, *, store: StepStore) -> None:
    """On an object store, within a restore (`reads_only`), starts reading the item's small
    files together (its JSON files and the OCDBT manifest, whose existence is checked): each
    request waits a round trip, and asked one after another they add up (issue 58). A disk
    reads each when asked."""
    store.prefetch(
        [item_dir / n for n in (METADATA_FILE, SHARDING_FILE, ARRAY_METADATA_FILE, MANIFEST_FILE)],
        ITEM_JSON_LIMIT,
    )


def read_array_metadatas(item_dir: epath.Path, *, store: StepStore) -> dict[str, dict]:
    """``param_name -> array_metadata`` from every ``array_metadatas/process_*`` file."""
    out: dict[str, dict] = {}
    folder = epath.Path(item_dir) / ARRAY_METADATA_DIR
    names = store.list_dir(folder)  # [] where there is none
    store.prefetch([folder / n for n in names], ITEM_JSON_LIMIT)  # together, not in turn
    for f in (folder / n for n in names):
        try:
            for entry in read_json(f, "array metadata", store=store)["array_metadatas"]:
                meta = entry["array_metadata"]  # read-only: writers copy what they change
                out[str(meta["param_name"])] = meta
        except CheckpointReadError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointReadError(f"{f}: invalid array metadata ({e!r}).") from e
    return out


def key_impls(item_dir: epath.Path, *, store: StepStore) -> dict[str, str]:
    """``param_name -> random_key_impl`` of the item's stored PRNG keys (JSON only);
    ``store``: the root's, as the caller decided it."""
    out = {}
    for name, meta in read_array_metadatas(item_dir, store=store).items():
        impl = (meta.get("ext_metadata") or {}).get("random_key_impl")
        if impl:
            out[name] = str(impl)
    return out


@dataclasses.dataclass
class ItemFiles:
    """An item's JSON files, parsed: what a copied leaf carries over to its new name."""

    dir: epath.Path
    meta: dict
    value_meta: dict[str, dict]  # param name -> value_metadata
    shardings: dict[str, str]  # param name -> sharding JSON
    array_meta: dict[str, dict]  # param name -> array_metadata
    # The store of the item's root, as the operation that read the files decided it.
    store: StepStore | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def use_zarr3(self) -> bool:
        return bool(self.meta.get("use_zarr3", False))

    @property
    def use_ocdbt(self) -> bool:
        return bool(self.meta.get("use_ocdbt", True))

    @property
    def fills_missing(self) -> bool:
        """Whether a chunk that is not stored reads as the array's fill value, as stock
        Orbax reads it: unless ``_METADATA`` says ``store_array_data_equal_to_fill_value``
        (Orbax 0.12 writes it true; older Orbax wrote none, and tensorstore then leaves a
        chunk equal to the fill value, an all-zero one, unwritten), Orbax opens the array
        with ``fill_missing_data_reads`` (issue 58). With it, a missing chunk is damage."""
        return not bool(self.meta.get("store_array_data_equal_to_fill_value", False))

    @classmethod
    def read(
        cls, item_dir: epath.PathLike, meta: dict | None = None, *, store: StepStore | None = None
    ) -> ItemFiles:
        """Reads the item's JSON files (``meta``: its ``_METADATA``, if already parsed); in
        an operation that reads each item once (`reads_each_item_once`), the files it read
        before, while ``_METADATA`` is the same file. ``store``: the root's, as the caller
        decided it (else decided here); the files carry it (``store``)."""
        item_dir = epath.Path(item_dir)
        store = store or store_for(item_dir)
        key = _once_key(item_dir, store)
        known = _known(key)
        if known is not None and (meta is None or meta is known.meta):
            return known
        files = cls._read(item_dir, meta, store)
        if key is not None:
            _READ_ONCE.get()[key] = files  # type: ignore[index]
        return files

    @classmethod
    def _read(cls, item_dir: epath.Path, meta: dict | None, store: StepStore) -> ItemFiles:
        count("item files", str(item_dir))
        prefetch_item(item_dir, store=store)
        if meta is None:
            meta = read_json(item_dir / METADATA_FILE, "Orbax metadata", store=store)
        try:
            value_meta = {
                ".".join(str(k["key"]) for k in entry["key_metadata"]): entry["value_metadata"]
                for entry in meta["tree_metadata"].values()
            }
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointReadError(
                f"{item_dir}/{METADATA_FILE}: invalid tree metadata ({e!r})."
            ) from e
        shardings = {}
        if store.exists(item_dir / SHARDING_FILE):  # answered by the read, where it was made
            raw = read_json(item_dir / SHARDING_FILE, "sharding file", store=store)
            try:
                shardings = {base64.urlsafe_b64decode(k).decode(): v for k, v in raw.items()}
            except (ValueError, TypeError, AttributeError) as e:
                raise CheckpointReadError(f"{item_dir}/{SHARDING_FILE}: invalid ({e!r}).") from e
        array_meta = read_array_metadatas(item_dir, store=store)
        return cls(item_dir, meta, value_meta, shardings, array_meta, store)


# -- each item's JSON files parsed once per operation ----------------------------------------
# An operation reads an item's files in several places (its specs for the plan, then the
# reader of its arrays); parsed again each time, a ``_METADATA`` of thousands of leaves is
# tens of thousands of objects for the collector, whose full passes then cost more than the
# parse (issue 57). Within `reads_each_item_once`, `ItemFiles.read` hands out what it read
# before while ``_METADATA`` is the same file (inode, size, modification time): an item
# rewritten meanwhile is a new file and is read again. Scoped to the calling thread's
# context (a `contextvars` variable): nothing outside the call sees it, and the parses are
# dropped when it returns. On an object store the check would be a request of its own: there
# the memo holds only within a read-only operation (`reads_only`: a restore, where a step
# cannot change under its reader), keyed by the item's path.
_READ_ONCE: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "orbax_maxtext_layout_item_files", default=None
)
_REMOTE = "remote items"  # a key of the memo: present within `reads_only`
_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


def reads_each_item_once(fn: _F) -> _F:
    """``fn``, reading each item's JSON files once (the outermost such call keeps them)."""
    return _scoped(fn, read_only=False)


def reads_only(fn: _F) -> _F:
    """`reads_each_item_once` for an operation that writes nothing (a restore): also on an
    object store, where each item's files, and each existence check, listing and small
    file read (`storage.store.read_only`), are then asked of the store once. The outermost
    such call keeps them; within an operation that writes (`reads_each_item_once`), an
    object store's answers are not kept."""
    return _scoped(fn, read_only=True)


def _scoped(fn: _F, *, read_only: bool) -> _F:
    @functools.wraps(fn)
    def once(*args: Any, **kwargs: Any) -> Any:
        if _READ_ONCE.get() is not None:
            return fn(*args, **kwargs)
        token = _READ_ONCE.set({_REMOTE: True} if read_only else {})
        try:
            with _store_read_only() if read_only else contextlib.nullcontext():
                return fn(*args, **kwargs)
        finally:
            _READ_ONCE.reset(token)

    return once  # type: ignore[return-value]


def remembers(item_dir: epath.Path) -> bool:
    """Whether this operation keeps what it reads of ``item_dir`` on an object store
    (`reads_only`), so a walk of its B-tree once serves every reader (`remembered`)."""
    memo = _READ_ONCE.get()
    return memo is not None and _REMOTE in memo and not store_for(item_dir).reads_files


def remembered(kind: str, item_dir: epath.Path, compute: Callable[[], _T]) -> _T:
    """``compute()`` (what ``kind`` reads of ``item_dir``), done once per operation where it
    `remembers` the item; else each time. Callers must not modify what it returns."""
    memo = _READ_ONCE.get()
    if not remembers(item_dir):
        return compute()
    key = (kind, str(item_dir).rstrip("/"))
    if key not in memo:  # type: ignore[operator]
        memo[key] = compute()  # type: ignore[index]
    return memo[key]  # type: ignore[index]


def known_metadata(item_dir: epath.Path, *, store: StepStore) -> dict | None:
    """The item's parsed ``_METADATA`` if this operation read its files already."""
    known = _known(_once_key(item_dir, store))
    return known.meta if known is not None else None


def _known(key: tuple | None) -> ItemFiles | None:
    """What this operation read under ``key`` (`_once_key`), if anything."""
    return _READ_ONCE.get().get(key) if key is not None else None  # type: ignore[union-attr]


def _once_key(item_dir: epath.Path, store: StepStore) -> tuple | None:
    memo = _READ_ONCE.get()
    if memo is None:
        return None
    if not store.reads_files:  # an object store: within `reads_only` alone
        return ("remote", str(item_dir).rstrip("/")) if _REMOTE in memo else None
    try:
        st = os.stat(os.path.join(str(item_dir), METADATA_FILE))
    except OSError:
        return None
    return (os.path.abspath(str(item_dir)), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_context(cache_bytes: int = READ_CACHE_BYTES) -> ts.Context:
    """A tensorstore context for reading items: Orbax's, its OCDBT cache bounded.

    The OCDBT driver keeps the database's manifest and B-tree nodes in that cache;
    without one, every listing and every read decodes the index again, so the cost
    of each grows with the database's size. Make one per operation (the cache lives
    as long as the context); the writer runs without caches (`item_writer.ts_context`).
    """
    spec = json.loads(_orbax_context_spec())  # a fresh copy to edit
    for name in list(spec):
        if name.startswith("cache_pool"):
            spec[name] = {"total_bytes_limit": cache_bytes}
    return ts.Context(spec)


@functools.cache
def _orbax_context_spec() -> str:
    """Orbax's tensorstore context spec for OCDBT, as JSON text (built once per process:
    every operation makes several contexts from it)."""
    return json.dumps(ocp.serialization.ts_utils.get_ts_context(use_ocdbt=True).spec.to_json())


def open_kvstore(
    item_dir: epath.Path, context: ts.Context, *, use_ocdbt: bool, merge: bool = False
) -> ts.KvStore:
    """An item's key-value store: its OCDBT database (with Orbax's own spec; ``merge`` for
    the root database of a new item that grafts others), or the directory holding one zarr
    directory per array (Pathways style).

    Private Orbax API (no public equivalent in 0.12.8): the MERGE write mode is what lets a
    root database reference grafted sub-databases, exactly as Orbax merges per-process
    databases. Pinned by tests/test_structure.py.
    """
    if use_ocdbt:
        from orbax.checkpoint._src.serialization import tensorstore_utils as tu

        opts = tu.OcdbtKvStoreWriteOptions(mode=tu.OcdbtWriteMode.MERGE) if merge else None
        where = str(absolute(item_dir))
        spec = tu.build_kvstore_tspec(where, use_ocdbt=True, ocdbt_write_options=opts)
        return ts.KvStore.open(spec, context=context).result()
    s = str(item_dir)
    url = s if "://" in s else f"file://{absolute(item_dir)}"
    return ts.KvStore.open(url + "/", context=context).result()


# -- counting reads: a seam for tests and benchmarks -------------------------------------
_COUNTERS: list[collections.Counter] = []


@contextlib.contextmanager
def io_counts() -> Iterator[collections.Counter]:
    """Counts, while active (in any thread), the reads that cost a pass over an item's
    index: ``("listing", database)`` for each key listing (`ocdbt.keys`,
    `ocdbt.keys_by_array`) and ``("zarr metadata", database)`` for each batch of
    `read_zarr_metadata`, ``("step metadata", step)`` for each read of a step's
    metadata file (`stepmeta.read`) and ``("item files", item)`` for each parse of an
    item's JSON files (`ItemFiles.read`). An operation should make each once per database, not once per
    array. Decodes are counted too: ``("chunk decoded", "<item>/<array>/<chunk>")`` for each
    stored chunk the chunk-aware reader decodes (`chunks.pieces`), ``("array decoded", ...)``
    for each whole array and ``("layer decoded", ...)`` for each layer tensorstore reads on
    its own (`ItemReader.read_array`). Nothing is counted (or computed for it) while no counter is
    active."""
    counter: collections.Counter = collections.Counter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def count_io(kind: str, kv: ts.KvStore) -> None:
    """Records one ``kind`` pass over ``kv`` in every active `io_counts`."""
    if _COUNTERS:
        count(kind, kv_location(kv))


def count(kind: str, where: str) -> None:
    """Records one ``kind`` read of ``where`` in every active `io_counts`."""
    for counter in list(_COUNTERS):
        counter[(kind, where)] += 1


def kv_location(kv: ts.KvStore) -> str:
    """Where a key-value store lives, as a path or URL (an OCDBT database: its base)."""
    spec = kv.spec().to_json()
    base = spec.get("base", spec)
    if isinstance(base, str):
        return base + spec.get("path", "")
    where = base.get("path", "")
    if base.get("bucket"):
        where = f"gs://{base['bucket']}/{where}"
    return where + (spec.get("path", "") if "base" in spec else "")


def zarr_metadata_key(name: str, *, use_zarr3: bool) -> str:
    """The key of array ``name``'s zarr metadata in its item's key-value store."""
    return f"{name}/{'zarr.json' if use_zarr3 else '.zarray'}"


def read_zarr_metadata(
    kv: ts.KvStore, names: Iterable[str], *, use_zarr3: bool
) -> dict[str, dict | None]:
    """``name -> parsed zarr metadata`` (None where the array has none) of each array.

    Every read is issued before any is awaited: one batch, whatever the number of
    arrays. Arrays with identical metadata share one parsed dict (do not modify it).
    Raises ``ValueError`` (tensorstore's, or the JSON parser's) on a read or parse
    failure.
    """
    count_io("zarr metadata", kv)
    futures = [(n, kv.read(zarr_metadata_key(n, use_zarr3=use_zarr3))) for n in names]
    out: dict[str, dict | None] = {}
    parsed: dict[bytes, dict] = {}  # arrays of one shape and dtype store the same bytes
    base = kv_location(kv)  # for the errors
    for name, fut in futures:
        r = fut.result()
        if r.state != "value":
            out[name] = None
        elif (meta := parsed.get(r.value)) is None:
            key = zarr_metadata_key(name, use_zarr3=use_zarr3)
            out[name] = parsed[r.value] = parse_zarr_metadata(r.value, f"{base}{key}")
        else:
            out[name] = meta
    return out


def parse_zarr_metadata(value: bytes, where: str) -> dict:
    """A stored zarr metadata value parsed: a JSON object of at most `ZARR_METADATA_LIMIT`
    bytes, else `CheckpointReadError` naming ``where`` (its key). Its contents are checked
    by `chunks.check_zarr_metadata`."""
    if len(value) > ZARR_METADATA_LIMIT:
        raise CheckpointRefusedError(
            f"{where}: zarr metadata of {len(value)} bytes, more than the "
            f"{ZARR_METADATA_LIMIT >> 20} MiB this library reads (damaged or forged); refused."
        )
    meta = parse_json(bytes(value), where, "zarr metadata")
    if not isinstance(meta, dict):
        raise CheckpointReadError(f"{where}: invalid zarr metadata (not a JSON object).")
    return meta


@dataclasses.dataclass(frozen=True)
class LeafFiles:
    """What the JSON files say of one written leaf."""

    value_meta: dict
    sharding: str | None
    array_meta: dict


def leaf_files(
    src: ItemFiles | None, src_name: str | None, shape: list[int], key_impl: str | None
) -> LeafFiles:
    """A written leaf's entries: its source's, or fresh ones for a leaf with no source.

    A leaf whose shape changed (a layer slice or stack) is one chunk of its new
    shape, with no sharding to carry over (the source's has another rank).
    """
    vm: dict = {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": shape}
    am: dict = {"write_shape": shape, "chunk_shape": shape, "ext_metadata": None}
    sharding: str | None = SINGLE_DEVICE_SHARDING
    if src is not None and src_name is not None:
        vm = dict(src.value_meta.get(src_name) or vm)
        am = dict(src.array_meta.get(src_name) or am)
        sharding = src.shardings.get(src_name)
    # A recorded [] is a scalar's write shape, not "none": a stack of scalars (an RNG count
    # of shape [L]) gets its own, of its rank.
    recorded = am.get("write_shape")
    if list(shape if recorded is None else recorded) != shape:
        am.update(write_shape=shape, chunk_shape=shape)
        vm["write_shape"] = shape
        sharding = SINGLE_DEVICE_SHARDING
    if key_impl:
        am["ext_metadata"] = {**(am.get("ext_metadata") or {}), "random_key_impl": key_impl}
    return LeafFiles(vm, sharding, am)


def _key_meta(path: Path) -> list[dict]:
    # key_type 1 = sequence index, 2 = mapping key (Orbax's KeyType enum).
    return [{"key": str(k), "key_type": 1 if isinstance(k, int) else 2} for k in path]


def write_metadata(
    item_dir: epath.Path,
    leaves: Mapping[Path, LeafFiles],
    *,
    use_zarr3: bool,
    gaps: Iterable[Path] = (),
    others: Mapping[Path, dict] | None = None,
) -> None:
    """Writes ``array_metadatas``, ``_sharding`` and, last, ``_METADATA`` for a new item.

    ``_METADATA`` goes last: stock Orbax trusts it, so an item must not have it
    before the files it relies on (keys would restore as raw uint32). ``gaps`` are
    ``None`` entries of lists (EmptyState slots of a Linen chain); ``others`` the value
    metadata of leaves that are not arrays (a ``scalar`` step, an empty ``Dict``).
    """
    tree: dict[str, Any] = {}
    shardings: dict[str, str] = {}
    arrays = []
    for path, leaf in leaves.items():
        name = param_name(path)
        tree[str(tuple(str(k) for k in path))] = {
            "key_metadata": _key_meta(path),
            "value_metadata": leaf.value_meta,
        }
        if leaf.sharding is not None:
            shardings[base64.urlsafe_b64encode(name.encode()).decode()] = leaf.sharding
        arrays.append({"array_metadata": {**leaf.array_meta, "param_name": name}})
    for g in gaps:
        tree[str(tuple(str(k) for k in g))] = {
            "key_metadata": _key_meta(g),
            "value_metadata": {"value_type": "None", "skip_deserialize": True},
        }
    for path, value_meta in (others or {}).items():
        tree[str(tuple(str(k) for k in path))] = {
            "key_metadata": _key_meta(path),
            "value_metadata": value_meta,
        }
    meta = {
        "tree_metadata": tree,
        "use_ocdbt": True,
        "use_zarr3": use_zarr3,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    (item_dir / ARRAY_METADATA_DIR).mkdir(exist_ok=True)
    (item_dir / ARRAY_METADATA_FILE).write_text(json.dumps({"array_metadatas": arrays}))
    (item_dir / SHARDING_FILE).write_text(json.dumps(shardings))
    (item_dir / METADATA_FILE).write_text(json.dumps(meta))


def list_gaps(paths: Iterable[Path]) -> list[Path]:
    """``None`` slots of the lists implied by int keys (e.g. a chain's EmptyState members)."""
    seen: dict[Path, set[int]] = {}
    for p in paths:
        for i, k in enumerate(p):
            if isinstance(k, int):
                seen.setdefault(p[:i], set()).add(k)
    return [prefix + (i,) for prefix, idx in seen.items() for i in range(max(idx)) if i not in idx]


def sub_kv(spec: dict, name: str) -> dict:
    """The KvStore spec of array ``name`` inside ``spec`` (paths are prefixes: append)."""
    return {**spec, "path": spec.get("path", "") + name + "/"}
