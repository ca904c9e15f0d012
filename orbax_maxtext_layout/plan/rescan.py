"""A scan change as a transformation of a `Plan`: ``convert --unroll`` / ``--stack``.

The step is planned against the model in the source's scan form (`forms`: MaxText's own
other form where the config is given, `maxtext_forms`); `unroll_plan` / `stack_plan` then
turn each move of a scanned layer into per-layer ``slice`` moves, or each family of
per-layer moves into one ``stack`` move, named as the model's `layermap.LayerMap` says and
on the layer axis the model gives it (`scan_axes`), never a rank rule. RNG state one
form has and the other lacks is dropped with a reason (unroll) or initialised fresh (stack).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from ..base.treepaths import Path, keystr
from ..errors import LayoutMismatchError, UsageError
from ..model import layermap as LM
from ..model import rules as R
from ..model.layer_axes import layer_map, scan_axes
from ..model.rng import is_rng
from ..model.scan_targets import stack_target, unroll_target
from ..model.target import AUX_ROOT, OPT_ROOT, PARAMS_ROOT, STEP_PATH, Dest, Target
from ..orbax_io.spec import LeafSpec
from . import ops
from .moves import Drop, Move, Plan

_UNSCANNED_RNG = "RNG state the unscanned target does not hold"
_SHARED_RNG = "the unscanned model shares one RNG stream across its layers"
GUESSED_SCAN = (
    "stacked as plain scans (layers_<i> -> layers) on the caller's word (--plain-scan): the "
    "target is unscanned and no scanned form was given"
)


def check_plain_stack(target: Target, *, plain_scan: bool, where: object) -> None:
    """Refuses a stack onto ``target`` when it is unscanned and no scanned form of the model
    is at hand (no `Target.twin`), unless ``plain_scan``: unscanned names cannot tell a plain
    scan (``layers_<i>`` -> ``layers``) from a block scan (gemma3's ``layers/layers_<k>``),
    and a block-scanned model stacked as a plain one is a layout MaxText cannot read."""
    if plain_scan or target.twin is not None or is_scanned(target):
        return
    raise UsageError(
        f"{where}: cannot tell the scanned form from an unscanned target: a plain scan (llama, "
        "qwen, mistral, mixtral: layers_<i> -> layers) and a block scan (gemma3, gpt-oss, "
        "llama4: layers/layers_<k>) have the same unscanned names, and a block-scanned model "
        "stacked as a plain one is a layout MaxText cannot read. Nothing was written. Give the "
        "model's scanned form: --maxtext-config CONFIG KEY=VALUE ... (either scan_layers), or "
        "--target-from a scanned MaxText step of the same model; or, if the model is a plain "
        "scan, say so with --plain-scan (plain_scan=True)."
    )


def named(target: Target) -> str:
    """`` (<what the target was built from>)`` for an error, where it is known."""
    return f" ({target.origin})" if target.origin else ""


def is_scanned(target: Target) -> bool:
    """Whether ``target`` holds scanned layers (`layer_map`)."""
    return bool(layer_map(target, lengths=False).scans)


def forms(
    target: Target, source: Iterable[Path] = (), axes: Mapping[str, int] | None = None
) -> tuple[Target, Target]:
    """``(scanned, unscanned)``: the model in both scan forms, ``target`` being either.

    The other form is MaxText's own where the target was built from its config
    (`Target.twin`). Otherwise a scanned target is unrolled (`unroll_target`), and an
    unscanned one stacked as the scanned ``source`` says (a scanned checkpoint's paths,
    `layermap.from_forms`: gemma3's block scans cannot be told from unscanned names), or as
    plain scans without one. ``axes`` (stacked model path -> layer axis, what a plan
    records) sets the Params' axes, for a replay.
    """
    if is_scanned(target):
        target = with_scan_axes(target, axes or {})
        return target, target.twin or unroll_target(target)
    if target.twin is not None:
        return target.twin, target
    source = list(source)
    layers = LM.from_forms(source, target.model_paths()) if _any_scan(source) else None
    target = with_scan_axes(target, axes or {}, layers)
    return stack_target(target, layers=layers), target


def written_form(target: Target | None, scan: str) -> Target | None:
    """MaxText's own model in the form a scan change writes (``"unroll"``: unscanned,
    ``"stack"``: scanned), where ``target`` was built from its config with both forms
    (`maxtext_forms`), whichever form it names; None without that twin (the other form is
    then derived). `convert` and `merge-lora` both take the written form from here."""
    if target is None or target.twin is None:
        return None
    scanned, unscanned = forms(target)
    return unscanned if scan == "unroll" else scanned


def maxtext_forms(argv: Sequence[str]) -> Target:
    """`Target.from_maxtext_config` of ``argv``, with MaxText's own model in the other scan
    form as its `Target.twin` (``scan_layers`` flipped), checked against it layer by layer
    (`layermap.check`): what ``convert --unroll``/``--stack`` with ``--maxtext-config``
    converts between, whichever form ``argv`` names."""
    target = Target.from_maxtext_config(argv)
    flip = "false" if is_scanned(target) else "true"
    other = [a for a in argv if a.split("=", 1)[0] != "scan_layers"] + [f"scan_layers={flip}"]
    twin = Target.from_maxtext_config(other)
    scanned, unscanned = (target, twin) if flip == "false" else (twin, target)
    if not is_scanned(scanned) or is_scanned(unscanned):
        raise LayoutMismatchError(
            "MaxText builds this model in one scan form only (scan_layers=true and false give "
            "the same layers): there is no other form to convert to."
        )
    shapes = {p: tuple(s.shape) for p, s in scanned.params.items()}
    axes = {p: scan_axes(scanned)[PARAMS_ROOT + p] for p in scanned.params}
    LM.check(
        layer_map(scanned),
        shapes,
        {p: tuple(s.shape) for p, s in unscanned.params.items()},
        {p: a for p, a in axes.items() if a is not None},
    )
    return dataclasses.replace(target, twin=twin)


def _any_scan(paths: list[Path]) -> bool:
    return any(LM.group_at(p) is not None for p in paths)


def source_model_paths(paths: Iterable[Path], target: Target) -> dict[Path, Path]:
    """A Tunix item's paths as model paths (``{model path: stored path}``): ``value`` levels
    and an adapter ``base`` level (where the target has no top-level ``base``) stripped."""
    cur, _ = R.apply(R.unwrap_value, {p: p for p in paths})
    tops = {p[0] for p in target.model_paths() if p}
    if R.ADAPTER_KEY not in tops and cur and all(p[:1] == (R.ADAPTER_KEY,) for p in cur):
        cur, _ = R.apply(R.drop_adapter, cur)
    return cur


def stored_layers(specs: Mapping[Path, LeafSpec], param_scan_axis: int = 1) -> LM.LayerMap:
    """The layer map of a stored tree without its model (``inspect``): a Tunix
    ``model_params`` or MaxText ``items``, its RNG state on axis 0 and every other leaf on
    ``param_scan_axis``, as MaxText stacks them; the scans without their lengths where the
    shapes disagree on them (a custom Variable stacked on axis 0)."""
    if any(p[:2] in (PARAMS_ROOT, AUX_ROOT) for p in specs):
        model = {p[2:]: s for p, s in specs.items() if p[:2] in (PARAMS_ROOT, AUX_ROOT)}
    else:
        model = {q: specs[p] for q, p in source_model_paths(specs, Target({}, {})).items()}
    weights = {p: s for p, s in model.items() if not is_rng(p)}
    target = Target(weights, {p: s for p, s in model.items() if is_rng(p)})
    try:
        return layer_map(target, param_scan_axis=param_scan_axis)
    except LayoutMismatchError:
        return layer_map(target, param_scan_axis=param_scan_axis, lengths=False)


def with_scan_axes(
    target: Target, axes: Mapping[str, int], layers: LM.LayerMap | None = None
) -> Target:
    """``target`` with each Param's layer axis taken from ``axes`` (stacked model path -> axis).

    A replay (`verify`) has only the written items; this restores the axes the
    conversion took from the model, which the plan records. An unscanned target's
    paths are matched through ``layers`` (else by the ``layers_<i>`` -> ``layers`` rule).
    """
    if not axes:
        return target
    out = dict(target.param_scan_axes)
    for p in target.params:
        stacked = _stacked_path(p, layers)
        if keystr(stacked) in axes:
            out[p] = int(axes[keystr(stacked)])
    return dataclasses.replace(target, param_scan_axes=out)


def _stacked_path(p: Path, layers: LM.LayerMap | None) -> Path:
    if layers is None:
        return tuple(hit[0] if (hit := LM.layer_of(k)) else k for k in p)
    u = layers.find_unrolled(p)
    if u is None:
        return p
    pos, la = u
    return _splice(p, pos, la.unrolled, la.stacked)


def _full_paths(t: Target) -> set[Path]:
    out = {PARAMS_ROOT + p for p in t.params} | {AUX_ROOT + p for p in t.nnx_aux}
    return out | {OPT_ROOT + p for p in (t.opt_state or {})}


def _recorded_axes(axes: Mapping[Path, int | None]) -> tuple[tuple[str, int], ...]:
    return tuple(
        sorted(
            (keystr(p[2:]), a) for p, a in axes.items() if p[:2] == PARAMS_ROOT and a is not None
        )
    )


def layer_axis(axes: Mapping[Path, int | None], dst: Path) -> int | None:
    """The layer axis of the stacked leaf ``dst`` (`scan_axes`). An optimizer moment the
    target does not name (a target without an optimizer: `Target.without_optimizer`, an NNX
    model alone) takes the axis of the Param its path ends in, as `scan_axes` gives a
    moment the target names: a moment mirrors its Param (``mu/params/<model path>``)."""
    if dst in axes or dst[:1] != OPT_ROOT:
        return axes.get(dst)
    return next(
        (axes[PARAMS_ROOT + dst[k:]] for k in range(1, len(dst)) if PARAMS_ROOT + dst[k:] in axes),
        None,
    )


def _splice(path: Path, pos: int, old: Path, new: Path) -> Path:
    return (*path[:pos], *new, *path[pos + len(old) :])


def unroll_plan(plan: Plan, stacked: Target, out: Target) -> Plan:
    """Per-layer ``slice`` moves for a plan made against the scanned ``stacked`` target.

    ``plan`` was made with ``unnamed="skip"``: model leaves the scanned target
    lacks must be RNG state (anything else is a wrong model and is refused). Each layer
    is named as the model's `layermap.LayerMap` says; RNG state the unscanned target
    does not hold is dropped with a reason.
    """
    bad = [
        d
        for d in plan.drops
        if d.reason == "not requested by the target"
        and not is_rng(tuple(k for k in d.src if k != "value"))
    ]
    if bad:
        raise LayoutMismatchError(
            f"model_params does not match the target model{named(out)}:",
            [f"{keystr(d.src)}: not in the target model ({d.spec})" for d in bad],
        )
    drops = [
        dataclasses.replace(d, reason=_UNSCANNED_RNG)
        if d.reason == "not requested by the target"
        else d
        for d in plan.drops
    ]
    # What the output must hold: the model, and the optimizer if one is converted.
    converts_opt = any(m.dest is Dest.OPT_STATE for m in plan.moves)
    want = {p for p in _full_paths(out) if converts_opt or p[:1] != OPT_ROOT}
    run = _Unroll(layer_map(stacked), scan_axes(stacked), want, out.opt_state is None)
    for m in plan.moves:
        run.move(m)
    moves, problems, axes = run.moves, run.problems, run.axes
    drops += run.drops
    missing = want - {m.dst for m in moves} - {STEP_PATH}
    problems += [
        f"{keystr(p)}: expected by the target, not produced" for p in sorted(missing, key=keystr)
    ]
    if problems:
        raise LayoutMismatchError(
            f"The unrolled step does not match the target{named(out)}:", problems
        )
    return dataclasses.replace(
        plan,
        moves=tuple(moves),
        drops=tuple(drops),
        rules=(*plan.rules, "unroll"),
        scan="unroll",
        scan_axes=_recorded_axes(axes),
    )


@dataclasses.dataclass
class _Unroll:
    """`unroll_plan`'s moves, one source move at a time."""

    layers: LM.LayerMap
    axes: Mapping[Path, int | None]
    want: set[Path]
    any_opt: bool  # the output takes the optimizer in whatever form the plan writes it
    moves: list[Move] = dataclasses.field(default_factory=list)
    drops: list[Drop] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)

    def wanted(self, dst: Path) -> bool:
        return dst in self.want or (dst[:1] == OPT_ROOT and self.any_opt)

    def move(self, m: Move) -> None:
        hit = self.layers.find_stacked(m.dst)
        if hit is None:
            if m.dst[:2] == AUX_ROOT and is_rng(m.dst) and m.dst not in self.want:
                self.drops.append(Drop(m.item, m.src, m.spec, _UNSCANNED_RNG))
            else:
                self.moves.append(m)
            return
        pos, prefix = hit
        family = self.layers.of_stacked(prefix)
        if family[0].index is None:  # a remainder layer: renamed only
            self.one(m, _splice(m.dst, pos, prefix, family[0].unrolled), m)
            return
        a = layer_axis(self.axes, m.dst)
        assert m.op.unrolled is not None and a is not None, m
        for la in family:
            dst = _splice(m.dst, pos, prefix, la.unrolled)
            # a copy slices; a merge merges layer i only (`Op.unroll`)
            sliced = m.op.unroll(m, dst=dst, axis=a, index=la.index)
            if self.wanted(dst) or not (m.dst[:2] == AUX_ROOT and is_rng(m.dst)):
                self.one(m, dst, sliced)
                continue
            # Held at another layer (layers_0) only: one stream shared by every layer.
            shared = any(_splice(m.dst, pos, prefix, o.unrolled) in self.want for o in family)
            layer = dataclasses.replace(m.spec, shape=m.spec.shape[:a] + m.spec.shape[a + 1 :])
            why = _SHARED_RNG if shared else _UNSCANNED_RNG
            # Named by its scan step and by the layer it is unscanned (a block's step i holds
            # several layers: gemma3's step 1 of sub-layer 0 is layers_6).
            step = f"[scan step {la.index}: {la.unrolled[-1]}]"
            self.drops.append(Drop(m.item, (*m.src, step), layer, why))

    def one(self, m: Move, dst: Path, written: Move) -> None:
        if self.wanted(dst):
            self.moves.append(dataclasses.replace(written, dst=dst))
        elif m.dst[:2] == AUX_ROOT and is_rng(m.dst):
            self.drops.append(Drop(m.item, m.src, m.spec, _UNSCANNED_RNG))
        else:
            self.problems.append(f"{keystr(dst)}: not in the unscanned target")


def fresh_note(path: Path) -> str:
    """The report's note for a model leaf of the unscanned form (``decoder/layers_6/rngs/...``)
    or outside every layer (``decoder/rngs/...``) that a stack initialises fresh."""
    return f"{keystr(path)}: not in the checkpoint (allowed; initialised fresh)"


def _fresh_notes(layers: LM.LayerMap, dst: Path, indices: Iterable[int] | None) -> list[str]:
    """`fresh_note` of each unscanned leaf a fresh stacked leaf ``dst`` stands for: the layers
    ``indices`` of its scan (every layer when None), or ``dst`` itself outside every scan."""
    hit = layers.find_stacked(dst)
    family = layers.of_stacked(hit[1]) if hit else ()
    if not hit or family[0].index is None:
        return [fresh_note(dst[len(AUX_ROOT) :])]
    pos, prefix = hit
    wanted = None if indices is None else set(indices)
    return [
        fresh_note(_splice(dst, pos, prefix, la.unrolled)[len(AUX_ROOT) :])
        for la in family
        if wanted is None or la.index in wanted
    ]


def _never_had(
    out: Target, axes: Mapping[Path, int | None], layers: LM.LayerMap, produced: set[Path]
) -> tuple[list[Move], list[str]]:
    """A ``fresh`` move and its notes (`fresh_note`) for each RNG leaf of ``out`` the
    unscanned step never had (no move ``produced`` it)."""
    moves: list[Move] = []
    notes: list[str] = []
    for p, spec in out.nnx_aux.items():
        if AUX_ROOT + p not in produced and is_rng(p):
            notes += _fresh_notes(layers, AUX_ROOT + p, None)
            note = "initialised fresh (not in the unscanned checkpoint)"
            a = axes.get(AUX_ROOT + p)
            # In a block, each layer is derived as a missing layer of a stack is (and as
            # `scan_trees.stack` derives it), unless the target holds one value for all layers.
            a = a if a is not None and len(spec.shape) - bool(spec.key_impl) > a else None
            args = ops.FreshArgs(axis=a)
            fresh = Move(
                "", (), AUX_ROOT + p, Dest.NNX_AUX, spec, note=note, op=ops.FRESH, args=args
            )
            moves.append(fresh)
    return moves, notes


def stack_plan(plan: Plan, unrolled: Target, out: Target) -> Plan:
    """One ``stack`` move per family of per-layer moves of a plan made against ``unrolled``.

    Every RNG leaf or layer initialised fresh is in the plan's notes (`fresh_note`), once,
    whether ``unrolled`` held it (the plan noted it missing) or not (MaxText's own unscanned
    model keeps a shared stream at layer 0 only)."""
    axes = scan_axes(out)
    layers = layer_map(out)
    families: dict[Path, dict[int, Move]] = defaultdict(dict)
    lengths: dict[Path, int] = {}
    moves: list[Move] = []
    for m in plan.moves:
        u = layers.find_unrolled(m.dst)
        if u is None:
            moves.append(m)
            continue
        pos, la = u
        dst = _splice(m.dst, pos, la.unrolled, la.stacked)
        if la.index is None or la.scan is None:  # a remainder layer: renamed only
            moves.append(dataclasses.replace(m, dst=dst))
            continue
        families[dst][la.index] = m
        lengths[dst] = la.scan.length
    produced = set(families) | {m.dst for m in moves}
    fresh_moves, fresh_notes = _never_had(out, axes, layers, produced)
    moves += fresh_moves
    problems = []
    for dst, got in families.items():
        a, n = layer_axis(axes, dst), lengths[dst]
        gaps = [i for i in range(n) if i not in got]
        if a is None or (gaps and not (dst[:2] == AUX_ROOT and is_rng(dst))):
            problems.append(f"{keystr(dst)}: layers {sorted(got)} do not stack (axis {a})")
            continue
        note = f"layers {gaps} initialised fresh" if gaps else ""
        fresh_notes += _fresh_notes(layers, dst, gaps) if gaps else []
        stacked = got[min(got)].op.stack_layers(got, n, dst=dst, axis=a, note=note)
        if isinstance(stacked, str):  # why they do not stack
            problems.append(stacked)
            continue
        moves.append(stacked)
    if problems:
        raise LayoutMismatchError(f"The step does not stack onto the target{named(out)}:", problems)
    notes = (*plan.notes, *dict.fromkeys(n for n in fresh_notes if n not in plan.notes))
    return dataclasses.replace(
        plan,
        moves=tuple(moves),
        notes=notes,
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
