"""Test support: re-encode an OCDBT item's B-tree as one leaf node with a data-file table we
choose (issue 46: hostile checkpoints).

Tensorstore never writes a data-file path that leaves its database, so the tests that need one
write the node themselves. The format is tensorstore's (``tensorstore/kvstore/ocdbt/index.rst``;
the codecs ``format/btree.cc``, ``btree_codec.h``, ``data_file_id_codec.cc``,
``codec_util.cc``); /work/shared/notes/HOSTILE.md summarises it. Only what these tests need is
written here: one uncompressed leaf node (height 0) holding every entry of the item's latest
version, and a manifest whose latest version's root points at it. The manifest is encoded by
tensorstore itself (`tensorstore.ocdbt.undump_manifest` of `tensorstore.ocdbt.dump`'s JSON).

Reading goes through `tensorstore.ocdbt.dump`, whose location strings
``"<kind>:<base path>:<relative path>:<offset>:<length>"`` percent-encode both paths.

    entries = leaf_entries(item)                 # every key of the latest version
    retable(item, lambda base, rel: ("", "../../outside/" + rel))   # re-point every file

Paths are ``str``; bytes that are not UTF-8 travel as surrogate escapes (``surrogateescape``).
"""

from __future__ import annotations

import dataclasses
import os
import struct
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from urllib.parse import unquote

MANIFEST_MAGIC = 0x0CDB3A2A
BTREE_NODE_MAGIC = 0x0CDB20DE
BTREE_NODE_VERSION = 0
RAW = 0  # the compression field of an encoded manifest or node (1: zstd)
INLINE, INDIRECT = 0, 1  # a leaf entry's value kind


# -- CRC-32C (Castagnoli), as tensorstore's riegeli digester computes it -------------------
def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def varint(n: int) -> bytes:
    """Unsigned LEB128, as riegeli writes varints."""
    if n < 0:
        raise ValueError(n)
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes(path: str) -> bytes:
    return path.encode("utf-8", "surrogateescape")


# -- entries -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Entry:
    """One key of a leaf node: its value inline (``inline``), or ``length`` bytes at
    ``offset`` of the data file ``base + rel`` (relative to the item)."""

    key: bytes
    inline: bytes | None = None
    base: str = ""
    rel: str = ""
    offset: int = 0
    length: int = 0

    @property
    def file(self) -> tuple[str, str]:
        return self.base, self.rel


def parse_location(location: str) -> tuple[str, str, str, int, int]:
    """``(kind, base path, relative path, offset, length)`` of a dumped location, its paths
    percent-decoded."""
    kind, base, rel, offset, length = location.split(":")
    dec = lambda s: unquote(s, errors="surrogateescape")  # noqa: E731
    return kind, dec(base), dec(rel), int(offset), int(length)


def _base_kvstore(item: Path):
    import tensorstore as ts

    return ts.KvStore.open({"driver": "file", "path": os.fspath(item) + "/"}).result()


def dump_manifest(item: Path) -> dict:
    import tensorstore as ts

    return ts.ocdbt.dump(_base_kvstore(item)).result()


def leaf_entries(item: Path) -> list[Entry]:
    """Every entry of the item's latest version, in key order (all leaves of the tree).

    A node's dump shows its keys without the prefix its parent's entry holds for the whole
    subtree (``subtree_common_prefix``): each key is that prefix, accumulated from the root,
    then the key shown."""
    import tensorstore as ts

    base = _base_kvstore(item)
    versions = dump_manifest(item)["versions"]
    if not versions:
        return []
    out: list[Entry] = []
    todo = [(versions[-1]["root"]["location"], b"")]
    while todo:
        location, prefix = todo.pop()
        node = ts.ocdbt.dump(base, location).result()
        for e in node["entries"]:
            key = prefix + bytes(e["key"])
            if node["height"] > 0:
                todo.append((e["location"], prefix + bytes(e["subtree_common_prefix"])))
            elif "inline_value" in e:
                out.append(Entry(key, inline=bytes(e["inline_value"])))
            else:
                _, b, r, offset, length = parse_location(e["indirect_value"])
                out.append(Entry(key, base=b, rel=r, offset=offset, length=length))
    return sorted(out, key=lambda e: e.key)


def data_files(entries: Iterable[Entry]) -> list[tuple[str, str]]:
    """The distinct ``(base, rel)`` the indirect values name, in first-use order."""
    return list(dict.fromkeys(e.file for e in entries if e.inline is None))


# -- encoding ----------------------------------------------------------------------------
def encode_leaf(entries: Sequence[Entry]) -> bytes:
    """One uncompressed leaf node holding ``entries`` (sorted, distinct keys).

    Every shared-prefix length (of keys, of paths) is written as 0: the format allows it
    (a reader only checks a prefix is not longer than the previous key or path), and it
    keeps each path's bytes whole in the node.
    """
    entries = sorted(entries, key=lambda e: e.key)
    if not entries or len({e.key for e in entries}) != len(entries):
        raise ValueError("a leaf node needs at least one entry and distinct keys")
    files = data_files(entries)
    index = {f: i for i, f in enumerate(files)}
    paths = [(_bytes(b), _bytes(r)) for b, r in files]

    body = bytearray([0])  # height: a leaf
    # data-file table: count; prefix length of each path after the first; each path's
    # remaining (suffix) length; each base path's length; then the path bytes
    body += varint(len(files))
    body += b"".join(varint(0) for _ in files[1:])
    body += b"".join(varint(len(b) + len(r)) for b, r in paths)
    body += b"".join(varint(len(b)) for b, _ in paths)
    body += b"".join(b + r for b, r in paths)
    # keys: count; prefix length of each key after the first; each suffix length; the bytes
    body += varint(len(entries))
    body += b"".join(varint(0) for _ in entries[1:])
    body += b"".join(varint(len(e.key)) for e in entries)
    body += b"".join(e.key for e in entries)
    # values: each length; each kind (a byte); the file index of each indirect value, then
    # the offset of each; then the inline values' bytes
    body += b"".join(varint(len(e.inline) if e.inline is not None else e.length) for e in entries)
    body += bytes(INLINE if e.inline is not None else INDIRECT for e in entries)
    indirect = [e for e in entries if e.inline is None]
    body += b"".join(varint(index[e.file]) for e in indirect)
    body += b"".join(varint(e.offset) for e in indirect)
    body += b"".join(e.inline for e in entries if e.inline is not None)
    return frame(BTREE_NODE_MAGIC, BTREE_NODE_VERSION, bytes(body))


def frame(magic: int, version: int, body: bytes) -> bytes:
    """Magic (big-endian), total length (little-endian u64), version and compression
    (varints), the body, then the CRC-32C of all that (little-endian)."""
    head = varint(version) + varint(RAW)
    total = 4 + 8 + len(head) + len(body) + 4
    data = struct.pack(">I", magic) + struct.pack("<Q", total) + head + body
    return data + struct.pack("<I", crc32c(data))


def write_tree(item: Path, entries: Sequence[Entry]) -> str:
    """Writes ``entries`` as one leaf node into a new ``d/<32 hex>`` of ``item``, and a new
    ``manifest.ocdbt`` whose latest version's root is that node (the other versions, the
    configuration, generation numbers and commit times kept). Returns the node's path,
    relative to the item. The old nodes stay where they were, unreferenced."""
    import tensorstore as ts

    item = Path(item)
    node = encode_leaf(entries)
    rel = f"d/{uuid.uuid4().hex}"
    (item / "d").mkdir(exist_ok=True)
    (item / rel).write_bytes(node)
    manifest = dump_manifest(item)
    latest = manifest["versions"][-1]
    latest["root_height"] = 0
    latest["root"] = {
        "location": f"btreenode::{rel}:0:{len(node)}",
        "statistics": {
            "num_keys": len(entries),
            "num_tree_bytes": len(node),
            "num_indirect_value_bytes": sum(e.length for e in entries if e.inline is None),
        },
    }
    (item / "manifest.ocdbt").write_bytes(ts.ocdbt.undump_manifest(manifest))
    return rel


def remapped(entries: Iterable[Entry], remap: Callable[[str, str], tuple[str, str]]) -> list[Entry]:
    """``entries`` with the data file ``(base, rel)`` of each indirect value replaced by
    ``remap(base, rel)`` (offsets and lengths kept)."""
    out = []
    for e in entries:
        if e.inline is None:
            base, rel = remap(e.base, e.rel)
            e = dataclasses.replace(e, base=base, rel=rel)
        out.append(e)
    return out


def retable(item: Path, remap: Callable[[str, str], tuple[str, str]]) -> list[Entry]:
    """Re-points every indirect value of ``item`` (`remapped`), writes the tree
    (`write_tree`) and returns its entries. Moving the files themselves is the caller's."""
    entries = remapped(leaf_entries(item), remap)
    write_tree(item, entries)
    return entries


def externalize(item: Path, which: Callable[[Entry], bool] = lambda e: True) -> list[Entry]:
    """Moves the inline values ``which`` selects out of the node, into one new data file
    ``d/<32 hex>`` of ``item`` (their bytes one after another), as indirect values: for items
    whose values are all small enough to lie inline (a data-file table needs a file to
    name). Writes the tree and returns its entries."""
    item = Path(item)
    rel = f"d/{uuid.uuid4().hex}"
    blob = bytearray()
    entries = []
    for e in leaf_entries(item):
        if e.inline and which(e):  # an empty value stays inline
            entries.append(Entry(e.key, rel=rel, offset=len(blob), length=len(e.inline)))
            blob += e.inline
        else:
            entries.append(e)
    (item / "d").mkdir(exist_ok=True)
    (item / rel).write_bytes(bytes(blob))
    write_tree(item, entries)
    return entries
