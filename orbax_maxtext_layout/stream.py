"""The streaming executor: writes a plan's ``items`` with bounded memory.

Weights are never decoded: stored chunks are copied under their new keys
(`kvcopy.copy_chunks`), or, in place, renamed inside a hard-linked clone of
the ``model_params`` OCDBT database, so no weight byte is rewritten.
"""

from __future__ import annotations

import json
import os

import numpy as np
import tensorstore as ts
from etils import epath

from . import kvcopy
from .engine import commit, new_tmp_dir
from .layout import TUNIX_PARAMS_ITEM
from .plan import Move, Plan

DEFAULT_BUDGET = 1 << 30  # 1 GiB


def _context() -> ts.Context:
    # No chunk cache: every byte read is written once and then dropped.
    return ts.Context({"cache_pool": {"total_bytes_limit": 0}})


def stream_items(
    step_dir: epath.Path,
    plan: Plan,
    sources_dirs: dict[str, epath.Path],
    *,
    provenance: dict,
    budget: int = DEFAULT_BUDGET,
    in_place: bool = False,
) -> int:
    """Writes ``<step_dir>/items`` for ``plan`` and commits it; returns bytes written.

    The destination keeps the source's zarr format (the caller falls back to the
    decoding writer when a format change is asked for).
    """
    ctx = _context()
    sources = {name: kvcopy.SourceItem.open(d, ctx) for name, d in sources_dirs.items()}
    use_zarr3 = sources[TUNIX_PARAMS_ITEM].use_zarr3
    tmp = new_tmp_dir(step_dir)
    try:
        raw = [m for m in plan.moves if m.cast is None]
        casts = [m for m in plan.moves if m.cast is not None]
        params_src = sources[TUNIX_PARAMS_ITEM]
        if in_place and params_src.meta.get("use_ocdbt", True) and _no_collisions(plan):
            kvcopy.hardlink_tree(params_src.dir, tmp)
            dst = ts.KvStore.open(kvcopy.kv_spec(tmp, ocdbt=True), context=ctx).result()
            renamed = [m for m in raw if m.item == TUNIX_PARAMS_ITEM]
            _rename_in_place(dst, renamed, plan)
            raw = [m for m in raw if m.item != TUNIX_PARAMS_ITEM]
            _drop_legacy_metadata(tmp)
        else:
            dst = ts.KvStore.open(kvcopy.kv_spec(tmp, ocdbt=True), context=ctx).result()
        kvcopy.copy_chunks(raw, sources, dst, budget=budget)
        dst_json = dst.spec().to_json()
        for m in casts:
            kvcopy.cast_array(m, sources[m.item], dst_json, ctx)
        moves = list(plan.moves)
        if plan.step_source == "directory name":
            moves.append(_write_dir_step(plan.step, dst_json, ctx, sources, use_zarr3))
            sources["_synthesized"] = _synth_source(use_zarr3)
        kvcopy.write_metadata(
            tmp, moves, sources, use_zarr3=use_zarr3, gaps=kvcopy.list_gaps(m.dst for m in moves)
        )
        written = _new_bytes(tmp)
        commit(step_dir, tmp, provenance | {"bytes_written": written, "in_place": in_place})
    except BaseException:
        tmp.rmtree(missing_ok=True)
        raise
    return written


def _no_collisions(plan: Plan) -> bool:
    src = {kvcopy.param_name(m.src) for m in plan.moves if m.item == TUNIX_PARAMS_ITEM}
    return not src & {kvcopy.param_name(m.dst) for m in plan.moves}


def _rename_in_place(kv: ts.KvStore, moves: list[Move], plan: Plan) -> None:
    """Renames keys inside the cloned OCDBT database: B-tree edits only, no data rewritten."""
    txn = ts.Transaction(atomic=True)
    t = kv.with_transaction(txn)
    for m in moves:
        (kv / f"{kvcopy.param_name(m.src)}/").experimental_copy_range_to(
            t / f"{kvcopy.param_name(m.dst)}/"
        ).result()
    # Old names (moved or dropped) leave the clone; the legacy database keeps them.
    old = {kvcopy.param_name(m.src) for m in moves}
    old |= {kvcopy.param_name(d.src) for d in plan.drops if d.item == TUNIX_PARAMS_ITEM}
    for name in old:
        (t / f"{name}/").delete_range(ts.KvStore.KeyRange()).result()
    txn.commit_async().result()


def _drop_legacy_metadata(tmp: epath.Path) -> None:
    for name in ("_METADATA", "_sharding", "commit_success.txt", "_CHECKPOINT_METADATA"):
        (tmp / name).unlink(missing_ok=True)
    (tmp / "array_metadatas").rmtree(missing_ok=True)


_SYNTH = "_synthesized"
_SCALAR_SHARDING = json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": "cpu:0"})


def _write_dir_step(step: int, dst_json: dict, ctx, sources, use_zarr3: bool) -> Move:
    """Writes ``step`` (int32 scalar) when the source has no optimizer step."""
    from .spec import LeafSpec
    from .target import Dest

    spec = {
        "driver": "zarr3" if use_zarr3 else "zarr",
        "kvstore": kvcopy.sub_kv(dst_json, "step"),
        "dtype": "int32",
        "metadata": {"shape": []},
    }
    ts.open(spec, create=True, context=ctx).result().write(np.int32(step)).result()
    return Move(_SYNTH, ("step",), ("step",), Dest.STEP, LeafSpec((), np.dtype(np.int32)))


def _synth_source(use_zarr3: bool):
    from types import SimpleNamespace

    return SimpleNamespace(
        value_meta={
            "step": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": []}
        },
        shardings={"step": _SCALAR_SHARDING},
        array_meta={},
        use_zarr3=use_zarr3,
    )


def _new_bytes(tmp: epath.Path) -> int:
    """Bytes actually written: files under ``tmp`` not hard-linked from the source."""
    total = 0
    for root, _, files in os.walk(str(tmp)):
        for f in files:
            st = os.stat(os.path.join(root, f))
            total += st.st_size if st.st_nlink == 1 else 0
    return total
