"""An OCDBT database read at the level of its B-tree: which data file holds each stored value
(nodes only, no value read), every path checked to stay inside the item (`containment`),
the keys of each array, and data files that cannot hold the values they are said to.
"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import unquote

import tensorstore as ts
from etils import epath

from ..errors import CheckpointReadError
from ..storage.containment import check_inside, escape
from .orbax_files import count_io, open_kvstore, remembered


def check_contained(item_dir: epath.PathLike) -> None:
    """Refuses an OCDBT item whose B-tree names a data file outside it (`containment`):
    a `CheckpointReadError` naming the item, the key and the path. Reads B-tree nodes only;
    plans call it before anything is moved or written (`reader.ItemReader.open` checks the same)."""
    value_locations(epath.Path(item_dir))


def value_locations(item_dir: epath.Path) -> dict[bytes, tuple[str, int, int] | bytes]:
    """``key -> (data file relative to the item, offset, length)`` of every indirect value
    of the item's latest version, each path checked to stay inside the item (raises
    `CheckpointReadError` naming the key and the path), and ``key -> bytes`` of every value
    stored inline in the B-tree (a small one: the walk has read it already); ``{}`` for a
    B-tree that cannot be read (the kvstore's reads report it, as stock does). Walked once
    per restore on an object store (`orbax_files.remembered`: each node read waits a round
    trip there)."""
    return remembered("btree", epath.Path(item_dir), lambda: _walk(epath.Path(item_dir)))


def _walk(item_dir: epath.Path) -> dict[bytes, tuple[str, int, int] | bytes]:
    found: dict[bytes, tuple[str, int, int] | bytes] = {}
    try:
        for entry, _ in _btree_entries(item_dir):
            ref = entry.get("indirect_value")
            if ref:
                found[bytes(entry["key"])] = _value_ref(ref, item_dir, _key_text(entry))
            elif "inline_value" in entry:
                found[bytes(entry["key"])] = bytes(entry["inline_value"])
    except ValueError as e:
        if isinstance(e, CheckpointReadError):
            raise
        return {}
    return found


def _key_text(entry: dict) -> str:
    return bytes(entry.get("key", b"")).decode("utf-8", "backslashreplace")


def keys(kv: ts.KvStore, name: str) -> list[bytes]:
    """The stored keys of array ``name`` (its zarr metadata and chunks)."""
    prefix = name.encode() + b"/"
    rng = ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=prefix[:-1] + b"0")
    count_io("listing", kv)
    return list(kv.list(rng).result())


def keys_by_array(kv: ts.KvStore) -> dict[str, list[bytes]]:
    """Every stored key of a database, grouped by array name (one listing: on an object
    store each listing reads B-tree nodes through the client)."""
    out: dict[str, list[bytes]] = {}
    count_io("listing", kv)
    for key in kv.list().result():
        name, sep, _ = key.partition(b"/")
        if sep:
            out.setdefault(name.decode(), []).append(key)
    return out


def damaged_value_files(item_dir: epath.Path) -> dict[str, str]:
    """Data files an item's OCDBT database references that cannot hold those values.

    Walks the B-tree of the latest version (`_btree_entries`: nodes only, no value is
    read) and checks that every indirect value lies inside an existing regular file
    (``offset + length <= size``). Returns ``{file relative to item_dir: what is wrong}``;
    a B-tree node that cannot be read is reported too. Damage inside a value (a flipped
    bit) is not visible here: `verify` decodes.
    """
    item_dir = epath.Path(item_dir)
    bad: dict[str, str] = {}
    sizes: dict[str, int | None] = {}

    def size(rel: str) -> int | None:
        if rel not in sizes:
            f = item_dir / rel
            sizes[rel] = f.stat().length if f.exists() and not f.is_dir() else None
        return sizes[rel]

    def unreadable(location: str, e: ValueError) -> None:
        rel = _split_ref(location)[0]
        why = "leaves the checkpoint" if escape(rel) else f"B-tree node unreadable ({e})"
        bad.setdefault(rel, why)

    try:
        for entry, _ in _btree_entries(item_dir, unreadable):
            ref = entry.get("indirect_value")
            if ref:
                rel, offset, length = _split_ref(ref)
                if escape(rel):
                    bad.setdefault(rel, "leaves the checkpoint")
                    continue
                have = size(rel)
                if have is None:
                    bad.setdefault(rel, "missing, or not a file")
                elif offset + length > have:
                    bad.setdefault(rel, f"{have} bytes, a value ends at {offset + length}")
    except ValueError as e:
        return {"manifest.ocdbt": f"cannot be read ({e})"}
    return bad


def _btree_entries(item_dir: epath.Path, unreadable=None) -> Iterator[tuple[dict, str]]:
    """Every entry of the B-tree of an OCDBT item's latest version, with its node's location
    (`tensorstore.ocdbt.dump`: nodes only), each leaf entry's ``key`` whole. A node that
    cannot be read goes to ``unreadable(location, error)``, or raises; so does an unreadable
    manifest.

    A child node, dumped alone, gives its keys without the ``subtree_common_prefix`` its
    parent's entry records for it: that prefix is put back (a tree of height 0, what Orbax
    writes, has none)."""
    base = open_kvstore(epath.Path(item_dir), ts.Context(), use_ocdbt=False)  # the directory
    manifest = ts.ocdbt.dump(base).result()
    versions = manifest.get("versions") or []
    todo = [(versions[-1]["root"]["location"], b"")] if versions else []
    while todo:
        location, prefix = todo.pop()
        try:  # a node outside the item is never read, not even by tensorstore
            _value_ref(location, item_dir, "a B-tree node")
            node = ts.ocdbt.dump(base, location).result()
        except ValueError as e:
            if unreadable is None:
                raise
            unreadable(location, e)
            continue
        for entry in node.get("entries", []):
            entry = {**entry, "key": prefix + bytes(entry.get("key", b""))}
            yield entry, location
            child = entry.get("location")
            if isinstance(child, str) and child.startswith("btreenode:"):
                common = prefix + bytes(entry.get("subtree_common_prefix", b""))
                todo.append((child, common))


def _split_ref(location: str) -> tuple[str, int, int]:
    """``(file relative to the item, offset, length)`` of a B-tree location,
    ``"<kind>:<base path>:<relative path>:<offset>:<length>"``: the two paths are
    percent-encoded (`tensorstore.ocdbt.dump`), so no ``:`` is left in them. Unchecked:
    see `_value_ref`."""
    _, prefix, rel, offset, length = location.split(":")
    path = unquote(prefix, errors="surrogateescape") + unquote(rel, errors="surrogateescape")
    return path, int(offset), int(length)


def _value_ref(location: str, item_dir: epath.Path, key: str) -> tuple[str, int, int]:
    """`_split_ref`, the path checked to stay inside the item (`containment`)."""
    rel, offset, length = _split_ref(location)
    check_inside(item_dir, key, rel)
    return rel, offset, length
