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
from .engine import _du, commit, new_tmp_dir
from .layout import TUNIX_PARAMS_ITEM
from .plan import Move, Plan

DEFAULT_BUDGET = 1 << 30  # 1 GiB


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

    Each OCDBT source database is cloned *inside* the new item directory (hard
    links with ``in_place``, a streaming file copy otherwise) and its arrays are
    grafted into the new root database under their new names with
    ``experimental_copy_range_to``: only B-tree nodes are written, never array
    bytes. Non-OCDBT sources (Pathways style) are copied chunk by chunk within
    ``budget``. The destination keeps the source's zarr format.
    """
    ctx = kvcopy.ts_context()
    sources = {name: kvcopy.SourceItem.open(d, ctx) for name, d in sources_dirs.items()}
    use_zarr3 = sources[TUNIX_PARAMS_ITEM].use_zarr3
    tmp = new_tmp_dir(step_dir)
    try:
        raw = [m for m in plan.moves if m.cast is None]
        casts = [m for m in plan.moves if m.cast is not None]
        kvcopy.check_complete(list(plan.moves), sources)  # casts too: `step` must exist
        graft = {n for n, s in sources.items() if s.is_ocdbt and any(m.item == n for m in raw)}
        children = {}
        for name in sorted(graft):
            child_dir = tmp / f"{kvcopy.CHILD_PREFIX}{name}"
            kvcopy.clone_tree(sources[name].dir, child_dir, link=in_place)
            children[name] = kvcopy.open_ocdbt(child_dir, ctx)
        parent = kvcopy.open_ocdbt(tmp, ctx, merge=bool(graft))
        kvcopy.graft([m for m in raw if m.item in graft], children, parent)
        kvcopy.copy_chunks([m for m in raw if m.item not in graft], sources, parent, budget=budget)
        dst_json = parent.spec().to_json()
        for m in casts:
            kvcopy.cast_array(m, sources[m.item], dst_json, ctx)
        moves = list(plan.moves)
        if plan.step_source == "directory name":
            moves.append(_write_dir_step(plan.step, dst_json, ctx, use_zarr3))
            sources[_SYNTH] = _synth_source(use_zarr3)
        kvcopy.write_metadata(
            tmp, moves, sources, use_zarr3=use_zarr3, gaps=kvcopy.list_gaps(m.dst for m in moves)
        )
        written = _new_bytes(tmp)
        commit(step_dir, tmp, provenance | {"bytes_written": written, "in_place": in_place})
    except BaseException:
        tmp.rmtree(missing_ok=True)
        raise
    return written


_SYNTH = "_synthesized"
_SCALAR_SHARDING = json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": "cpu:0"})


def _write_dir_step(step: int, dst_json: dict, ctx, use_zarr3: bool) -> Move:
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
    if "://" in str(tmp):
        return _du(tmp)  # object stores have no hard links
    total = 0
    for root, _, files in os.walk(str(tmp)):
        for f in files:
            st = os.stat(os.path.join(root, f))
            total += st.st_size if st.st_nlink == 1 else 0
    return total
