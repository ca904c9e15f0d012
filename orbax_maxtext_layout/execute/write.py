"""The one writer: executes a `Plan` into ``<step>/items`` with bounded memory, atomically.

Per op (see `plan.ops`; each op says which way it is written):

* ``copy`` from an OCDBT source in the same zarr format: the source database is
  cloned inside the new item, its data files shared with the source (a reflink,
  else a hard link, else a copy; private streaming copies with ``copy=True``; see
  `placement`), and its arrays are grafted into the new root database under their
  new names with ``experimental_copy_range_to``: only B-tree nodes are written,
  never array bytes. From a non-OCDBT source (Pathways style): stored chunks are
  copied under their new keys, in batches within ``budget``.
* every other op (and a copy into another zarr format) decodes its sources, one
  destination array at a time, and writes the result (`ops.apply_op`).

Then the Orbax JSON files are written (`orbax_files.write_metadata`) and the item
is committed (`stepdir.commit`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from etils import epath

from ..base.step_entries import MAXTEXT_ITEM, TUNIX_PARAMS_ITEM
from ..errors import CheckpointReadError
from ..orbax_io import item_writer, orbax_files, stepdir
from ..orbax_io.ocdbt import damaged_value_files
from ..orbax_io.reader import ItemReader
from ..orbax_io.stored_values import PIECE
from ..plan.moves import Move, Op, Plan
from ..plan.ops import apply_op
from ..plan.provenance import SCAN_LAYERS_KEY, scan_layers
from ..storage import placement
from ..storage.memory import DEFAULT_BUDGET
from ..storage.store import StepStore
from . import source_walk


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
    store: StepStore,
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
    ``step_meta``: the step metadata of ``step_dir`` as the caller read it. ``store``: the
    destination's, as the caller decided it.
    """
    ctx = item_writer.ts_context()
    sources = {name: ItemReader.open(d, ctx) for name, d in source_dirs.items()}
    main = next((sources[n] for n in (TUNIX_PARAMS_ITEM, MAXTEXT_ITEM) if n in sources), None)
    src_zarr3 = main.use_zarr3 if main is not None else True
    zarr3 = src_zarr3 if use_zarr3 is None else use_zarr3
    tmp = stepdir.new_tmp_dir(step_dir, store=store)
    try:
        reads = [(i, orbax_files.param_name(p), s.shape) for m in plan.moves for i, p, s in m.reads]
        filled = item_writer.check_complete([item_writer.Read(*r) for r in reads], sources)
        raw = [m for m in plan.moves if _raw_copy(m, sources, zarr3=zarr3, filled=filled)]
        parent, chunked, placed = _stored_copies(raw, sources, tmp, store, copy=copy, budget=budget)
        copied = {id(m) for m in raw}
        decoded = [m for m in plan.moves if id(m) not in copied]
        dst_json = parent.spec().to_json()

        # each source array decoded once, its pieces routed to every move reading it; the
        # new data files leave the page cache once written (nothing here reads them back)
        piece = source_walk.piece_for(budget)
        with store.drop_written(tmp / item_writer.DATA_DIR):
            walked = source_walk.routed(decoded, sources, piece)
            shapes = source_walk.write_routed(
                walked, sources, dst_json, zarr3=zarr3, ctx=ctx, piece=piece
            )
            # the rest each op writes its own way (a LoRA merge, layer by layer)
            rest = [m for m in decoded if not m.op.made and id(m) not in shapes]
            for op, moves in _by_op(rest).items():
                op.write_rest(moves, sources, dst_json, zarr3=zarr3, ctx=ctx, budget=budget)
            _write_made(decoded, dst_json, zarr3=zarr3, ctx=ctx)
        orbax_files.write_metadata(
            tmp,
            {
                m.dst: _leaf_files(m, sources, id(m) not in copied, shapes.get(id(m)))
                for m in plan.moves
            },
            use_zarr3=zarr3,
            gaps=orbax_files.list_gaps(m.dst for m in plan.moves),
        )
        _check_data(tmp, sources, chunked, ctx)
        # Shared files are not written: hard links have more than one name, reflinks are
        # known by their inodes (they share the source's extents).
        written = store.disk_usage(tmp, new_only=True, shared=placed.reflinked)
        record = {
            "bytes_written": written,
            "in_place": in_place,
            "data_files": placed.to_dict(),
            "arrays_written": {"chunks_copied": len(chunked), "computed": _computed(decoded)},
            "piece_bytes": piece,  # what `verify` walks, to meet the chunks written
        }
        scan = scan_layers(plan)  # recorded as MaxText's own saves record it
        custom = {SCAN_LAYERS_KEY: scan} if scan is not None else {}
        stepdir.commit(
            step_dir, tmp, provenance | record, store=store, meta=step_meta, custom=custom
        )
    except BaseException:
        stepdir.discard(tmp, store=store)
        raise
    return Written(written, placed.to_dict())


def _stored_copies(
    raw: list[Move],
    sources: Mapping[str, ItemReader],
    tmp: epath.Path,
    store: StepStore,
    *,
    copy: bool,
    budget: int,
) -> tuple[Any, list[Move], placement.Placement]:
    """The moves that only rename (``raw``) written without decoding: each OCDBT source
    database cloned under ``tmp`` (its data files shared, or copied with ``copy``) and its
    arrays grafted under their new names; the others' stored chunks copied. Returns the new
    item's kvstore, the moves copied chunk by chunk, and how the data files were placed."""
    ctx = item_writer.ts_context()
    graft = {n for n, s in sources.items() if s.is_ocdbt and any(m.item == n for m in raw)}
    children = {}
    placed = placement.Placement(mode=placement.COPY_MODE if copy else placement.SHARE_MODE)
    for name in sorted(graft):
        child_dir = tmp / f"{item_writer.CHILD_PREFIX}{name}"
        placed.merge(store.clone_tree(sources[name].dir, child_dir, share=not copy))
        children[name] = orbax_files.open_kvstore(child_dir, ctx, use_ocdbt=True)
    parent = orbax_files.open_kvstore(tmp, ctx, use_ocdbt=True, merge=bool(graft))
    item_writer.graft([_rename(m) for m in raw if m.item in graft], children, parent)
    chunked = [m for m in raw if m.item not in graft]
    item_writer.copy_chunks([_rename(m) for m in chunked], sources, parent, budget=budget)
    return parent, chunked, placed


def _raw_copy(m: Move, sources: Mapping[str, ItemReader], *, zarr3: bool, filled: set) -> bool:
    """Whether ``m`` is written from its stored chunks, without decoding: a rename in the
    same zarr format whose source stores every chunk (one that lacks chunks older Orbax
    left as the fill value is decoded, filled as stock reads it)."""
    if not m.op.renames or sources[m.item].use_zarr3 != zarr3:
        return False
    return (m.item, orbax_files.param_name(m.src)) not in filled


def _by_op(moves: list[Move]) -> dict[Op, list[Move]]:
    out: dict[Op, list[Move]] = {}
    for m in moves:
        out.setdefault(m.op, []).append(m)
    return out


def _computed(decoded: list[Move]) -> dict[str, int]:
    """How many arrays of each op the writer computed itself."""
    computed: dict[str, int] = {}
    for m in decoded:
        computed[m.op.value] = computed.get(m.op.value, 0) + 1
    return computed


def _write_made(decoded: list[Move], dst_json: dict, *, zarr3: bool, ctx) -> None:
    """What is made, not read: fresh RNG state, constants."""
    for m in decoded:
        if m.op.made:
            data = apply_op(m, None)
            name = orbax_files.param_name(m.dst)
            item_writer.write_array(dst_json, name, data, use_zarr3=zarr3, context=ctx)


def _rename(m: Move) -> item_writer.Rename:
    name = orbax_files.param_name
    return item_writer.Rename(m.item, name(m.src), name(m.dst), m.spec.nbytes)


def _check_data(tmp: epath.Path, sources: Mapping[str, ItemReader], chunked, ctx) -> None:
    """Refuses damaged source data before the commit (`CheckpointReadError`, naming it).

    Grafted values stay in the (cloned) source data files: every value the new item
    references must lie inside an existing file of the right size. Chunks copied from a
    non-OCDBT source were read whole: each copied array is decoded once. This holds at
    the commit; a hard-linked data file is the legacy file itself, so a later truncation
    of the legacy file (which Orbax never does) truncates it under both names (a reflinked
    or copied one is unaffected), and `verify` then reports the arrays it cut.
    """
    problems = []
    for rel, what in damaged_value_files(tmp).items():
        head, _, rest = rel.partition("/")
        name = head.removeprefix(item_writer.CHILD_PREFIX)
        where = sources[name].dir / rest if head.startswith(item_writer.CHILD_PREFIX) else tmp / rel
        problems.append(f"{where}: {what}")
    for m in chunked:  # one array at a time, piece by piece into this thread's buffer
        try:
            for _ in sources[m.item].pieces(
                orbax_files.param_name(m.src), max_bytes=PIECE, reuse=True
            ):
                pass
        except CheckpointReadError as e:
            problems.append(str(e))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointReadError(
            f"damaged source data: {problems[0]}{more}; nothing was written. The legacy items "
            "are untouched; restore the damaged files from a copy.\n  - " + "\n  - ".join(problems)
        )


def _leaf_files(
    m: Move, sources: Mapping[str, ItemReader], decoded: bool, chunks: tuple | None
) -> orbax_files.LeafFiles:
    out = m.out_spec
    src = sources[m.item].files if m.sources else None
    name = orbax_files.param_name(m.sources[0]) if m.sources else None
    leaf = orbax_files.leaf_files(src, name, list(out.shape), out.key_impl)
    if decoded and src is not None:
        # Re-encoded (a cast, a scan change, a zarr format change): in the chunks of the
        # pieces it was written in (`source_walk.dest_chunk`), or of its op's `chunk_shape`.
        shape = list(m.op.chunk_shape(m) if chunks is None else chunks)
        am = {**leaf.array_meta, "write_shape": shape, "chunk_shape": shape}
        leaf = orbax_files.LeafFiles(leaf.value_meta, leaf.sharding, am)
    return leaf
