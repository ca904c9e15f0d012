"""``convert --unroll`` / ``--stack``: convert a step into the *other* scan form.

The target is given in the output's form. The step is planned against the
target's counterpart in the source's form (`scan.stack_target` /
`scan.unroll_target`), and every planned array is then re-sliced on the layer
axis the model gives it (`scan.scan_axes`), one destination array at a time, so
memory stays near the largest stacked array. Re-slicing changes the bytes, so
these arrays are decoded and re-encoded (zstd, one chunk each).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from typing import Literal

import numpy as np
from etils import epath

from . import kvcopy, scan
from ._tree import Path, keystr
from .engine import commit, new_tmp_dir, read_leaves, source_items
from .errors import LayoutMismatchError
from .layout import TUNIX_PARAMS_ITEM
from .plan import Drop, Move, OptimizerMode, Plan
from .spec import LeafSpec
from .target import AUX_ROOT, OPT_ROOT, PARAMS_ROOT, Dest, Target

Direction = Literal["unroll", "stack"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One output array: ``sources`` (one move, or one per layer) joined or sliced."""

    dst: Path
    moves: tuple[Move | None, ...]
    axis: int | None  # layer axis of the stacked side
    index: int | None  # unroll: the layer taken
    spec_shape: tuple[int, ...]
    fresh: LeafSpec | None = None  # a whole leaf the source lacks: initialised fresh


def _full_target_paths(t: Target) -> set[Path]:
    out = {PARAMS_ROOT + p for p in t.params} | {AUX_ROOT + p for p in t.nnx_aux}
    return out | {OPT_ROOT + p for p in (t.opt_state or {})}


def _is_rng(path: Path) -> bool:
    return len(path) >= 3 and path[-3] == "rngs" and path[-1] in ("count", "key")


def _renamed(path: Path, group: str, i: int) -> Path:
    return tuple(f"{group}_{i}" if k == group else k for k in path)


def plan_unroll(plan: Plan, stacked: Target, out: Target) -> tuple[list[Piece], list[Drop]]:
    """Per-layer output arrays of a plan made against the scanned ``stacked`` target."""
    axes = scan.scan_axes(stacked)
    want = _full_target_paths(out)
    pieces, drops, problems = [], [], []
    for m in plan.moves:
        a = axes.get(m.dst)
        if a is None:
            pieces.append(Piece(m.dst, (m,), None, None, m.spec.shape))
            continue
        group = next(k for k in m.dst if k in scan.SCAN_GROUPS)
        n = m.spec.shape[a]
        shape = m.spec.shape[:a] + m.spec.shape[a + 1 :]
        for i in range(n):
            dst = _renamed(m.dst, group, i)
            if dst in want or (m.dst[:1] == OPT_ROOT and out.opt_state is None):
                pieces.append(Piece(dst, (m,), a, i, shape))
            elif m.dst[:2] == AUX_ROOT and _is_rng(m.dst):
                reason = "RNG state the unscanned target does not hold (a shared stream)"
                drops.append(Drop(m.item, m.src + (f"[layer {i}]",), m.spec, reason))
            else:
                problems.append(f"{keystr(dst)}: not in the unscanned target")
    missing = want - {p.dst for p in pieces} - ({("step",)} if plan.step is not None else set())
    problems += [
        f"{keystr(p)}: expected by the target, not produced" for p in sorted(missing, key=keystr)
    ]
    if problems:
        raise LayoutMismatchError("The unrolled step does not match the target:", problems)
    return pieces, drops


def plan_stack(plan: Plan, unrolled: Target, out: Target) -> list[Piece]:
    """Stacked output arrays of a plan made against the unscanned ``unrolled`` target."""
    axes = scan.scan_axes(out)
    members: dict[Path, dict[int, Move]] = defaultdict(dict)
    singles = []
    for m in plan.moves:
        hit = next(((i, k) for i, k in enumerate(m.dst) if _layer_of(k)), None)
        if hit is None:
            singles.append(Piece(m.dst, (m,), None, None, m.spec.shape))
            continue
        pos, key = hit
        group, i = _layer_of(key)
        members[m.dst[:pos] + (group,) + m.dst[pos + 1 :]][i] = m
    pieces = list(singles)
    problems = []
    produced = set(members) | {p.dst for p in singles}
    for p, spec in out.nnx_aux.items():  # RNG state the unscanned step never had
        if AUX_ROOT + p not in produced and _is_rng(p):
            pieces.append(Piece(AUX_ROOT + p, (), None, None, spec.shape, fresh=spec))
    for dst, layers in members.items():
        a = axes.get(dst)
        spec = _spec_at(out, dst)
        n = spec.shape[a] if spec is not None and a is not None else max(layers) + 1
        gaps = [i for i in range(n) if i not in layers]
        if a is None or (gaps and not (dst[:2] == AUX_ROOT and _is_rng(dst))):
            problems.append(f"{keystr(dst)}: layers {sorted(layers)} do not stack (axis {a})")
            continue
        first = next(iter(layers.values())).spec.shape
        shape = first[:a] + (n,) + first[a:]
        pieces.append(Piece(dst, tuple(layers.get(i) for i in range(n)), a, None, shape))
    if problems:
        raise LayoutMismatchError("The step does not stack onto the target:", problems)
    return pieces


def _spec_at(t: Target, path: Path):
    for root, section in (
        (PARAMS_ROOT, t.params),
        (AUX_ROOT, t.nnx_aux),
        (OPT_ROOT, t.opt_state or {}),
    ):
        if path[: len(root)] == root:
            return section.get(path[len(root) :])
    return None


def _fresh_like(x: np.ndarray, path: Path, i: int, key_impl: str | None) -> np.ndarray:
    """Fresh RNG state for a layer the unscanned checkpoint did not store."""
    if path[-1] == "count" or not key_impl:
        return np.zeros_like(x)
    import zlib

    import jax

    key = jax.random.fold_in(jax.random.key(zlib.crc32(keystr(path).encode()), impl=key_impl), i)
    return np.asarray(jax.random.key_data(key)).reshape(x.shape).astype(x.dtype)


def _layer_of(key) -> tuple[str, int] | None:
    s = str(key)
    for g in scan.SCAN_GROUPS:
        if s.startswith(g + "_") and s[len(g) + 1 :].isdigit():
            return g, int(s[len(g) + 1 :])
    return None


def write_pieces(
    step_dir: epath.Path,
    dest: epath.Path,
    plan: Plan,
    pieces: list[Piece],
    *,
    provenance: dict,
    cast: dict[Path, np.dtype],
) -> int:
    """Reads, re-slices and writes each piece, one at a time; commits ``dest/items``."""
    ctx = kvcopy.ts_context()
    srcs = {n: kvcopy.SourceItem.open(d, ctx) for n, d in source_items(step_dir).items()}
    use_zarr3 = srcs[TUNIX_PARAMS_ITEM].use_zarr3
    tmp = new_tmp_dir(dest)
    try:
        parent = kvcopy.open_ocdbt(tmp, ctx, merge=True).spec().to_json()
        meta_moves = []
        for piece in pieces:
            if piece.fresh is not None:
                meta_moves.append(_write_fresh(piece, parent, ctx, use_zarr3, srcs))
                continue
            # One stacked array, or the L per-layer arrays of one leaf (None: a layer
            # of a shared RNG stream the checkpoint does not store).
            arrays = [
                None if m is None else read_leaves(srcs[m.item].dir, {m.src})[m.src]
                for m in piece.moves
            ]
            present = next(x for x in arrays if x is not None)
            m = next(m for m in piece.moves if m is not None)
            arrays = [
                np.asarray(x)
                if x is not None
                else _fresh_like(np.asarray(present), piece.dst, i, m.spec.key_impl)
                for i, x in enumerate(arrays)
            ]
            if piece.index is not None:
                data = np.take(np.asarray(arrays[0]), piece.index, axis=piece.axis)
            elif piece.axis is not None:
                data = np.stack([np.asarray(x) for x in arrays], axis=piece.axis)
            else:
                data = np.asarray(arrays[0])
            if m.dst in cast:
                data = data.astype(cast[m.dst])
            kvcopy.write_array(
                parent,
                kvcopy.param_name(piece.dst),
                np.array(data, order="C"),
                use_zarr3=use_zarr3,
                context=ctx,
            )
            spec = dataclasses.replace(m.spec, shape=tuple(data.shape), dtype=data.dtype)
            meta_moves.append(dataclasses.replace(m, dst=piece.dst, spec=spec))
            del arrays, data
        kvcopy.write_metadata(
            tmp,
            meta_moves,
            srcs,
            use_zarr3=use_zarr3,
            gaps=kvcopy.list_gaps(m.dst for m in meta_moves),
        )
        written = sum(f.stat().length for f in _files(tmp))
        commit(dest, tmp, provenance | {"bytes_written": written})
    except BaseException:
        tmp.rmtree(missing_ok=True)
        raise
    return written


_FRESH = "_fresh"


def _write_fresh(piece: Piece, parent: dict, ctx, use_zarr3: bool, srcs: dict) -> Move:
    spec = piece.fresh
    like = np.zeros(spec.shape, spec.dtype)
    data = _fresh_like(like, piece.dst, 0, spec.key_impl) if spec.key_impl else like
    name = kvcopy.param_name(piece.dst)
    kvcopy.write_array(parent, name, data, use_zarr3=use_zarr3, context=ctx)
    fresh = srcs.setdefault(_FRESH, _FreshSource())
    fresh.value_meta[name] = {
        "value_type": "jax.Array",
        "skip_deserialize": False,
        "write_shape": list(spec.shape),
    }
    fresh.shardings[name] = kvcopy._SINGLE_DEVICE
    fresh.array_meta[name] = {
        "write_shape": list(spec.shape),
        "chunk_shape": list(spec.shape),
        "ext_metadata": {"random_key_impl": spec.key_impl} if spec.key_impl else None,
    }
    return Move(_FRESH, piece.dst, piece.dst, Dest.NNX_AUX, spec, note="initialised fresh")


@dataclasses.dataclass
class _FreshSource:
    value_meta: dict = dataclasses.field(default_factory=dict)
    shardings: dict = dataclasses.field(default_factory=dict)
    array_meta: dict = dataclasses.field(default_factory=dict)


def _files(d: epath.Path) -> Iterable[epath.Path]:
    for c in d.iterdir():
        yield from _files(c) if c.is_dir() else (c,)


def plan_rescan(
    step_dir: epath.Path,
    target: Target,
    direction: Direction,
    *,
    optimizer: OptimizerMode,
    ignore: Iterable[str],
) -> tuple[Plan, list[Piece]]:
    """Plans a scan-form change; the returned plan lists what is dropped and why."""
    from .convert import plan_step

    if direction == "unroll":
        source_form = scan.stack_target(target)
        # A scanned model holds RNG state its unscanned twin lacks (decoder/rngs, the
        # per-layer copies of shared streams): skip it here, refuse anything else.
        plan = plan_step(step_dir, source_form, optimizer=optimizer, ignore=ignore, unnamed="skip")
        unknown = [d for d in plan.drops if d.reason == "not requested by the target"]
        bad = [d for d in unknown if not _is_rng(tuple(k for k in d.src if k != "value"))]
        if bad:
            raise LayoutMismatchError(
                "model_params does not match the target model:",
                [f"{keystr(d.src)}: not in the target model ({d.spec})" for d in bad],
            )
        plan = dataclasses.replace(
            plan,
            drops=tuple(
                dataclasses.replace(d, reason="RNG state the unscanned target does not hold")
                if d in unknown
                else d
                for d in plan.drops
            ),
        )
        pieces, drops = plan_unroll(plan, source_form, target)
    else:
        source_form = scan.unroll_target(target)
        # Unscanned models store a shared RNG stream once; the other layers' copies
        # are initialised fresh, and the plan's notes say which.
        plan = plan_step(
            step_dir,
            source_form,
            optimizer=optimizer,
            ignore=ignore,
            allow_missing=_is_rng,
        )
        pieces, drops = plan_stack(plan, source_form, target), []
    return dataclasses.replace(
        plan, drops=plan.drops + tuple(drops), rules=(*plan.rules, direction)
    ), pieces
