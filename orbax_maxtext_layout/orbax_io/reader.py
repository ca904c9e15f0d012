"""The item reader: the one object every operation reads an Orbax item through.

`ItemReader.open` is called once per item an operation reads. It parses the item's JSON
files, opens its key-value store, and, for an OCDBT item, walks the latest version's B-tree
(nodes only) so that a data file named outside the item is refused before anything is read
(`containment`). The store the item lives on (`storage.store`) is handed in by the caller,
which decided it once for its root, or decided here once. After that, the reader gives:

- metadata: ``files`` (`orbax_files.ItemFiles`), each array's stored `zarr.ChunkLayout`
  (`layout`, read once per array);
- each stored chunk's pieces (`pieces`, `read_chunk`: the decoder in `chunks`);
- whole values (`read_whole`, decoded by `chunks`; `read_array`, through tensorstore,
  for what the decoder does not stream: PRNG keys' raw data, a layer of a small array);
- stored bytes (`stored_value`, `same_stored`: a chunk read or compared without decoding).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from collections.abc import Iterable, Iterator

import numpy as np
import tensorstore as ts
from etils import epath

from ..base.treepaths import Path
from ..errors import CheckpointReadError
from ..storage.store import StepStore
from . import chunks
from .ocdbt import damaged_value_files, value_locations
from .orbax_files import ItemFiles, count, open_kvstore, param_name, read_context, sub_kv
from .stored_values import FileValue, InlineValue, KvValue, same_pieces
from .zarr import ChunkLayout, read_layout

# What decoding a whole array holds at its peak, in times the array's bytes: tensorstore
# holds the stored chunk (at most the array's size) and the array; `read_whole` holds the
# array and one piece. Both with a margin.
TS_DECODING = 2.2
FAST_DECODING = 1.2
# On an object store (`ItemReader.fetch`), values that lie next to each other in one data
# file are read with one ranged request: fewer requests, each waiting its round trip, while
# a batch still goes out as at least `FETCH_STREAMS` requests side by side (one connection
# streams at a bounded rate) and a joined read stays between these sizes. Measured against
# the GCS emulator (bench/gcs_restore.py, 8 chunks per array): reads joined up to 16 MiB
# whatever the batch made the restore of a 115 MiB step 1.2-1.8x stock's (too few streams),
# none joined 0.8x but twice stock's requests.
FETCH_STREAMS = 32
COALESCE_MIN = 2 << 20
COALESCE_MAX = 64 << 20
COALESCE_GAP = 4 << 10  # bytes between two values read (and dropped) to join their reads


@dataclasses.dataclass
class ItemReader:
    """An Orbax item opened at the KvStore level, with its JSON files parsed."""

    files: ItemFiles
    kv: ts.KvStore
    store: StepStore
    context: ts.Context
    # key -> (data file, offset, length) of its stored value (`value_file`), once read
    _value_files: dict | None = dataclasses.field(default=None, repr=False, compare=False)
    # array name -> its stored layout (`layout`), once read
    _layouts: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # array name -> its fill value (`fill_value`), once read
    _fills: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # key -> [read of the bytes it lies in, data file, start, end, readers left] (`fetch`)
    _fetched: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    _fetch_lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, repr=False, compare=False
    )
    _files_kv: ts.KvStore | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def open(
        cls,
        item_dir: epath.PathLike,
        context: ts.Context | None = None,
        *,
        store: StepStore | None = None,
    ) -> ItemReader:
        """The item at ``item_dir``, read with tensorstore ``context`` (None: Orbax's, its
        caches off: every byte is read once) on ``store`` (None: the one its path names).
        An OCDBT item's B-tree (nodes only) is walked here, before any data file is opened:
        a data file named outside the item is refused (`containment`) whatever reads it
        later, this package's decoder or tensorstore."""
        files = ItemFiles.read(item_dir, store=store)
        context = read_context(0) if context is None else context
        kv = open_kvstore(files.dir, context, use_ocdbt=files.use_ocdbt)
        item = cls(files, kv, files.store, context)
        if item.is_ocdbt:
            item._value_files = value_locations(files.dir)
        return item

    @property
    def dir(self) -> epath.Path:
        return self.files.dir

    @property
    def use_zarr3(self) -> bool:
        return self.files.use_zarr3

    @property
    def is_ocdbt(self) -> bool:
        return self.files.use_ocdbt

    def read_error(self, what: str, e: Exception) -> CheckpointReadError:
        """A tensorstore error reading ``what`` as a `CheckpointReadError` that names the
        item's data files now missing or shorter than its B-tree says, where there are any.

        A step cut or deleted while it is read (another job's ``max_to_keep``, a copy still
        landing) fails inside tensorstore with a message that may name only the key, or say
        "Invalid JSON"; the user needs the file. Read on the error path only: the B-tree's
        nodes and the files' sizes (`ocdbt.damaged_value_files`), never a value."""
        msg = f"{self.dir}: cannot read {what}: {e}"
        damaged: dict[str, str] = {}
        if self.is_ocdbt:
            try:
                damaged = damaged_value_files(self.dir)
            except Exception:  # the diagnosis must not hide the error it explains
                damaged = {}
        if damaged:
            named = "; ".join(f"{self.dir / rel}: {why}" for rel, why in sorted(damaged.items()))
            msg += f" -- damaged data files: {named} (a step cut or deleted while it was read?)"
        err = CheckpointReadError(msg)
        err.__cause__ = e
        return err

    # -- metadata --------------------------------------------------------------------

    def layout(self, name: str) -> ChunkLayout | None:
        """The stored layout of array ``name`` from its zarr metadata (None: none is
        stored), read once: a writer, its routing and its walk all ask for it."""
        if name not in self._layouts:
            self._layouts[name] = read_layout(self, name)
        return self._layouts[name]

    def fill_value(self, name: str) -> np.ndarray:
        """What a chunk of array ``name`` that is not stored holds (`ItemFiles.fills_missing`),
        a 0-d array of its stored dtype: tensorstore's own reading of the zarr metadata's
        ``fill_value`` (zarr2's null: zeros; zarr3's "NaN", hex and the like), read once,
        only when a chunk is missing."""
        if name not in self._fills:
            spec = {"driver": "zarr3" if self.use_zarr3 else "zarr"}
            spec["kvstore"] = sub_kv(self.kv.spec().to_json(), name)
            try:
                store = ts.open(spec, open=True, context=self.context).result()
            except ValueError as e:
                raise self.read_error(name, e) from e
            fill = store.fill_value
            self._fills[name] = (
                np.zeros((), store.dtype.numpy_dtype) if fill is None else np.asarray(fill)
            )
        return self._fills[name]

    # -- arrays ------------------------------------------------------------------------

    def pieces(self, name: str, *, max_bytes: int, reuse: bool = False) -> Iterator[chunks.Piece]:
        """Every stored chunk of array ``name`` decoded once, as pieces (`chunks.pieces`)."""
        return chunks.pieces(self, name, self.context, max_bytes=max_bytes, reuse=reuse)

    def read_chunk(
        self, name: str, start: tuple[int, ...], shape: tuple[int, ...]
    ) -> np.ndarray | None:
        """The box at ``start`` when it is exactly one stored chunk (`chunks.read_chunk`)."""
        return chunks.read_chunk(self, name, start, shape)

    def read_whole(self, name: str) -> np.ndarray:
        """Array ``name`` decoded whole, each chunk once (`chunks.read_whole`)."""
        return chunks.read_whole(self, name, self.context)

    def read_array(self, path: Path, layer: tuple[int, int] | None = None) -> np.ndarray:
        """Decodes one stored array through tensorstore (stored form: PRNG keys as their raw
        data); the streaming operations read through `pieces` instead.

        ``layer=(axis, i)`` reads only index ``i`` on ``axis`` (tensorstore decodes the
        stored chunks that hold it, one at a time).
        """
        name = param_name(path)
        count("array decoded" if layer is None else "layer decoded", f"{self.dir}/{name}")
        driver = "zarr3" if self.use_zarr3 else "zarr"
        spec = {"driver": driver, "kvstore": sub_kv(self.kv.spec().to_json(), name)}
        # A missing chunk fails (a `step` of 0 is not made up), unless the step says it
        # reads as the fill value, as stock Orbax reads it (`ItemFiles.fills_missing`).
        spec["fill_missing_data_reads"] = self.files.fills_missing
        try:
            array = ts.open(spec, open=True, context=self.context).result()
            if layer is not None:
                array = array[ts.d[layer[0]][layer[1]]]
            return np.asarray(array.read().result())
        except ValueError as e:
            raise self.read_error(name, e) from e

    # -- stored bytes -------------------------------------------------------------------

    def value_file(self, key: str) -> tuple[str, int, int] | None:
        """Where the stored value ``key`` lies, as ``(data file, offset, length)``, where it
        can be read from that file directly (an OCDBT item on a local disk, the value not
        inline); else None (then it is read through the kvstore).

        The B-tree of the item's latest version is read once (nodes only, no value), when
        the item is opened. Orbax never rewrites a data file, so a location stays valid.
        """
        where = self._entry(key) if self.store.reads_files else None
        if where is None or isinstance(where, bytes):
            return None
        rel, offset, length = where
        return os.fspath(self.dir / rel), offset, length

    def _entry(self, key: str) -> tuple[str, int, int] | bytes | None:
        """``key``'s entry in the B-tree of an OCDBT item (`ocdbt.value_locations`: where
        the value lies, or its bytes where it is stored inline), walked once."""
        if not self.is_ocdbt:
            return None
        if self._value_files is None:
            self._value_files = value_locations(self.dir)
        return self._value_files.get(key.encode())

    def _inline(self, key: str) -> bytes | None:
        """The bytes of ``key`` where OCDBT stored the value inline in its B-tree."""
        where = self._entry(key)
        return where if isinstance(where, bytes) else None

    def small_value(self, key: str) -> bytes | None:
        """The whole stored value ``key`` (metadata: small), None if it is not stored: from
        the B-tree where it is stored inline there, else with one kvstore read (a data file
        it cannot read, e.g. one cut short meanwhile: `CheckpointReadError`, which names it)."""
        inline = self._inline(key)
        if inline is not None:
            return inline
        try:
            got = self.kv.read(key).result()
        except ValueError as e:  # tensorstore's I/O errors
            raise self.read_error(key, e) from e
        return bytes(got.value) if got.state == "value" else None

    def stored_length(self, key: str) -> int:
        """The bytes of stored value ``key`` as its B-tree entry says (0: inline or unknown)."""
        where = self._entry(key)
        return where[2] if isinstance(where, tuple) else 0

    def fetch(self, keys: Iterable[str]) -> None:
        """Starts reading the stored values ``keys`` (one entry for each `stored_value` that
        will take it: a shard's inner chunks each take it once) straight from their data files,
        where the item lies on an object store and its B-tree places them: ranged requests,
        all in flight at once, neighbours in one data file joined (`FETCH_STREAMS`). On an
        object store each read waits a round trip before its first byte; issued one after
        another as the decoders ask, those waits add up (issue 58: 7-8 requests a chunk
        through the OCDBT kvstore, each waited for). Keys on a local disk, stored inline or
        unknown to the B-tree are left to `stored_value`'s own reads."""
        if self.store.reads_files or not self.is_ocdbt:
            return
        wanted = collections.Counter(keys)
        with self._fetch_lock:  # a shard fetched already for others of its chunks
            for key in [k for k in wanted if k in self._fetched]:
                self._fetched[key][4] += wanted.pop(key)
        by_file: dict[str, list[tuple[int, int, str]]] = {}
        for key in wanted:
            where = self._entry(key)
            if isinstance(where, tuple):
                rel, offset, length = where
                by_file.setdefault(rel, []).append((offset, offset + length, key))
        if not by_file:
            return
        if self._files_kv is None:  # the item's directory: its data files as plain objects
            self._files_kv = open_kvstore(self.dir, self.context, use_ocdbt=False)
        total = sum(b - a for spans in by_file.values() for a, b, _ in spans)
        join = min(COALESCE_MAX, max(COALESCE_MIN, total // FETCH_STREAMS))
        fetched = {}
        for rel, spans in by_file.items():
            spans.sort()
            group: list[tuple[int, int, str]] = []
            for span in [*spans, None]:
                if group and (
                    span is None
                    or span[0] - group[-1][1] > COALESCE_GAP
                    or span[1] - group[0][0] > join
                ):
                    start, end = group[0][0], max(e for _, e, _ in group)
                    read = self._files_kv.read(rel, byte_range=slice(start, end))
                    for a, b, key in group:
                        fetched[key] = [read, rel, a - start, b - start, wanted[key], end - start]
                    group = []
                if span is not None:
                    group.append(span)
        with self._fetch_lock:
            self._fetched.update(fetched)

    def fetched_ready(self, key: str) -> bool:
        """Whether `stored_value` of ``key`` would not wait for a read `fetch` started."""
        with self._fetch_lock:
            got = self._fetched.get(key)
        return got is None or got[0].done()

    def _take_fetched(self, key: str) -> InlineValue | None:
        """The fetched bytes of ``key`` (`fetch`), waited for; None if it was not fetched."""
        with self._fetch_lock:
            got = self._fetched.get(key)
            if got is None:
                return None
            got[4] -= 1
            if got[4] <= 0:
                del self._fetched[key]
        read, rel, start, end, _, size = got
        try:
            data = read.result().value
        except ValueError as e:
            raise CheckpointReadError(
                f"{self.dir / rel}: cannot read {key} ({e}); the data file is missing or "
                "shorter than the item's B-tree says (a damaged or incomplete checkpoint)."
            ) from e
        if len(data) != size:
            raise CheckpointReadError(
                f"{self.dir / rel}: {len(data)} bytes where {key} needs {size}; the data file is "
                "shorter than the item's B-tree says (a damaged or incomplete checkpoint)."
            )
        return InlineValue(data, start, end)

    def stored_value(
        self, key: str, scratch: str | None = None
    ) -> FileValue | KvValue | InlineValue | None:
        """The stored value ``key`` to read piece by piece: from its data file where it lies
        in one on a local disk (`value_file`; tensorstore's kvstore reads cost as much as
        the decode), read into this thread's buffer ``scratch`` (None: one of its own; never
        mapped: `stored_values.FileValue`); on an object store, what `fetch` read; else through the
        kvstore; None if it is not stored."""
        fetched = self._take_fetched(key) if self._fetched else None
        if fetched is not None:
            return fetched
        inline = self._inline(key)
        if inline is not None:  # read with the B-tree already: no kvstore read
            return InlineValue(inline)
        where = self.value_file(key)
        if where is not None:
            path, offset, length = where
            try:
                return FileValue(path, offset, offset + length, scratch=scratch)
            except OSError:  # gone or unreadable: the kvstore's read reports it
                pass
        value = KvValue(self.kv, key)
        try:
            return value if value.exists() else None
        except ValueError as e:  # e.g. a data file the kvstore cannot open (a name too long)
            raise self.read_error(key, e) from e


def same_stored(a: ItemReader, a_key: str, b: ItemReader, b_key: str) -> bool | None:
    """Whether stored values ``a_key`` of ``a`` and ``b_key`` of ``b`` hold the same bytes,
    read from their data files piece by piece into this thread's two buffers (or, both
    stored inline in their B-trees, as the walk read them); None where either does not
    lie whole in a local data file (`ItemReader.value_file`; a file cut
    short, even both names of one file: compare through the kvstore, which reports it). A
    kvstore read makes a fresh buffer of each whole value, whose pages the kernel zeroes
    first: most of the time of ``verify``'s copied arrays at 8B."""
    ia, ib = a._inline(a_key), b._inline(b_key)
    if ia is not None and ib is not None:  # both small, read with the B-trees already
        return ia == ib
    wa, wb = a.value_file(a_key), b.value_file(b_key)
    if wa is None or wb is None:
        return None
    if wa[2] != wb[2]:
        return False
    try:  # gone or unreadable: the kvstore's read reports it
        va = FileValue(wa[0], wa[1], wa[1] + wa[2], scratch="same-a")
    except OSError:
        return None
    with va:
        try:
            vb = FileValue(wb[0], wb[1], wb[1] + wb[2], scratch="same-b")
        except OSError:
            return None
        with vb:
            return same_pieces(va, vb, wa[2])
