"""Check a converted step: every leaf of ``items`` equals its op applied to the legacy items.

The plan is replayed from the provenance the conversion recorded (optimizer
mode, drops, scan change and its layer axes) against the written ``items`` as
target, so a scan change verifies exactly like a plain conversion. A step written from
other steps (a LoRA merge, a MaxText step's scan change) is compared with the sources its
provenance names.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import numpy as np
from etils import epath

from ..base.treepaths import FlatTree, keystr
from ..errors import LayoutMismatchError
from ..model.target import Target
from ..orbax_io.layout import MAXTEXT_ITEM, Layout, tunix_items
from ..orbax_io.ocdbt import keys_by_array
from ..orbax_io.orbax_files import param_name, read_context, reads_each_item_once, sub_kv
from ..orbax_io.reader import ItemReader, same_stored
from ..orbax_io.spec import read_specs
from ..orbax_io.stepmeta import read_provenance
from ..plan.moves import Move, Plan
from ..plan.ops import apply_op
from ..plan.step_plan import plan_maxtext_step, plan_step
from . import source_walk


@dataclasses.dataclass
class VerifyResult:
    step_dir: str
    ok: bool
    checked: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)


def replay_plan(
    step_dir: epath.PathLike,
    *,
    specs: FlatTree | None = None,
    source_specs: MutableMapping[str, FlatTree] | None = None,
) -> Plan:
    """The plan a converted step was written from, rebuilt from its provenance and metadata.

    The converted items are themselves the target; what was dropped on purpose is
    in the provenance record and is ignored by exact path. ``specs``: `read_specs` of
    the step's ``items``, if the caller has read them; ``source_specs``: of its legacy
    items, by name (`plan_step`'s cache).
    """
    step_dir = epath.Path(step_dir)
    prov = read_provenance(step_dir) or {}
    dropped = [d["path"].split("/", 1)[1] for d in prov.get("dropped", [])]
    if specs is None:
        target = Target.from_checkpoint(step_dir / MAXTEXT_ITEM)
    else:
        target = Target.from_specs(specs)
    scan = prov.get("scan")
    ignore = [p.removesuffix("/value") for p in dropped] + dropped
    optimizer = prov.get("optimizer", "convert")
    return plan_step(
        step_dir,
        target,
        optimizer=optimizer,
        ignore=ignore,
        scan=scan,
        specs=source_specs,
        scan_axes=dict(prov.get("scan_axes") or {}) if scan else None,
    )


RESCANNED = Layout.MAXTEXT.value  # the source layout a scan change of a MaxText step records

Replay = Callable[[epath.Path, dict], "tuple[Plan, Mapping[str, epath.Path]]"]
REPLAYS: dict[str, Replay] = {}
"""How a step written by a room above this one is replayed, by the ``source_layout`` its
provenance records: ``(step_dir, provenance) -> (plan, source dirs)``. The LoRA merge's
(`lora.merge_plan.replay_merge`) is registered when its room is imported (the package's
``__init__`` does): this floor never imports that room."""


def replay_rescan(prov: Mapping[str, Any], specs: FlatTree) -> tuple[Plan, dict[str, epath.Path]]:
    """The plan a scan change of a MaxText step was written from, and its source, from its
    provenance (`convert.rescan_provenance`): the written items (``specs``) are the
    target, in the written form, and the source step's items are planned against it
    again (`plan_maxtext_step`), with the layer axes the conversion recorded."""
    source = epath.Path(prov["source"])
    plan = plan_maxtext_step(
        source,
        Target.from_specs(specs),
        scan=prov["scan"],
        optimizer=prov.get("optimizer", "convert"),
        scan_axes=dict(prov.get("scan_axes") or {}),
        plain_scan=True,  # the written items are scanned for a stack: nothing is guessed
    )
    return plan, {MAXTEXT_ITEM: source / MAXTEXT_ITEM}


@reads_each_item_once
def verify_step(
    step_dir: epath.PathLike,
    *,
    quick: bool = False,
    source_specs: MutableMapping[str, FlatTree] | None = None,
) -> VerifyResult:
    """Compares ``items`` with the legacy items it was converted from (or, for a merged
    LoRA step, with the base and adapters it was merged from; for a MaxText step's scan
    change, with the source step's ``items``).

    ``quick`` compares metadata (tree, shapes, dtypes, key impls) and checks that
    every leaf has stored data, without reading values. Otherwise every leaf is
    compared with its op applied to its sources: stored bytes where the op copied
    them, decoded values where it changed them (a cast, a layer slice or stack,
    fresh state, a zarr format change). Never raises: a failure is a result.
    ``source_specs`` (item name -> `read_specs`) are the legacy items' specs if the
    caller read them (e.g. `convert_step` planning the conversion it verifies).
    """
    step_dir = epath.Path(step_dir)
    try:
        return _verify(step_dir, quick, source_specs)
    except LayoutMismatchError as e:
        return VerifyResult(str(step_dir), False, 0, [e.summary, *e.problems])
    except Exception as e:  # unreadable metadata or data: a failed check, not a crash
        return VerifyResult(str(step_dir), False, 0, [f"cannot read: {e}"])


def _verify(
    step_dir: epath.Path, quick: bool, source_specs: MutableMapping[str, FlatTree] | None
) -> VerifyResult:
    res = VerifyResult(str(step_dir), ok=True)
    prov = read_provenance(step_dir) or {}
    got = read_specs(step_dir / MAXTEXT_ITEM)
    replay = REPLAYS.get(prov.get("source_layout"))  # type: ignore[arg-type]
    if replay is not None:
        plan, sources = replay(step_dir, prov)
    elif prov.get("source_layout") == RESCANNED:
        plan, sources = replay_rescan(prov, got)
    else:
        plan = replay_plan(step_dir, specs=got, source_specs=source_specs)
        sources = tunix_items(step_dir)
    for m in plan.moves:
        if got.get(m.dst) != m.out_spec:
            res.problems.append(f"{keystr(m.dst)}: items has {got.get(m.dst)}, plan {m.out_spec}")
    extra = sorted(set(got) - {m.dst for m in plan.moves}, key=keystr)
    res.problems += [f"{keystr(p)}: in items, but written by no move of the plan" for p in extra]
    res.checked = len(plan.moves)
    if not res.problems:
        piece = prov.get("piece_bytes") or source_walk.PIECE
        res.problems += _compare(step_dir, plan, sources, quick, piece)
    res.ok = not res.problems
    return res


def _compare(
    step_dir: epath.Path,
    plan: Plan,
    sources: Mapping[str, epath.Path],
    quick: bool,
    piece: int = source_walk.PIECE,
) -> list[str]:
    """Each move's stored keys and values against its sources'.

    Each database is listed once (`keys_by_array`), and stored values are read in
    batches of at most `BATCH_BYTES` (every read of a batch in flight at once), through
    one bounded cache of the databases' indexes (`orbax_files.read_context`): the cost
    per leaf does not grow with the number of leaves.
    """
    ctx = read_context()
    dst = ItemReader.open(step_dir / MAXTEXT_ITEM, ctx)
    stored = keys_by_array(dst.kv)
    if quick:
        return [
            f"{keystr(m.dst)}: no stored data in items"
            for m in plan.moves
            if not stored.get(param_name(m.dst))
        ]
    srcs = {n: ItemReader.open(d, ctx) for n, d in sources.items()}
    raw = [m for m in plan.moves if m.op.renames and srcs[m.item].use_zarr3 == dst.use_zarr3]
    listed = {n: keys_by_array(srcs[n].kv) for n in sorted({m.item for m in raw})}
    problems = []
    pairs: list[tuple[Move, bytes, bytes]] = []
    unequal: set[int] = set()
    for m in raw:
        sn, dn = param_name(m.src), param_name(m.dst)
        skeys = sorted(listed[m.item].get(sn, []))
        dkeys = sorted(stored.get(dn, []))
        if not skeys or [k[len(sn) :] for k in skeys] != [k[len(dn) :] for k in dkeys]:
            unequal.add(id(m))  # compared by value below, which names the difference
            continue
        pairs += [(m, a, b) for a, b in zip(skeys, dkeys, strict=True)]
    unequal |= _unequal_values(pairs, srcs, dst)
    copied = {id(m) for m in raw} - unequal
    rest = [m for m in plan.moves if id(m) not in copied]
    walked = source_walk.routed([m for m in rest if not _fresh_layers(m)], srcs, piece)
    differ = _routed_differ(walked, srcs, dst, ctx, piece)
    problems += [f"{keystr(m.dst)}: value differs from {m.describe()}" for m in differ]
    ids = {id(m) for m in walked}
    for m in rest:
        if id(m) in ids:
            continue
        want = apply_op(m, lambda item, p: srcs[item].read_array(p))
        have = dst.read_array(m.dst)
        if want.dtype != have.dtype or want.shape != have.shape or want.tobytes() != have.tobytes():
            problems.append(f"{keystr(m.dst)}: value differs from {m.describe()}")
    return problems


def _fresh_layers(m: Move) -> bool:
    """A stack that fills layers with fresh RNG state (compared whole, by `apply_op`)."""
    return m.op.makes_parts(m)


def _routed_differ(
    moves: list[Move], srcs: Mapping[str, ItemReader], dst: ItemReader, ctx, piece: int
) -> list[Move]:
    """The moves among ``moves`` (copies, casts, slices, stacks) whose written array
    differs from their sources: each source array walked once (`source_walk.walk`), each
    piece compared with the written box it went to (the writer's chunks, when it wrote
    them: each decoded once too). A written array that cannot be read differs."""
    import tensorstore as ts

    stores: dict[int, Any] = {}
    bad: dict[int, Move] = {}
    for m in moves:
        name = param_name(m.dst)
        spec = {
            "driver": "zarr3" if dst.use_zarr3 else "zarr",
            "kvstore": sub_kv(dst.kv.spec().to_json(), name),
            "fill_missing_data_reads": False,
        }
        try:
            stores[id(m)] = ts.open(spec, open=True, context=ctx).result()
        except ValueError:
            bad[id(m)] = m
    for m in moves:  # shapes, from the written metadata
        st = stores.get(id(m))
        if st is not None and tuple(st.shape) != tuple(m.out_spec.shape):
            bad[id(m)] = m

    def visit(m: Move, start: tuple[int, ...], data: np.ndarray) -> None:
        if id(m) in bad:
            return
        try:  # the writer's own chunk, when the box is one (zstandard: each decoded once)
            have = dst.read_chunk(param_name(m.dst), start, data.shape)
            if have is None:
                box = tuple(slice(s, s + n) for s, n in zip(start, data.shape, strict=True))
                have = np.asarray(stores[id(m)][box].read().result())
        except ValueError:  # tensorstore's, and a CheckpointReadError (a ValueError)
            bad[id(m)] = m
            return
        if not _same_bits(have, data):
            bad[id(m)] = m

    source_walk.walk(source_walk.by_source(moves), srcs, visit, piece)
    return [m for m in moves if id(m) in bad]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same dtype, shape and bytes (NaNs compare by their bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    raw = np.dtype(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else None
    if raw is None:
        return a.tobytes() == np.ascontiguousarray(b).tobytes()
    return bool(np.array_equal(a.view(raw), b.view(raw)))


BATCH_BYTES = 256 << 20  # stored values held at once while comparing (both sides)


def _unequal_values(
    pairs: list[tuple[Move, bytes, bytes]],
    srcs: Mapping[str, ItemReader],
    dst: ItemReader,
) -> set[int]:
    """The moves (by ``id``) of which a stored value differs from its source's.

    Values that lie in local data files are compared there (`_unequal_in_files`). The
    others are read through the kvstores in batches: every read of a batch is issued
    before any is awaited, and a batch holds about `BATCH_BYTES` at most: a stored chunk
    is counted at its decoded size (its array's bytes over its chunk keys; compression
    only shrinks it, but for a few bytes of framing).
    """
    per_key: dict[int, int] = {}
    for m, _, _ in pairs:
        per_key[id(m)] = per_key.get(id(m), 0) + 1
    unequal, pairs = _unequal_in_files(pairs, srcs, dst)
    batch: list[tuple[Move, bytes, bytes]] = []
    held = 0

    def flush() -> None:
        reads = [(m, srcs[m.item].kv.read(a), dst.kv.read(b)) for m, a, b in batch]
        for m, ra, rb in reads:
            if ra.result().value != rb.result().value:
                unequal.add(id(m))

    for m, a, b in pairs:
        chunks = max(1, per_key[id(m)] - 1)  # one of an array's keys is its zarr metadata
        size = 2 * max(1, m.spec.nbytes // chunks)
        if batch and held + size > BATCH_BYTES:
            flush()
            batch, held = [], 0
        batch.append((m, a, b))
        held += size
    if batch:
        flush()
    return unequal


def _unequal_in_files(
    pairs: list[tuple[Move, bytes, bytes]],
    srcs: Mapping[str, ItemReader],
    dst: ItemReader,
) -> tuple[set[int], list[tuple[Move, bytes, bytes]]]:
    """The pairs whose two values lie in local data files, compared there, two at a time,
    each streamed through reused buffers (`same_stored`): the moves (by ``id``) of
    which a value differs, and the pairs left to compare through the kvstores."""

    def same(part: list[tuple[Move, bytes, bytes]]) -> list[bool | None]:
        return [same_stored(srcs[m.item], a.decode(), dst, b.decode()) for m, a, b in part]

    # Two workers, each given every other pair: one future per worker, not per pair (a
    # future per leaf is a dozen objects the collector tracks, and with thousands of leaves
    # they alone pushed it into full collections).
    halves = [pairs[0::2], pairs[1::2]]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(same, halves))
    unequal: set[int] = set()
    rest = []
    for half, answers in zip(halves, got, strict=True):
        for pair, same_value in zip(half, answers, strict=True):
            if same_value is None:
                rest.append(pair)
            elif not same_value:
                unequal.add(id(pair[0]))
    return unequal, rest
