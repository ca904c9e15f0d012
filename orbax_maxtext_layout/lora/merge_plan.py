"""A LoRA merge as a plan: a Tunix adapter step folded into its base, as MaxText params.

A merge is a plan like any conversion (`plan_merge`): every param of the base is
a ``copy`` move (its stored bytes are grafted, never decoded), except each adapted
weight, which becomes a ``merge_lora`` move: per layer ``l``,
``W_l + (alpha / rank) * reshape(A_l @ B_l, W_l.shape)`` on the weight's own layer
axis. A scan change (``scan="unroll"``/``"stack"``) transforms that plan (`rescan`)
as for a conversion. The one writer executes it into ``<out>/0/items`` (MaxText's
``generate_param_only_checkpoint`` convention), the step appears only once
complete (`merge.merge_lora`, the job), and `verify_step` replays it from the
provenance it records (`replay_merge`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np
from etils import epath

from ..base.treepaths import Path, keystr
from ..errors import CheckpointReadError, LayoutMismatchError, UsageError
from ..execute.verify import REPLAYS
from ..model.lora import (
    LoraAdapters,
    adapters_of,
    delta_layouts,
    factor_paths,
    model_paths,
    per_layer_shape,
)
from ..model.scan_targets import stack_target, unroll_target
from ..model.target import PARAMS_ROOT, Dest, Target
from ..orbax_io import stepmeta
from ..orbax_io.layout import (
    MAXTEXT_ITEM,
    TUNIX_PARAMS_ITEM,
    Layout,
    detect_layout,
)
from ..orbax_io.ocdbt import check_contained
from ..orbax_io.spec import LeafSpec, read_specs
from ..plan.moves import Drop, LoraFactor, Move, Plan
from ..plan.provenance import record as provenance_record
from ..plan.rescan import check_plain_stack, unroll_plan, written_form
from ..plan.rescan import stack_plan as _stack_plan
from ..plan.step_plan import narrow, plan_step
from ..storage.store import store_for
from .merge_op import MERGE_LORA, MergeArgs

LORA_ITEM = "lora"  # the adapter step's model_params, as a source of a merge plan
SOURCE_LAYOUT = "tunix-lora-merge"
NOT_PARAMS = "not a param: a param-only checkpoint keeps params only"


# -- inputs ------------------------------------------------------------------------------
def adapter_item(adapter_step: epath.PathLike) -> tuple[epath.Path, epath.Path]:
    """``(step dir, model_params dir)`` of a LoRA step given as the step or its model_params."""
    p = epath.Path(adapter_step)
    if p.name == TUNIX_PARAMS_ITEM:
        return p.parent, p
    if detect_layout(p) is not Layout.TUNIX:
        raise CheckpointReadError(
            f"{p}: not a Tunix step (no model_params/); pass the LoRA step directory or its "
            "model_params."
        )
    return p, p / TUNIX_PARAMS_ITEM


def base_source(base: epath.PathLike) -> tuple[epath.Path, str, epath.Path]:
    """``(step dir, item name, item dir)`` of a base given as a MaxText step, its
    ``items``, or a Tunix step (or its ``model_params``)."""
    p = epath.Path(base)
    if p.name in (MAXTEXT_ITEM, TUNIX_PARAMS_ITEM) and (p / "_METADATA").exists():
        return p.parent, p.name, p
    layout = detect_layout(p)
    if layout is Layout.MAXTEXT:
        return p, MAXTEXT_ITEM, p / MAXTEXT_ITEM
    if layout is Layout.TUNIX:
        return p, TUNIX_PARAMS_ITEM, p / TUNIX_PARAMS_ITEM
    raise CheckpointReadError(
        f"{p}: not a checkpoint step (neither items/ nor model_params/); pass the base "
        "MaxText step, its items/, or a full Tunix step of the same model."
    )


def read_adapters(adapter_dir: epath.Path, params_dir: epath.Path) -> LoraAdapters:
    """The adapters of a LoRA step, or a `LayoutMismatchError` naming what else it holds."""
    custom = stepmeta.custom(stepmeta.read(adapter_dir))
    specs = read_specs(params_dir)
    cur = model_paths(specs)
    found = adapters_of(cur, specs, custom)
    if found is not None:
        return found
    factors = factor_paths(cur)
    listed = sorted(cur.items(), key=lambda kv: keystr(kv[0]))
    others = [f"{keystr(src)} ({specs[src]})" for p, src in listed if p not in factors]
    raise LayoutMismatchError(
        f"{adapter_dir}: not a LoRA adapter step: its model_params holds "
        + (
            f"{len(others)} leaves that are not LoRA factors (<weight>_lora_a/_lora_b):"
            if others
            else "LoRA factors without their pair:"
        ),
        others or [keystr(src) for src in cur.values()],
        hint="merge-lora takes a step saved with only its LoRA adapters (Tunix's PeftTrainer "
        "with LoRA on); a full step converts with `convert`.",
    )


# -- the plan ----------------------------------------------------------------------------
def plan_merge(
    adapter_step: epath.PathLike,
    base: epath.PathLike,
    *,
    alpha: float | None = None,
    target: Target | None = None,
    scan: Literal["unroll", "stack"] | None = None,
    scan_axis: int | None = None,
    unnamed: Literal["error", "skip"] = "error",
    plain_scan: bool = False,
) -> tuple[Plan, LoraAdapters, float]:
    """The merge as a `Plan`, from metadata alone; returns ``(plan, adapters, alpha)``.

    ``alpha`` defaults to what the step records; ``target`` is needed for a Tunix base
    (to tell its weights from its RNG state); ``scan_axis`` forces the layer axis where
    the shapes fit both 0 and 1. ``unnamed="skip"`` lets a Tunix base hold leaves the
    target does not name (a replay, whose target is the merged params).

    Raises:
      UsageError: no alpha given or recorded; a Tunix base without a target.
      LayoutMismatchError: the adapters do not fit the base (every module named, with
        both shapes), or the step holds no LoRA adapters.
    """
    adapter_dir, params_dir = adapter_item(adapter_step)
    check_contained(params_dir)  # both sources, before anything is written
    adapters = read_adapters(adapter_dir, params_dir)
    alpha = alpha if alpha is not None else adapters.alpha
    if alpha is None:
        raise UsageError(
            f"{adapter_dir}: LoRA alpha is needed (the step does not record it; Tunix saves "
            "neither rank nor alpha): pass --alpha (alpha=), the run's lora.lora_alpha."
        )
    if adapters.rank <= 0:
        raise LayoutMismatchError(f"{adapter_dir}: the LoRA factors have different ranks.")
    base_dir, item, item_dir = base_source(base)
    check_contained(item_dir)
    plan, base_target = params_plan(base_dir, item, item_dir, target, unnamed)
    merged, axis = _merge_moves(
        plan, adapters, alpha=alpha, target=base_target, scan_axis=scan_axis, base_dir=base_dir
    )
    plan = dataclasses.replace(
        plan,
        moves=tuple(merged.get(m.dst, m) for m in plan.moves),
        rules=(*plan.rules, "merge_lora"),
    )
    if scan is not None:
        # MaxText's own model in the written form where the target was built from its config
        # (its params: a merge writes params only), whichever scan_layers the config named:
        # the config names the model, the flag the form (`rescan.written_form`, as convert).
        # Else the base's other form, derived.
        other = written_form(target, scan)
        if other is not None:
            other = Target(other.params, {}, param_scan_axes=other.param_scan_axes)
        stacked = _with_axis(base_target, axis)
        if scan == "unroll":
            if axis is None:
                raise UsageError(f"{base_dir}: the base is unscanned already; drop --unroll.")
            plan = unroll_plan(plan, stacked, other or unroll_target(stacked))
        elif scan == "stack":
            if adapters.scanned:
                raise UsageError(f"{base_dir}: the base is scanned already; drop --stack.")
            if other is None:
                check_plain_stack(base_target, plain_scan=plain_scan, where=base_dir)
            out = other or _with_axis(
                stack_target(base_target), 1 if scan_axis is None else scan_axis
            )
            plan = _stack_plan(plan, base_target, out)
        else:
            raise UsageError(f"scan must be 'unroll', 'stack' or None, not {scan!r}.")
    return plan, adapters, float(alpha)


def params_plan(
    base_dir: epath.Path,
    item: str,
    item_dir: epath.Path,
    target: Target | None,
    unnamed: Literal["error", "skip"] = "error",
) -> tuple[Plan, Target]:
    """Every param of the base as a ``copy`` move; everything else dropped with a reason."""
    if item == TUNIX_PARAMS_ITEM:
        if target is None:
            raise UsageError(
                f"{base_dir}: a Tunix base mixes weights and RNG state, and only the model "
                "tells them apart: pass a target (--maxtext-config with the model's MaxText "
                "config, --target-from a MaxText step of the same model, or --target "
                "MODULE:FUNCTION)."
            )
        plan = plan_step(base_dir, target, optimizer="drop", read_optimizer=False, unnamed=unnamed)
        wanted = [m.dst for m in plan.moves if m.dest is Dest.PARAMS]
        plan = narrow(plan, wanted)
        drops = tuple(
            dataclasses.replace(d, reason=NOT_PARAMS)
            if d.reason in ("not requested", "not requested by the target")
            else d
            for d in plan.drops
        )
        return dataclasses.replace(plan, drops=drops, step=None, step_source=""), target
    specs = read_specs(item_dir)
    moves = tuple(
        Move(item, p, p, Dest.PARAMS, s)
        for p, s in sorted(specs.items(), key=lambda kv: keystr(kv[0]))
        if p[:2] == PARAMS_ROOT
    )
    drops = tuple(Drop(item, p, s, NOT_PARAMS) for p, s in specs.items() if p[:2] != PARAMS_ROOT)
    if not moves:
        raise LayoutMismatchError(
            f"{item_dir}: the base holds no params/params leaves (e.g. a MaxText checkpoint "
            "saved with lora.* keys keeps only 'step'); pass the checkpoint the LoRA run "
            "started from (its load_parameters_path)."
        )
    params = {m.dst[2:]: m.spec for m in moves}
    return Plan(moves, drops, (), None, ""), Target(params, {})


def adapter_moves(adapters: LoraAdapters, target: Target, *, alpha: float) -> list[Move]:
    """The merge_lora move of each adapted weight of the model ``target`` (its params), from
    the ``adapters`` a LoRA step holds (`read_adapters`): what a merge into a base of that
    model would compute, without a base (``export-hf --adapter`` reads only the factors).
    Raises `LayoutMismatchError` naming every module whose factors do not fit the model."""
    moves = tuple(
        Move("base", PARAMS_ROOT + p, PARAMS_ROOT + p, Dest.PARAMS, s)
        for p, s in sorted(target.params.items(), key=lambda kv: keystr(kv[0]))
    )
    merged, _ = _merge_moves(
        Plan(moves, (), (), None, ""),
        adapters,
        alpha=alpha,
        target=target,
        scan_axis=None,
        base_dir=epath.Path(f"(the model of the --maxtext-config, {len(moves)} params)"),
    )
    return [merged[m.dst] for m in moves if m.dst in merged]


def _merge_moves(
    plan: Plan,
    adapters: LoraAdapters,
    *,
    alpha: float,
    target: Target,
    scan_axis: int | None,
    base_dir: epath.Path,
) -> tuple[dict[Path, Move], int | None]:
    """The merge_lora move replacing each adapted weight's copy, and the layer axis used."""
    by_dst = {m.dst: m for m in plan.moves}
    scale = alpha / adapters.rank
    problems: list[str] = []
    found: list[tuple[Move, Any]] = []
    for f in adapters.factors:
        m = by_dst.get(PARAMS_ROOT + f.weight)
        shapes = f"lora_a {f.a_spec}, lora_b {f.b_spec}"
        if m is None:
            quantized = any(
                d[: len(PARAMS_ROOT) + len(f.weight) - 1] == PARAMS_ROOT + f.weight[:-1]
                and any("qrhs" in str(k) or "aqt" in str(k).lower() for k in d)
                for d in by_dst
            )
            why = (
                "its kernel is quantized (AQT)"
                if quantized
                else f"the base has no {keystr(f.weight)}"
            )
            problems.append(f"{keystr(f.weight[:-1])}: adapters ({shapes}), but {why}")
            continue
        if (
            not np.issubdtype(np.dtype(m.spec.dtype), np.floating)
            and str(m.spec.dtype) != "bfloat16"
        ):
            problems.append(
                f"{keystr(f.weight[:-1])}: base kernel {m.spec} is quantized; merge into a "
                "full-precision base (QLoRA trains float adapters over a float base)"
            )
            continue
        found.append((m, f))
    axes = _axes(found, adapters, target, scan_axis)
    moves: dict[Path, Move] = {}
    for m, f in found:
        axis = axes.get(m.dst, "bad")
        layouts = [] if axis == "bad" else _layouts(m.spec, f, axis)
        if len(layouts) > 1:
            problems.append(
                f"{keystr(f.weight[:-1])}: factors (lora_a {f.a_spec}, lora_b {f.b_spec}) fit "
                f"base kernel {m.spec} in {len(layouts)} ways (dims of equal size); the shapes "
                "alone cannot tell which"
            )
            continue
        if axis == "bad" or not layouts:
            problems.append(
                f"{keystr(f.weight[:-1])}: factors (lora_a {f.a_spec}, lora_b {f.b_spec}) do not "
                f"fit base kernel {m.spec}"
                + ("" if not adapters.scanned else " on a layer axis 0 or 1 with the same layers")
            )
            continue
        lf = LoraFactor(LORA_ITEM, f.a, f.b, f.a_spec, f.b_spec, axis, scale, layouts[0])
        moves[m.dst] = dataclasses.replace(m, op=MERGE_LORA, args=MergeArgs((lf,), axis))
    if problems:
        raise LayoutMismatchError(
            f"the LoRA adapters do not fit the base {base_dir} ({len(problems)} modules):",
            problems,
            hint="Pass the base the LoRA run started from (its load_parameters_path), of the "
            "same model config and scan form.",
        )
    used = {a for a in axes.values() if a not in ("bad", None)}
    return moves, (used.pop() if used else None)


def _layouts(kernel: LeafSpec, f: Any, axis: int | None) -> list[tuple[int, ...]]:
    """`lora.delta_layouts` of one layer of an adapted weight."""
    return delta_layouts(
        per_layer_shape(kernel.shape, axis),
        per_layer_shape(f.a_spec.shape, axis),
        per_layer_shape(f.b_spec.shape, axis),
    )


def _axes(
    found: Iterable[tuple[Move, Any]],
    adapters: LoraAdapters,
    base_target: Target,
    scan_axis: int | None,
) -> dict[Path, Any]:
    """The layer axis of each adapted weight (None: unscanned), or "bad" if the factors
    fit it on no axis. One axis serves every weight (MaxText's ``param_scan_axis``)."""
    found = list(found)
    if not adapters.scanned:
        return {
            m.dst: None if delta_layouts(m.spec.shape, f.a_spec.shape, f.b_spec.shape) else "bad"
            for m, f in found
        }
    model_axes = {base_target.param_scan_axes.get(m.dst[2:]) for m, _ in found} - {None}
    fits: dict[Path, set[int]] = {}
    alone: dict[Path, Any] = {}  # weights the model holds outside its scans
    for m, f in found:
        w, a, b = m.spec.shape, f.a_spec.shape, f.b_spec.shape
        if model_axes and m.dst[2:] not in base_target.param_scan_axes:
            # a model that scans some layers and not others (gemma3's remainder after its
            # blocks): qwix's factors of an unscanned layer carry no layer axis
            alone[m.dst] = None if delta_layouts(w, a, b) else "bad"
            continue
        fits[m.dst] = {
            ax
            for ax in (0, 1)
            if ax < len(w)
            and w[ax] == a[ax] == b[ax]
            and delta_layouts(
                per_layer_shape(w, ax), per_layer_shape(a, ax), per_layer_shape(b, ax)
            )
        }
    if scan_axis is not None:
        choice = {scan_axis}
    elif len(model_axes) == 1:  # a model target knows its param_scan_axis
        choice = set(model_axes)
    else:
        choice = set.intersection(*fits.values()) if fits else set()
        if adapters.layer_axis is not None and adapters.layer_axis in choice:
            choice = {adapters.layer_axis}
    if len(choice) > 1:
        raise UsageError(
            "the shapes fit both layer axis 0 and 1 for every adapted weight; pass "
            "scan_axis= (CLI --scan-axis), the model's param_scan_axis."
        )
    axis = next(iter(choice), None)
    return {d: axis if axis in ok else "bad" for d, ok in fits.items()} | alone


def _with_axis(target: Target, axis: int | None) -> Target:
    if axis is None:
        return target
    return dataclasses.replace(target, param_scan_axes={p: axis for p in target.params})


def merge_sources(adapter_step: epath.PathLike, base: epath.PathLike) -> dict[str, epath.Path]:
    _, params_dir = adapter_item(adapter_step)
    _, item, item_dir = base_source(base)
    return {item: item_dir, LORA_ITEM: params_dir}


def _where(p: epath.PathLike) -> str:
    """A path as recorded: absolute on a disk, so a replay works from any directory."""
    return store_for(p).absolute(p)


def merge_provenance(
    plan: Plan,
    adapters: LoraAdapters,
    *,
    alpha: float,
    adapter_dir: epath.Path,
    base: epath.PathLike,
    scan: str | None,
    scan_axis: int | None,
    target: Target | None,
) -> dict[str, Any]:
    """What a merged step records: enough to say what it is and for `verify` to replay it."""
    axis = next((m.args.axis for m in plan.moves if m.op.factors(m)), None)  # a merge's
    return provenance_record(
        plan,
        SOURCE_LAYOUT,
        base=_where(base),
        adapter_step=_where(adapter_dir),
        alpha=alpha,
        rank=adapters.rank,
        scale=alpha / adapters.rank,
        modules=adapters.modules,
        scan_axis=axis if scan_axis is None else scan_axis,
        scan=scan,
        # A Tunix base needs the target (weights from RNG state); a MaxText base was split
        # without it (a target there only names the other scan form), so a replay needs none.
        base_target="given" if target is not None and _tunix_base(base) else None,
    )


def _tunix_base(base: epath.PathLike) -> bool:
    return base_source(base)[1] == TUNIX_PARAMS_ITEM


def replay_merge(
    step_dir: epath.Path, prov: Mapping[str, Any]
) -> tuple[Plan, dict[str, epath.Path]]:
    """The plan a merged step was written from, and its sources, from its provenance.

    A merge from a Tunix base needed a target the provenance cannot hold; the merged
    step's own params serve as that target.
    """
    target = None
    if prov.get("base_target"):
        target = Target.from_checkpoint(step_dir)
        if prov.get("scan") is not None:
            raise UsageError(f"{step_dir}: cannot replay a scan change of a Tunix base merge.")
    plan, _, _ = plan_merge(
        prov["adapter_step"],
        prov["base"],
        alpha=float(prov["alpha"]),
        target=target,
        scan=prov.get("scan"),
        scan_axis=prov.get("scan_axis"),
        unnamed="skip",
        plain_scan=True,  # a replay re-derives the form that was written
    )
    return plan, merge_sources(prov["adapter_step"], prov["base"])


REPLAYS[SOURCE_LAYOUT] = replay_merge  # `verify_step` replays a merge through its floor's table
