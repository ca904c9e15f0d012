"""The one writer: executes a `Plan` into ``<step>/items`` with bounded memory, atomically.

Per op (see `moves`):

* ``copy`` from an OCDBT source in the same zarr format: the source database is
  cloned inside the new item, its data files shared with the source (a reflink,
  else a hard link, else a copy; private streaming copies with ``copy=True``; see
  `placement`), and its arrays are grafted into the new root database under their
  new names with ``experimental_copy_range_to``: only B-tree nodes are written,
  never array bytes. From a non-OCDBT source (Pathways style): stored chunks are
  copied under their new keys, in batches within ``budget``.
* every other op (and a copy into another zarr format) decodes its sources, one
  destination array at a time, and writes the result (`moves.apply_op`).

Then the Orbax JSON files are written (`orbax_files.write_metadata`) and the item
is committed (`stepdir.commit`).
"""

from __future__ import annotations

import os
import queue
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
from etils import epath

from . import orbax_files, placement, stepdir, tskv
from .errors import CheckpointReadError
from .moves import Move, Op, Plan, apply_op, merge_base, merge_layer
from .names import MAXTEXT_ITEM, TUNIX_PARAMS_ITEM
from .provenance import SCAN_LAYERS_KEY, scan_layers
from .store import store_for

DEFAULT_BUDGET = 1 << 30  # 1 GiB


class Written(NamedTuple):
    """What `write_items` wrote: new bytes on disk, and how the source data files were
    placed (`placement.Placement.to_dict`: shared by reflink or hard link, or copied, and why)."""

    bytes_written: int
    data_files: dict[str, Any]


def write_items(
    step_dir: epath.Path,
    plan: Plan,
    source_dirs: Mapping[str, epath.Path],
    *,
    provenance: dict,
    budget: int = DEFAULT_BUDGET,
    in_place: bool = False,
    use_zarr3: bool | None = None,
    copy: bool = False,
    step_meta: dict | None = None,
) -> Written:
    """Writes ``<step_dir>/items`` for ``plan`` and commits it.

    ``source_dirs`` maps item name to its directory. The destination keeps the
    source's zarr format unless ``use_zarr3`` says otherwise (then every array is
    re-encoded). The data files of cloned source databases are shared with the
    source (reflink, else hard link, else a copy of that file), or privately copied
    with ``copy``; Orbax never modifies a data file, so a shared file is a safe copy.
    A merge_lora move is computed and written one layer at a time. Nothing is
    committed unless every array was written. The provenance records ``in_place``,
    the bytes written, how the data files were placed (``data_files``) and which
    arrays this writer wrote itself (``arrays_written``: chunk copies, and arrays
    computed by their op), so that `legacy_removal.remove_legacy` knows what to verify.
    ``step_meta``: the step metadata of ``step_dir`` as the caller read it.
    """
    ctx = tskv.ts_context()
    sources = {name: tskv.SourceItem.open(d, ctx) for name, d in source_dirs.items()}
    main = next((sources[n] for n in (TUNIX_PARAMS_ITEM, MAXTEXT_ITEM) if n in sources), None)
    src_zarr3 = main.use_zarr3 if main is not None else True
    zarr3 = src_zarr3 if use_zarr3 is None else use_zarr3
    tmp = stepdir.new_tmp_dir(step_dir)
    try:
        reads = [(i, orbax_files.param_name(p), s.shape) for m in plan.moves for i, p, s in m.reads]
        tskv.check_complete([tskv.Read(*r) for r in reads], sources)
        raw = [m for m in plan.moves if m.op is Op.COPY and sources[m.item].use_zarr3 == zarr3]
        graft = {n for n, s in sources.items() if s.is_ocdbt and any(m.item == n for m in raw)}
        children = {}
        placed = placement.Placement(mode=placement.COPY_MODE if copy else placement.SHARE_MODE)
        for name in sorted(graft):
            child_dir = tmp / f"{tskv.CHILD_PREFIX}{name}"
            placed.merge(store_for(tmp).clone_tree(sources[name].dir, child_dir, share=not copy))
            children[name] = orbax_files.open_kvstore(child_dir, ctx, use_ocdbt=True)
        parent = orbax_files.open_kvstore(tmp, ctx, use_ocdbt=True, merge=bool(graft))
        tskv.graft([_rename(m) for m in raw if m.item in graft], children, parent)
        chunked = [m for m in raw if m.item not in graft]
        tskv.copy_chunks([_rename(m) for m in chunked], sources, parent, budget=budget)
        copied = {id(m) for m in raw}
        decoded = [m for m in plan.moves if id(m) not in copied]
        dst_json = parent.spec().to_json()

        sizes = {(i, p): spec.nbytes for m in plan.moves for i, p, spec in m.reads}

        def read(item: str, path):  # zstandard's faster decode where it gains and fits
            fast = tskv.fast_decode_fits(sizes.get((item, path), 0), budget)
            return tskv.read_array(sources[item], path, ctx, fast=fast)

        def read_layer(item: str, path, axis, index, fast: bool = False):
            layer = None if axis is None or index is None else (axis, index)
            return tskv.read_array(sources[item], path, ctx, layer, fast=fast)

        merges = [m for m in decoded if m.op is Op.MERGE_LORA]
        with _MergeWriter(read_layer, dst_json, zarr3=zarr3, ctx=ctx, budget=budget) as mw:
            for k, m in enumerate(merges):
                mw.add(m, merges[k + 1] if k + 1 < len(merges) else None)
        for m in decoded:  # one array at a time: memory stays near the largest one
            if m.op is Op.MERGE_LORA:
                continue
            data = apply_op(m, read)
            tskv.write_array(
                dst_json, orbax_files.param_name(m.dst), data, use_zarr3=zarr3, context=ctx
            )
            del data
        orbax_files.write_metadata(
            tmp,
            {m.dst: _leaf_files(m, sources, id(m) not in copied) for m in plan.moves},
            use_zarr3=zarr3,
            gaps=orbax_files.list_gaps(m.dst for m in plan.moves),
        )
        _check_data(tmp, sources, chunked, ctx)
        # Shared files are not written: hard links have more than one name, reflinks are
        # known by their inodes (they share the source's extents).
        written = store_for(tmp).disk_usage(tmp, new_only=True, shared=placed.reflinked)
        computed: dict[str, int] = {}
        for m in decoded:
            computed[m.op.value] = computed.get(m.op.value, 0) + 1
        record = {
            "bytes_written": written,
            "in_place": in_place,
            "data_files": placed.to_dict(),
            "arrays_written": {"chunks_copied": len(chunked), "computed": computed},
        }
        scan = scan_layers(plan)  # recorded as MaxText's own saves record it
        custom = {SCAN_LAYERS_KEY: scan} if scan is not None else {}
        stepdir.commit(step_dir, tmp, provenance | record, meta=step_meta, custom=custom)
    except BaseException:
        stepdir.discard(tmp)
        raise
    return Written(written, placed.to_dict())


def _rename(m: Move) -> tskv.Rename:
    name = orbax_files.param_name
    return tskv.Rename(m.item, name(m.src), name(m.dst), m.spec.nbytes)


def chunk_shape(m: Move) -> tuple[int, ...]:
    """The chunk shape a decoded leaf is written with: one chunk, or one per layer for a
    merge that writes a stacked weight layer by layer."""
    out = m.out_spec.shape
    if m.op is Op.MERGE_LORA and m.layer_count is not None:
        assert m.axis is not None
        return out[: m.axis] + (1,) + out[m.axis + 1 :]
    return out


# Layers merged and encoded at once: one per core (numpy's merge and tensorstore's zstd
# both run without the GIL), each costing one layer slice plus its encoded chunk.
MERGE_WORKERS = max(1, min(2, os.cpu_count() or 1))


class _MergeWriter:
    """Writes the merge_lora moves of one item: each stored chunk decoded once, on the
    caller's thread, while `MERGE_WORKERS` workers merge and encode the layers already
    decoded (one chunk per layer).

    A stacked base kernel is decoded whole when it fits in ``budget`` (Orbax stores an
    array written from one host as one chunk, so reading any layer decodes all of them:
    reading per layer would decode it once per layer for the same peak); otherwise layer by
    layer (with per-layer or smaller stored chunks, only those are decoded). A kernel is kept
    while the next moves read it (the layers of an unroll), and its LoRA factors, small,
    are decoded whole once with it. The caller's thread copies each layer's slice into a
    free worker's buffer (merged there in place), so at most `MERGE_WORKERS` slices are in
    flight, fewer where the budget leaves no room for them beside a decode. The next
    kernel is decoded on another thread while this one is merged where both fit within
    ``budget`` plus three layer slices; otherwise the layers in flight are drained to what
    fits before it is decoded.
    """

    def __init__(self, read_layer, dst_json: dict, *, zarr3: bool, ctx, budget: int):
        self.read_layer, self.dst_json, self.zarr3, self.ctx = read_layer, dst_json, zarr3, ctx
        self.budget = budget
        self.pool = ThreadPoolExecutor(MERGE_WORKERS, thread_name_prefix="merge")
        # One slot per worker, each with a layer buffer reused from layer to layer (a fresh
        # one would be a fresh mapping, its pages zeroed by the kernel on first touch).
        self.slots: queue.Queue[dict] = queue.Queue()
        for _ in range(MERGE_WORKERS):
            self.slots.put({})
        self.pending: list = []
        self.key: tuple | None = None  # the base kernel decoded whole, its factors
        self.kernel: np.ndarray | None = None
        self.factors: dict = {}
        self.decoder: ThreadPoolExecutor | None = None  # decodes the next kernel, if it fits
        self.ahead: tuple | None = None  # (its key, the decode's future)

    def __enter__(self) -> _MergeWriter:
        tskv.release_large_buffers()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                for f in self.pending:
                    f.result()  # raises a worker's error
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            if self.decoder is not None:
                self.decoder.shutdown(wait=True, cancel_futures=True)

    def add(self, m: Move, following: Move | None = None) -> None:
        """Writes ``m``; ``following`` (the next move) has its kernel decoded meanwhile on
        another thread where both kernels fit in the memory bound."""
        out = m.out_spec
        name = orbax_files.param_name(m.dst)
        store = tskv.create_array(
            self.dst_json, name, out.shape, out.dtype, chunk_shape(m), use_zarr3=self.zarr3,
            context=self.ctx,
        )  # fmt: skip
        whole = self._whole(m)
        self._prefetch(m, following)
        if m.layer_count is None:  # one layer: unscanned, or one layer of an unroll
            self._submit(store, m, 0, whole=whole, index=m.index, layer=None)
            return
        # Where the budget leaves no room for two layers in flight beside a decode, one:
        # the other slots are held here meanwhile.
        spare = self.budget + 3 * _layer_bytes(m) - _decoding(m, self.budget)
        fits = max(1, min(MERGE_WORKERS, spare // max(1, _IN_FLIGHT * _layer_bytes(m))))
        held = [self.slots.get() for _ in range(MERGE_WORKERS - fits)]
        try:
            for i in range(m.layer_count):
                self._submit(store, m, i, whole=whole, index=i, layer=(m.axis, i))
        finally:
            for slot in held:
                slot.pop("buf", None)
                self.slots.put(slot)

    def _whole(self, m: Move) -> np.ndarray | None:
        """The stacked base kernel of ``m`` decoded whole, if it fits in the budget: kept
        while the next moves read the same one (the layers of an unroll), so each stored
        chunk is decoded once. Its LoRA factors (small) are decoded whole with it."""
        key = (m.item, m.src)
        if key != self.key:
            self.key, self.kernel, self.factors = key, None, {}  # freed before the next decode
            if self.ahead is not None and self.ahead[0] == key:
                self.kernel = self.ahead[1].result()  # decoded while the last one was merged
            elif _whole_fits(m, self.budget):
                self._make_room(m)
                self.kernel = self.read_layer(m.item, m.src, None, None, fast=_fast(m, self.budget))
            self.ahead = None
        for f in m.lora:
            for p in (f.a, f.b):
                if (f.item, p) not in self.factors:
                    self.factors[(f.item, p)] = self.read_layer(f.item, p, None, None)
        return self.kernel

    def _prefetch(self, m: Move, nxt: Move | None) -> None:
        """Starts decoding ``nxt``'s kernel now if it is another one that fits beside ``m``'s
        within ``budget`` plus three layer slices: ``m``'s kernel, ``nxt``'s while decoded
        (its stored chunk and itself: about twice its size), and the layers in flight."""
        if nxt is None or (nxt.item, nxt.src) == self.key or not _whole_fits(nxt, self.budget):
            return
        layer = max(_layer_bytes(m), _layer_bytes(nxt))
        kept = self.kernel.nbytes if self.kernel is not None else 0
        # zstandard where its larger peak fits beside the kernel being merged, else tensorstore
        room = self.budget + 3 * layer - MERGE_WORKERS * _IN_FLIGHT * layer - kept
        fits = [
            fast
            for fast, factor in ((True, tskv.FAST_DECODING), (False, tskv.TS_DECODING))
            if int(factor * nxt.spec.nbytes) <= room
            and (not fast or tskv.fast_decode_fits(nxt.spec.nbytes, room))
        ]
        if not fits:
            return
        fast = fits[0]
        if self.decoder is None:
            self.decoder = ThreadPoolExecutor(1, thread_name_prefix="merge-decode")
        job = self.decoder.submit(self.read_layer, nxt.item, nxt.src, None, None, fast)
        self.ahead = ((nxt.item, nxt.src), job)

    def _make_room(self, m: Move) -> None:
        """Before ``m``'s kernel is decoded (`_decoding`): no more layers of the previous
        kernel in flight than fit beside it within ``budget`` plus three layer slices, and
        no idle layer buffers kept."""
        layer = _layer_bytes(m)
        spare = self.budget + 3 * layer - _decoding(m, self.budget)
        allowed = max(0, min(MERGE_WORKERS, spare // max(1, _IN_FLIGHT * layer)))
        while len(self.pending) > allowed:
            self.pending.pop(0).result()  # the oldest layer first; raises a worker's error
        idle = []
        while True:
            try:
                idle.append(self.slots.get_nowait())
            except queue.Empty:
                break
        for slot in idle:
            slot.pop("buf", None)
            self.slots.put(slot)

    def _reader(self, m: Move, w: np.ndarray | None):
        """What `merge_layer` reads: the base layer ``w`` taken by the caller's thread, the
        factors' layers from their decoded wholes."""
        read_layer, factors = self.read_layer, self.factors
        base = {(m.item, m.src), *((m.item, p) for p in m.layers)}

        def read(item, path, axis, index):
            if w is not None and (item, path) in base:
                return w
            whole = factors.get((item, path))
            if whole is not None:
                return whole if axis is None or index is None else np.take(whole, index, axis)
            return read_layer(item, path, axis, index)

        return read

    def _submit(self, store, m: Move, i: int, *, whole, index, layer) -> None:
        """Merges layer ``i`` of ``m`` on a worker, once one is free, and writes it to
        ``layer`` of ``store``: its base slice is copied out of ``whole`` (at ``index`` on
        the layer axis) into the free worker's buffer, or read from the source."""
        slot = self.slots.get()  # waits for a free worker
        try:
            w = None
            if whole is not None and index is not None:
                view = whole[(slice(None),) * m.axis + (index,)]
                w = slot.get("buf")
                if w is None or w.shape != view.shape or w.dtype != view.dtype:
                    w = slot["buf"] = np.empty(view.shape, view.dtype)
                w[...] = view  # the worker merges it in place
            elif m.layer_count is not None:
                w = merge_base(m, i, self.read_layer)
            read = self._reader(m, w)
        except BaseException:
            self.slots.put(slot)
            raise

        def work() -> None:
            try:
                tskv.write_part(store, merge_layer(m, i, read, inplace=True), layer)
            finally:
                self.slots.put(slot)

        for f in [f for f in self.pending if f.done()]:
            f.result()  # a worker's error stops the merge at once
        self.pending = [f for f in self.pending if not f.done()]
        self.pending.append(self.pool.submit(work))


# A layer in flight holds its slice, tensorstore's copy of it, the encoded chunk (and the
# kvstore's copy of it) and the merge's scratch: about five slices (measured).
_IN_FLIGHT = 5


def _decoding(m: Move, budget: int) -> int:
    """What decoding a merge_lora move's base kernel whole holds at its peak (`_fast`)."""
    factor = tskv.FAST_DECODING if _fast(m, budget) else tskv.TS_DECODING
    return int(factor * m.spec.nbytes)


def _fast(m: Move, budget: int) -> bool:
    """Whether the kernel is decoded by zstandard: faster, and where its larger peak
    (`tskv.FAST_DECODING`) fits within ``budget`` plus three layer slices."""
    return tskv.fast_decode_fits(m.spec.nbytes, budget + 3 * _layer_bytes(m))


def _whole_fits(m: Move, budget: int) -> bool:
    """Whether a merge_lora move's stacked base kernel is decoded whole (see `_MergeWriter`)."""
    return not m.layers and m.axis is not None and m.spec.nbytes <= budget


def _layer_bytes(m: Move) -> int:
    """The bytes of one layer of a merge_lora move's base kernel."""
    return m.spec.nbytes // max(1, m.spec.shape[m.axis] if m.axis is not None else 1)


def _check_data(tmp: epath.Path, sources: Mapping[str, tskv.SourceItem], chunked, ctx) -> None:
    """Refuses damaged source data before the commit (`CheckpointReadError`, naming it).

    Grafted values stay in the (cloned) source data files: every value the new item
    references must lie inside an existing file of the right size. Chunks copied from a
    non-OCDBT source were read whole: each copied array is decoded once. This holds at
    the commit; a hard-linked data file is the legacy file itself, so a later truncation
    of the legacy file (which Orbax never does) truncates it under both names (a reflinked
    or copied one is unaffected), and `verify` then reports the arrays it cut.
    """
    problems = []
    for rel, what in tskv.damaged_value_files(tmp).items():
        head, _, rest = rel.partition("/")
        name = head.removeprefix(tskv.CHILD_PREFIX)
        where = sources[name].dir / rest if head.startswith(tskv.CHILD_PREFIX) else tmp / rel
        problems.append(f"{where}: {what}")
    for m in chunked:  # one array at a time
        try:
            tskv.read_array(sources[m.item], m.src, ctx, fast=False)  # memory as before
        except CheckpointReadError as e:
            problems.append(str(e))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointReadError(
            f"damaged source data: {problems[0]}{more}; nothing was written. The legacy items "
            "are untouched; restore the damaged files from a copy.\n  - " + "\n  - ".join(problems)
        )


def _leaf_files(
    m: Move, sources: Mapping[str, tskv.SourceItem], decoded: bool
) -> orbax_files.LeafFiles:
    out = m.out_spec
    src = sources[m.item].files if m.sources else None
    name = orbax_files.param_name(m.sources[0]) if m.sources else None
    leaf = orbax_files.leaf_files(src, name, list(out.shape), out.key_impl)
    if decoded and src is not None:
        # Re-encoded by `tskv.write_array` (a cast, a scan change, a zarr format change):
        # one chunk of the written shape, whatever the source's chunking was.
        chunks = list(chunk_shape(m))
        am = {**leaf.array_meta, "write_shape": chunks, "chunk_shape": chunks}
        leaf = orbax_files.LeafFiles(leaf.value_meta, leaf.sharding, am)
    return leaf
