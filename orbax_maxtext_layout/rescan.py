"""A scan change as a transformation of a `Plan`: ``convert --unroll`` / ``--stack``.

The step is planned against the target's counterpart in the source's scan form
(`stacked_form` / `unrolled_form`); `unroll_plan` / `stack_plan` then turn each
move of a scanned block into per-layer ``slice`` moves, or each family of
per-layer moves into one ``stack`` move, on the layer axis the model gives it
(`scan.scan_axes`), never a rank rule. RNG state one form has and the other
lacks is dropped with a reason (unroll) or initialised fresh (stack).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping

from . import scan
from .errors import LayoutMismatchError
from .moves import Drop, Move, Op, Plan
from .rng import is_rng
from .target import AUX_ROOT, OPT_ROOT, PARAMS_ROOT, STEP_PATH, Dest, Target
from .treepaths import Path, keystr

_UNSCANNED_RNG = "RNG state the unscanned target does not hold"
_SHARED_RNG = "the unscanned model shares one RNG stream across its layers"


def stacked_form(target: Target) -> Target:
    """The scanned counterpart of an unscanned output target (what an unroll reads)."""
    return scan.stack_target(target)


def unrolled_form(target: Target) -> Target:
    """The unscanned counterpart of a scanned output target (what a stack reads)."""
    return scan.unroll_target(target)


def with_scan_axes(target: Target, axes: Mapping[str, int]) -> Target:
    """``target`` with each Param's layer axis taken from ``axes`` (stacked model path -> axis).

    A replay (`verify`) has only the written items; this restores the axes the
    conversion took from the model, which the plan records.
    """
    out = {}
    for p in target.params:
        stacked = keystr(tuple(_stacked_key(k) for k in p))
        if stacked in axes:
            out[p] = int(axes[stacked])
    return dataclasses.replace(target, param_scan_axes=out)


def _stacked_key(k: str | int) -> str | int:
    hit = scan.layer_of(k)
    return hit[0] if hit else k


def _full_paths(t: Target) -> set[Path]:
    out = {PARAMS_ROOT + p for p in t.params} | {AUX_ROOT + p for p in t.nnx_aux}
    return out | {OPT_ROOT + p for p in (t.opt_state or {})}


def _recorded_axes(axes: Mapping[Path, int | None]) -> tuple[tuple[str, int], ...]:
    return tuple(
        sorted(
            (keystr(p[2:]), a) for p, a in axes.items() if p[:2] == PARAMS_ROOT and a is not None
        )
    )


def _unrolled(path: Path, group: str, i: int) -> Path:
    return tuple(f"{group}_{i}" if k == group else k for k in path)


def unroll_plan(plan: Plan, stacked: Target, out: Target) -> Plan:
    """Per-layer ``slice`` moves for a plan made against the scanned ``stacked`` target.

    ``plan`` was made with ``unnamed="skip"``: model leaves the scanned target
    lacks must be RNG state (anything else is a wrong model and is refused).
    """
    bad = [
        d
        for d in plan.drops
        if d.reason == "not requested by the target"
        and not is_rng(tuple(k for k in d.src if k != "value"))
    ]
    if bad:
        raise LayoutMismatchError(
            "model_params does not match the target model:",
            [f"{keystr(d.src)}: not in the target model ({d.spec})" for d in bad],
        )
    drops = [
        dataclasses.replace(d, reason=_UNSCANNED_RNG)
        if d.reason == "not requested by the target"
        else d
        for d in plan.drops
    ]
    axes = scan.scan_axes(stacked)
    # What the output must hold: the model, and the optimizer if one is converted.
    converts_opt = any(m.dest is Dest.OPT_STATE for m in plan.moves)
    want = {p for p in _full_paths(out) if converts_opt or p[:1] != OPT_ROOT}
    moves: list[Move] = []
    problems = []
    for m in plan.moves:
        a = axes.get(m.dst)
        if a is None:
            moves.append(m)
            continue
        assert m.op in (Op.COPY, Op.MERGE_LORA), m
        # A merge keeps its op: it then merges layer i only (`moves.merge_layer`).
        op = Op.SLICE if m.op is Op.COPY else m.op
        group = next(k for k in m.dst if k in scan.SCAN_GROUPS)
        for i in range(m.spec.shape[a]):
            dst = _unrolled(m.dst, group, i)
            if dst in want or (m.dst[:1] == OPT_ROOT and out.opt_state is None):
                moves.append(dataclasses.replace(m, dst=dst, op=op, axis=a, index=i))
            elif m.dst[:2] == AUX_ROOT and is_rng(m.dst):
                # Held at another layer (layers_0) only: one stream shared by every layer.
                shared = any(_unrolled(m.dst, group, j) in want for j in range(m.spec.shape[a]))
                why = _SHARED_RNG if shared else _UNSCANNED_RNG
                layer = dataclasses.replace(m.spec, shape=m.spec.shape[:a] + m.spec.shape[a + 1 :])
                drops.append(Drop(m.item, (*m.src, f"[layer {i}]"), layer, why))
            else:
                problems.append(f"{keystr(dst)}: not in the unscanned target")
    missing = want - {m.dst for m in moves} - {STEP_PATH}
    problems += [
        f"{keystr(p)}: expected by the target, not produced" for p in sorted(missing, key=keystr)
    ]
    if problems:
        raise LayoutMismatchError("The unrolled step does not match the target:", problems)
    return dataclasses.replace(
        plan,
        moves=tuple(moves),
        drops=tuple(drops),
        rules=(*plan.rules, "unroll"),
        scan="unroll",
        scan_axes=_recorded_axes(axes),
    )


def stack_plan(plan: Plan, unrolled: Target, out: Target) -> Plan:
    """One ``stack`` move per family of per-layer moves of a plan made against ``unrolled``."""
    axes = scan.scan_axes(out)
    families: dict[Path, dict[int, Move]] = defaultdict(dict)
    moves: list[Move] = []
    for m in plan.moves:
        hit = next(((j, g) for j, k in enumerate(m.dst) if (g := scan.layer_of(k))), None)
        if hit is None:
            moves.append(m)
            continue
        pos, (group, i) = hit
        families[m.dst[:pos] + (group,) + m.dst[pos + 1 :]][i] = m
    produced = set(families) | {m.dst for m in moves}
    for p, spec in out.nnx_aux.items():  # RNG state the unscanned step never had
        if AUX_ROOT + p not in produced and is_rng(p):
            note = "initialised fresh (not in the unscanned checkpoint)"
            a = axes.get(AUX_ROOT + p)
            # In a block, each layer is derived as a missing layer of a stack is (and as
            # `scan.stack` derives it), unless the target holds one value for all layers.
            a = a if a is not None and len(spec.shape) - bool(spec.key_impl) > a else None
            fresh = Move("", (), AUX_ROOT + p, Dest.NNX_AUX, spec, op=Op.FRESH, axis=a, note=note)
            moves.append(fresh)
    problems = []
    for dst, layers in families.items():
        a = axes.get(dst)
        want = _spec_at(out, dst)
        n = want.shape[a] if want is not None and a is not None else max(layers) + 1
        gaps = [i for i in range(n) if i not in layers]
        if a is None or (gaps and not (dst[:2] == AUX_ROOT and is_rng(dst))):
            problems.append(f"{keystr(dst)}: layers {sorted(layers)} do not stack (axis {a})")
            continue
        first = layers[min(layers)]
        note = f"layers {gaps} initialised fresh" if gaps else ""
        srcs = tuple(layers[i].src if i in layers else None for i in range(n))
        if first.op is Op.MERGE_LORA:  # each layer merged with its own factors
            merged = [layers[i] for i in range(n) if i in layers and layers[i].lora]
            if gaps or len(merged) != n:
                problems.append(f"{keystr(dst)}: layers {sorted(layers)} do not all merge")
                continue
            lora = tuple(m.lora[0] for m in merged)
            moves.append(dataclasses.replace(first, dst=dst, axis=a, layers=srcs, lora=lora))
            continue
        moves.append(
            dataclasses.replace(first, dst=dst, op=Op.STACK, axis=a, layers=srcs, note=note)
        )
    if problems:
        raise LayoutMismatchError("The step does not stack onto the target:", problems)
    return dataclasses.replace(
        plan,
        moves=tuple(moves),
        rules=(*plan.rules, "stack"),
        scan="stack",
        scan_axes=_recorded_axes(axes),
    )


def _spec_at(t: Target, path: Path):
    for root, section in (
        (PARAMS_ROOT, t.params),
        (AUX_ROOT, t.nnx_aux),
        (OPT_ROOT, t.opt_state or {}),
    ):
        if path[: len(root)] == root:
            return section.get(path[len(root) :])
    return None
