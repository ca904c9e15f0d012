"""Executes a `Plan`: read the source leaves, assemble MaxText items, commit atomically."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from ._tree import FlatTree, Path, unflatten
from .errors import CheckpointReadError
from .layout import (
    MAXTEXT_ITEM,
    PROVENANCE_KEY,
    STEP_METADATA,
    TUNIX_OPT_ITEM,
    TUNIX_PARAMS_ITEM,
    read_step_metadata,
)
from .plan import Plan
from .spec import _absolute

TMP_SUFFIX = ".orbax-checkpoint-tmp-"  # the marker Orbax and `find_steps` skip
_HANDLER_TYPESTR = (
    "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
)


def _restore_arg(abstract: Any) -> ocp.RestoreArgs:
    sharding = getattr(abstract, "sharding", None)
    if sharding is None:
        return ocp.RestoreArgs(restore_type=np.ndarray)
    # Restore straight into the destination's sharding: each host reads only its
    # shards, and nothing is gathered onto one host.
    return ocp.ArrayRestoreArgs(
        sharding=sharding, global_shape=abstract.shape, dtype=abstract.dtype
    )


RestoreFn = Callable[[epath.Path, ocp.args.PyTreeRestore], Any]


def read_leaves(
    item_dir: epath.Path,
    paths: set[Path],
    abstract: Mapping[Path, Any] | None = None,
    restore: RestoreFn | None = None,
) -> FlatTree:
    """Reads only ``paths`` of an item.

    Without ``abstract`` (``{src path: abstract leaf}``) leaves come back as host
    numpy arrays in their stored form (PRNG keys as raw uint32, rewrapped by
    `assemble`), independent of the devices recorded in the source's ``_sharding``.
    Leaves whose abstract value has a ``sharding`` are restored as jax.Arrays with it.
    ``restore`` is the PyTree restore to use (a handler's own, so its options apply).
    """
    if not paths:
        return {}
    abstract = abstract or {}
    item = unflatten({p: 0 for p in paths})
    restore_args = unflatten({p: _restore_arg(abstract.get(p)) for p in paths})
    try:
        restore = restore or (lambda d, a: ocp.PyTreeCheckpointHandler().restore(d, args=a))
        tree = restore(
            _absolute(item_dir),
            ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
        )
    except Exception as e:  # tensorstore/Orbax raise many types for damaged data
        raise CheckpointReadError(f"{item_dir}: cannot read array data: {e}") from e
    out: FlatTree = {}
    for p in paths:
        node: Any = tree
        for k in p:
            node = node[k]
        out[p] = node
    return out


def assemble(plan: Plan, sources: Mapping[str, FlatTree]) -> dict:
    """Builds the MaxText items tree from source leaves, following ``plan`` exactly.

    ``sources`` maps item name ("model_params"/"optimizer_state") to ``{src path: array}``.
    Stored-form uint32 key data is rewrapped as typed keys, so MaxText resumes get
    ``key<...>`` arrays and not raw ``(..., 2)`` uint32.
    """
    flat: FlatTree = {}
    for m in plan.moves:
        x = sources[m.item][m.src]
        if m.spec.key_impl and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.wrap_key_data(jnp.asarray(x), impl=m.spec.key_impl)
        elif m.cast is not None and np.dtype(x.dtype) != m.cast:
            x = np.asarray(x).astype(m.cast)
        flat[m.dst] = x
    if plan.step is not None and ("step",) not in flat:
        flat[("step",)] = np.int32(plan.step)
    return unflatten(flat)


def _to_jax(tree: Any) -> Any:
    # Orbax records the value type; MaxText saves jax.Arrays, so write those.
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), tree)


def new_tmp_dir(step_dir: epath.Path) -> epath.Path:
    """An Orbax-style temporary directory for ``items`` (ignored by readers and `find_steps`)."""
    tmp = step_dir / f"{MAXTEXT_ITEM}{TMP_SUFFIX}{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=False)
    return tmp


def commit(step_dir: epath.Path, tmp: epath.Path, provenance: dict) -> None:
    """The single commit point: provenance into step metadata, then rename ``tmp`` to ``items``.

    ``commit_success.txt`` is written first (object-store readers rely on it). A crash
    before the rename leaves only an ignored temporary directory; the metadata is
    rolled back if the rename itself fails.
    """
    (tmp / "commit_success.txt").write_text(f"Checkpoint successfully committed at {time.time()}.")
    old_meta = read_step_metadata(step_dir)
    _write_step_metadata(step_dir, old_meta, provenance)
    try:
        tmp.rename(step_dir / MAXTEXT_ITEM)
    except BaseException:
        _restore_step_metadata(step_dir, old_meta)
        raise


def write_items(step_dir: epath.Path, tree: Any, *, use_zarr3: bool, provenance: dict) -> int:
    """Saves an in-memory items tree with stock Orbax as ``<step_dir>/items``, atomically.

    Used when the zarr format changes (every array is re-encoded anyway); the
    streaming `stream_items` is the default. Returns bytes written.
    """
    tmp = new_tmp_dir(step_dir)
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=use_zarr3)
    try:
        handler.save(_absolute(tmp), args=ocp.args.PyTreeSave(_to_jax(tree)))
        handler.finalize(_absolute(tmp))
        written = _du(tmp)
        commit(step_dir, tmp, provenance)
    except BaseException:
        tmp.rmtree(missing_ok=True)
        raise
    finally:
        handler.close()
    return written


def _write_step_metadata(step_dir: epath.Path, old: dict, provenance: dict) -> None:
    meta = dict(old) or {"item_handlers": {}, "metrics": {}, "performance_metrics": {}}
    handlers = dict(meta.get("item_handlers") or {})
    handlers[MAXTEXT_ITEM] = _HANDLER_TYPESTR
    meta["item_handlers"] = handlers
    custom = dict(meta.get("custom_metadata") or {})
    custom[PROVENANCE_KEY] = provenance
    meta["custom_metadata"] = custom
    _replace_json(step_dir / STEP_METADATA, meta)


def _restore_step_metadata(step_dir: epath.Path, old: dict) -> None:
    if old:
        _replace_json(step_dir / STEP_METADATA, old)
    else:
        (step_dir / STEP_METADATA).unlink(missing_ok=True)


def _replace_json(path: epath.Path, data: dict) -> None:
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path) if _is_local(path) else tmp.rename(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: leave nothing behind
        raise


def _is_local(path: epath.Path) -> bool:
    return not str(path).startswith(("gs://", "s3://"))


def _du(path: epath.Path) -> int:
    """Bytes under ``path`` (walks with iterdir: epath forbids recursive globs on GCS)."""
    total = 0
    for child in path.iterdir():
        total += _du(child) if child.is_dir() else child.stat().length
    return total


def source_items(step_dir: epath.Path) -> dict[str, epath.Path]:
    out = {TUNIX_PARAMS_ITEM: step_dir / TUNIX_PARAMS_ITEM}
    if (step_dir / TUNIX_OPT_ITEM).is_dir():
        out[TUNIX_OPT_ITEM] = step_dir / TUNIX_OPT_ITEM
    return out


def read_sources(
    step_dir: epath.Path,
    plan: Plan,
    abstract: Mapping[Path, Any] | None = None,
    restore: RestoreFn | None = None,
) -> dict[str, FlatTree]:
    """Reads every leaf the plan moves, and nothing else (dropped leaves stay on disk).

    ``abstract`` maps destination items paths to abstract leaves (e.g. `Target.abstract`);
    a destination leaf with a sharding is restored directly with it.
    """
    out = {}
    for name, item_dir in source_items(step_dir).items():
        moves = plan.moves_from(name)
        if not moves:
            continue  # e.g. optimizer='drop': the optimizer item is never opened
        by_src = {m.src: abstract[m.dst] for m in moves if abstract and m.dst in abstract}
        out[name] = read_leaves(item_dir, {m.src for m in moves}, by_src, restore)
    return out
