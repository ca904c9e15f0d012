"""Planning: metadata plus a `Target` in, a `Plan` (one `Move` per written leaf) out.

`make_plan` is pure: it takes the specs of the two Tunix items and a `Target`
and returns a `Plan` (or raises `LayoutMismatchError` naming every offending
path). `plan_step` reads the specs of a step directory (metadata only) and, for a
scan change, transforms the plan (`rescan`). `narrow` keeps what a restore asks
for. The plan is the dry-run report, and the same object drives the writer, the
restore, and `verify`, so the layout is computed exactly once.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Literal

import numpy as np
from etils import epath

from ..base.treepaths import FlatTree, Path, keystr
from ..errors import LayoutMismatchError, UsageError, detached
from ..model import lora
from ..model import rules as R
from ..model.layermap import scanned_form
from ..model.rng import is_rng
from ..model.target import AUX_ROOT, OPT_ROOT, PARAMS_ROOT, STEP_PATH, Dest, Target
from ..orbax_io.layout import (
    MAXTEXT_ITEM,
    TUNIX_OPT_ITEM,
    TUNIX_PARAMS_ITEM,
    tunix_items,
    tunix_step_number,
)
from ..orbax_io.ocdbt import check_contained
from ..orbax_io.spec import LeafSpec, read_specs
from . import ops, rescan
from .moves import Drop, Move, Op, Plan

__all__ = [
    "Drop",
    "Move",
    "Op",
    "OptimizerMode",
    "Plan",
    "make_plan",
    "narrow",
    "plan_maxtext_step",
    "plan_step",
]

OptimizerMode = Literal["convert", "drop"]
ScanChange = Literal["unroll", "stack"]
DIRECTORY_STEP = "directory name"
_DROP_HINT = (
    "Pass optimizer='drop' (CLI: --optimizer drop) to convert params, nnx_aux and step only."
)


def make_plan(
    params: Mapping[Path, LeafSpec],
    optimizer: Mapping[Path, LeafSpec] | None,
    target: Target,
    *,
    optimizer_mode: OptimizerMode = "convert",
    step: int | None = None,
    ignore: Iterable[str] = (),
    unnamed: Literal["error", "skip"] = "error",
    allow_missing: Callable[[Path], bool] | None = None,
    where: str = TUNIX_PARAMS_ITEM,
) -> Plan:
    """Maps every leaf of ``model_params`` (+ ``optimizer_state``) onto the target.

    Args:
      params: ``{path: spec}`` of the Tunix ``model_params`` item.
      optimizer: the same for ``optimizer_state``, or None when the step has none.
      target: what to split against.
      optimizer_mode: "convert" matches the optimizer to the target; "drop" leaves it out.
      step: the directory's step number, used when there is no optimizer ``step``.
      ignore: extra glob patterns of model leaves to drop as intermediates.
      unnamed: "error" refuses model leaves the target does not know (a conversion
        must place every leaf); "skip" leaves them unread, reported as dropped (a
        partial restore, e.g. params only, says nothing about the other leaves).
      allow_missing: target model leaves for which it returns True may be absent
        from the checkpoint (e.g. per-layer copies of a shared RNG stream when
        stacking); each is listed in the plan's notes.
      where: the step (or item) planned, for error messages.

    Raises:
      LoraAdapterStepError: ``params`` holds only LoRA adapters and the target has no
        place for them (whatever ``unnamed`` says: nothing of such a step would be kept).
      LayoutMismatchError: the checkpoint does not fit the target (every path named).
    """
    draft = _Draft()
    adapter = _plan_model(
        draft,
        params,
        target,
        ignore=ignore,
        unnamed=unnamed,
        allow_missing=allow_missing,
        where=where,
    )
    step_source = DIRECTORY_STEP
    if optimizer is not None:
        opt, step_source = _plan_step_source(draft, optimizer, target)
        _plan_opt_state(draft, opt, optimizer, target, adapter=adapter, mode=optimizer_mode)
    if step_source == DIRECTORY_STEP:
        _plan_directory_step(draft, step, target, has_optimizer=optimizer is not None)
    return draft.plan(step, step_source)


@dataclasses.dataclass
class _Draft:
    """The parts of a `Plan` as `make_plan`'s steps add them, in order."""

    moves: list[Move] = dataclasses.field(default_factory=list)
    drops: list[Drop] = dataclasses.field(default_factory=list)
    rules: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def plan(self, step: int | None, step_source: str) -> Plan:
        return Plan(
            tuple(self.moves),
            tuple(self.drops),
            tuple(self.rules),
            step,
            step_source,
            tuple(self.notes),
        )


# -- model_params -> params / nnx_aux --------------------------------------------------
def _model_tree(
    draft: _Draft, params: Mapping[Path, LeafSpec], target: Target, where: str
) -> tuple[dict[Path, Path], bool]:
    """``{model path: source path}`` of ``model_params`` (value levels and an adapter
    ``base`` stripped), and whether there was an adapter level."""
    cur, _ = R.apply(R.unwrap_value, {p: p for p in params})
    draft.rules.append(R.unwrap_value.name)
    adapter = has_adapter(cur, target)
    if adapter:
        cur, _ = R.apply(R.drop_adapter, cur)
        draft.rules.append(R.drop_adapter.name)
    lora.refuse_unplaced(cur, params, target.model_paths(), where)
    return cur, adapter


def _plan_model(
    draft: _Draft,
    params: Mapping[Path, LeafSpec],
    target: Target,
    *,
    ignore: Iterable[str],
    unnamed: Literal["error", "skip"],
    allow_missing: Callable[[Path], bool] | None,
    where: str,
) -> bool:
    """Moves every ``model_params`` leaf to params or nnx_aux (or drops it); returns
    whether the item had an adapter ``base`` level (its moments have one too)."""
    cur, adapter = _model_tree(draft, params, target, where)
    problems: list[str] = []
    for path, src in sorted(cur.items(), key=lambda kv: keystr(kv[0])):
        spec = params[src]
        dest = target.classify(path, ignore)
        if dest is None and unnamed == "skip":
            draft.drops.append(Drop(TUNIX_PARAMS_ITEM, src, spec, "not requested by the target"))
        elif dest is None:
            problems.append(f"{keystr(src)}: not in the target model ({spec})")
        elif dest is Dest.DROPPED:
            reason = "sown nnx.Intermediate (not state)"
            draft.drops.append(Drop(TUNIX_PARAMS_ITEM, src, spec, reason))
        else:
            want = (target.params if dest is Dest.PARAMS else target.nnx_aux)[path]
            if not spec.same_layout(want):
                problems.append(f"{keystr(src)}: checkpoint has {spec}, target expects {want}")
            root = PARAMS_ROOT if dest is Dest.PARAMS else AUX_ROOT
            draft.moves.append(Move(TUNIX_PARAMS_ITEM, src, root + path, dest, spec))
    for path in sorted(target.model_paths() - set(cur), key=keystr):
        want = target.params.get(path) or target.nnx_aux.get(path)
        if allow_missing is not None and allow_missing(path):
            draft.notes.append(rescan.fresh_note(path))
            continue
        problems.append(f"{keystr(path)}: expected by the target ({want}), missing in checkpoint")
    if problems:
        raise LayoutMismatchError(
            f"model_params does not match the target model{rescan.named(target)} "
            f"({len(problems)} offending paths):",
            problems,
            hint=_model_hint(cur, target),
        )
    return adapter


# -- optimizer_state -> step / opt_state ----------------------------------------------
def _plan_step_source(
    draft: _Draft, optimizer: Mapping[Path, LeafSpec], target: Target
) -> tuple[dict[Path, Path], str]:
    """Moves the optimizer's ``step`` (if any) and drops what is not ``opt_state``; returns
    ``{opt_state path: source path}`` and where ``step`` comes from."""
    ocur, _ = R.apply(R.unwrap_value, {p: p for p in optimizer})
    step_source = DIRECTORY_STEP
    step_src = ocur.pop(STEP_PATH, None)
    if step_src is not None:
        spec, want = optimizer[step_src], _step_dtype(target)
        cast = ops.CastArgs(want)  # uint32 -> int32
        draft.moves.append(
            Move(TUNIX_OPT_ITEM, step_src, STEP_PATH, Dest.STEP, spec, op=ops.CAST, args=cast)
        )
        step_source = f"{TUNIX_OPT_ITEM}/{keystr(step_src)}"
    opt = {p[1:]: src for p, src in ocur.items() if p[:1] == OPT_ROOT}
    for p, src in ocur.items():
        if p[:1] != OPT_ROOT:
            draft.drops.append(Drop(TUNIX_OPT_ITEM, src, optimizer[src], "not part of opt_state"))
    return opt, step_source


def _plan_opt_state(
    draft: _Draft,
    opt: dict[Path, Path],
    specs: Mapping[Path, LeafSpec],
    target: Target,
    *,
    adapter: bool,
    mode: OptimizerMode,
) -> None:
    """Matches ``opt_state`` to the target's (`_plan_optimizer`), or drops it."""
    if mode == "drop":
        draft.drops += [Drop(TUNIX_OPT_ITEM, s, specs[s], "optimizer='drop'") for s in opt.values()]
        draft.rules.append("drop_optimizer")
        return
    moves, drops, rules = _plan_optimizer(opt, specs, target, adapter)
    draft.moves += moves
    draft.drops += drops
    draft.rules += rules


def _plan_directory_step(
    draft: _Draft, step: int | None, target: Target, *, has_optimizer: bool
) -> None:
    """``step`` as a constant from the step directory's number (no optimizer ``step``)."""
    if step is None:
        raise LayoutMismatchError(
            "No optimizer step in the checkpoint and no step number given.",
            hint="Pass step=<n> (the step directory's number).",
        )
    draft.notes.append(f"step {step} taken from the step directory (no optimizer_state/step)")
    draft.moves.append(_step_constant(step, target))
    if target.opt_state is not None and not has_optimizer:
        draft.notes.append("the step has no optimizer_state: no opt_state is written")


def _step_dtype(target: Target) -> np.dtype:
    return np.dtype(target.abstract.get(STEP_PATH, np.zeros((), np.int32)).dtype)


def _step_constant(step: int, target: Target) -> Move:
    spec = LeafSpec((), _step_dtype(target))
    note = "from the step directory's number"
    args = ops.ConstantArgs(step)
    return Move("", (), STEP_PATH, Dest.STEP, spec, note=note, op=ops.CONSTANT, args=args)


def has_adapter(cur: Mapping[Path, Path], target: Target) -> bool:
    # Strip a top-level "base" only if that makes the checkpoint fit the target
    # better: a model may have a real module called "base".
    want = target.model_paths()
    stripped = sum(1 for p in cur if p[:1] == (R.ADAPTER_KEY,) and p[1:] in want)
    kept = sum(1 for p in cur if p in want)
    return stripped > kept


def _model_hint(cur: Mapping[Path, Path], target: Target) -> str:
    if not target.model_paths():
        return (
            "The target names no model leaves at all (e.g. a MaxText checkpoint saved with "
            "lora.* keys, which keeps only 'step'): build it from the model, or from a "
            "checkpoint that holds the model's weights."
        )
    src, tgt = _scan_form(cur), _scan_form(target.model_paths())
    if src and tgt and src != tgt:
        return (
            f"The scan form differs (the checkpoint's layers are {src}, the target's {tgt}): "
            f"to write the target's form, convert with {'--stack' if src != 'stacked' else '--unroll'}"
            " (rescan=...; the target may name the model in either form); else build the "
            "target with the same scan_layers setting as the checkpoint."
        )
    return (
        "Build the target from the same model config the checkpoint was trained with "
        "(model name and sizes), or add ignore patterns for leaves to drop on purpose."
    )


def _scan_form(paths: Iterable[Path]) -> str | None:
    """'stacked' (a scan group, e.g. 'layers'), 'unrolled' ('layers_<i>'), or None."""
    form = scanned_form(paths)
    return None if form is None else "stacked" if form else "unrolled (layers_<i>)"


# -- optimizer matching -----------------------------------------------------------------
def _pipelines(select: int | None) -> list[list[R.Rule]]:
    """Candidate rule pipelines, fewest rules first."""
    out = []
    for peel_ms, peel_inj, chain, wrap in itertools.product([0, 1], [0, 1], [0, 1, 2], [0, 1]):
        rules: list[R.Rule] = []
        if peel_ms:
            rules.append(R.peel_multisteps)
        if peel_inj:
            rules.append(R.peel_inject)
        if select is not None:
            rules.append(R.select_chain_member(select))
        if chain:
            rules.append(R.top_chain_to_list if chain == 1 else R.chain_to_list)
        if wrap:
            rules.append(R.wrap_moments)
        out.append(rules)
    return sorted(out, key=len)


def _run(
    rules: list[R.Rule], cur: dict[Path, Path], memo: dict | None = None
) -> tuple[dict[Path, Path], dict[Path, str]]:
    """Applies ``rules`` in order. ``memo`` keeps what each sequence of rules gave (or
    raised), so candidate pipelines that share a prefix apply it once."""
    dropped: dict[Path, str] = {}
    for i, rule in enumerate(rules):
        key = tuple(r.name for r in rules[: i + 1])
        if memo is None or key not in memo:
            try:
                done = R.apply(rule, cur)
            except ValueError as e:
                if memo is None:
                    raise
                done = detached(e)  # memoised: no frame of this call behind it
            if memo is not None:
                memo[key] = done
        else:
            done = memo[key]
        if isinstance(done, ValueError):
            raise done
        cur, d = done
        dropped.update(d)
    return cur, dropped


def _plan_optimizer(
    opt: dict[Path, Path],
    specs: Mapping[Path, LeafSpec],
    target: Target,
    adapter: bool,
) -> tuple[list[Move], list[Drop], list[str]]:
    base: list[R.Rule] = [R.drop_adapter_in_moments] if adapter else []
    cur, _ = _run(base, opt)
    prefix = [r.name for r in base]

    def finish(rules, mapping, dropped, synth=()):
        moves = [
            Move(TUNIX_OPT_ITEM, s, OPT_ROOT + p, Dest.OPT_STATE, specs[s])
            for p, s in mapping.items()
        ]
        moves += [
            Move(
                TUNIX_OPT_ITEM,
                s,
                OPT_ROOT + p,
                Dest.OPT_STATE,
                specs[s],
                note=f"synthesized from {keystr(s)}",
            )
            for p, s in synth
        ]
        drops = [Drop(TUNIX_OPT_ITEM, s, specs[s], r) for s, r in dropped.items()]
        names = prefix + [r.name for r in rules] + (["synthesize_schedule_count"] if synth else [])
        return moves, drops, names

    if target.opt_state is None:  # canonical MaxText form
        rules = [R.peel_multisteps, R.peel_inject, R.chain_to_list, R.wrap_moments]
        mapping, dropped = _run(rules, cur)
        return finish(rules, mapping, dropped)

    want = target.opt_state
    best: tuple[int, Mapping[Path, Path]] | None = None
    memo: dict = {}
    for select in (None, 1):
        for rules in _pipelines(select):
            try:
                mapping, dropped = _run(rules, cur, memo)
            except ValueError:
                continue
            n = _mismatches(mapping, specs, want)
            synth = _synthesize_counts(mapping, specs, want) if n else []
            full = dict(mapping) | dict(synth) if synth else mapping
            if synth:
                n = _mismatches(full, specs, want)
            if not n:
                return finish(rules, mapping, dropped, synth)
            if best is None or n < best[0]:
                best = (n, full)
    src_top = sorted({str(p[0]) for p in cur if p})
    tgt_top = sorted({str(p[0]) for p in want if p})
    raise LayoutMismatchError(
        "optimizer_state matches the target's opt_state under no known conversion "
        f"(checkpoint opt_state/{src_top}, target opt_state/{tgt_top}); "
        f"the closest candidate differs at {best[0] if best else 0} paths:",
        _diff(best[1], specs, want) if best else [],
        hint=_DROP_HINT,
    )


def _mismatches(
    mapping: Mapping[Path, Path], specs: Mapping[Path, LeafSpec], want: Mapping[Path, LeafSpec]
) -> int:
    """``len(_diff(...))``, without writing the messages (most candidates do not match)."""
    n = len(mapping.keys() ^ want.keys())
    return n + sum(
        1 for p in mapping.keys() & want.keys() if not specs[mapping[p]].same_layout(want[p])
    )


def _diff(
    mapping: Mapping[Path, Path], specs: Mapping[Path, LeafSpec], want: Mapping[Path, LeafSpec]
) -> list[str]:
    problems = []
    for p in sorted(set(mapping) | set(want), key=keystr):
        if p not in want:
            problems.append(
                f"opt_state/{keystr(p)}: from checkpoint {keystr(mapping[p])}, not in the target"
            )
        elif p not in mapping:
            problems.append(f"opt_state/{keystr(p)}: expected by the target ({want[p]}), missing")
        elif not specs[mapping[p]].same_layout(want[p]):
            problems.append(
                f"opt_state/{keystr(p)}: checkpoint has {specs[mapping[p]]}, target expects {want[p]}"
            )
    return problems


def _synthesize_counts(
    mapping: Mapping[Path, Path], specs: Mapping[Path, LeafSpec], want: Mapping[Path, LeafSpec]
) -> list[tuple[Path, Path]]:
    """A schedule ``count`` the target has and the checkpoint lacks, copied from the one count.

    Every optax step counter advances once per update, so a missing
    ``scale_by_schedule`` count equals the Adam count; done only when exactly one
    count of that dtype exists, so the choice is unambiguous.
    """
    missing = [p for p in want if p not in mapping]
    if not missing or not all(p[-1] == "count" for p in missing):
        return []
    counts = [p for p in mapping if p[-1] == "count"]
    if len(counts) != 1:
        return []
    src = mapping[counts[0]]
    if not all(specs[src].same_layout(want[p]) for p in missing):
        return []
    return [(p, src) for p in missing]


# -- a step directory ----------------------------------------------------------------------
def plan_step(
    step_dir: epath.PathLike,
    target: Target,
    *,
    optimizer: OptimizerMode = "convert",
    ignore: Iterable[str] = (),
    unnamed: Literal["error", "skip"] = "error",
    read_optimizer: bool = True,
    scan: ScanChange | None = None,
    specs: MutableMapping[str, FlatTree] | None = None,
    scan_axes: Mapping[str, int] | None = None,
    plain_scan: bool = False,
) -> Plan:
    """Plans the conversion of one Tunix-layout step from Orbax metadata alone.

    ``scan="unroll"``/``"stack"`` writes the other scan form: ``target`` is the model
    in either form (MaxText's own other form comes with a target built from its config;
    otherwise it is derived, `rescan.forms`, with the step's own scanned layers for an
    unroll); the step is planned against the source's form and the plan is then
    transformed (`rescan`), each leaf re-sliced on the layer axis the model gives it.
    ``scan_axes`` (recorded by a plan, stacked model path -> axis) sets the Params' layer
    axes, for a replay. A stack onto an unscanned target with no scanned form at hand is
    refused (`rescan.check_plain_stack`) unless ``plain_scan`` says the model is a plain
    scan. ``read_optimizer=False`` never opens
    ``optimizer_state`` (a params-only restore); ``step`` then comes from the step
    number, or 0 if the directory has none. ``specs`` (item name -> `read_specs` of it)
    is a cache the caller keeps for one operation: items found there are not read again,
    items read here are added, so plans made twice read each item's metadata once.
    """
    step_dir = epath.Path(step_dir)
    items = tunix_items(step_dir)
    for item_dir in items.values():  # before a plan lets anything move (B-tree nodes only)
        check_contained(item_dir)
    specs = {} if specs is None else specs
    for name in (TUNIX_PARAMS_ITEM, TUNIX_OPT_ITEM):
        if name not in specs and name in items and (read_optimizer or name == TUNIX_PARAMS_ITEM):
            specs[name] = read_specs(items[name])
    params = specs[TUNIX_PARAMS_ITEM]
    read_opt = read_optimizer and TUNIX_OPT_ITEM in items
    opt = specs[TUNIX_OPT_ITEM] if read_opt else None
    step = tunix_step_number(step_dir)
    if step is None and not read_optimizer:
        step = 0

    def plan_against(t: Target, **kw) -> Plan:
        return make_plan(
            params,
            opt,
            t,
            optimizer_mode=optimizer,
            step=step,
            ignore=ignore,
            where=str(step_dir),
            **kw,
        )

    if scan is None:
        return plan_against(target, unnamed=unnamed)

    def against(form: Target, change: ScanChange) -> Plan:
        # A scanned model holds RNG state its unscanned twin lacks (decoder/rngs, the
        # per-layer copies of shared streams): an unroll skips it here (refusing anything
        # else); unscanned models store a shared RNG stream once, so a stack initialises
        # the other layers' copies fresh, and the plan's notes say which.
        if change == "unroll":
            return plan_against(form, unnamed="skip")
        return plan_against(form, unnamed=unnamed, allow_missing=is_rng)

    source = rescan.source_model_paths(params, target) if scan == "unroll" else {}
    change = _ScanChange(scan, target, scan_axes, plain_scan, step_dir)
    return change.plan(against, source)


@dataclasses.dataclass(frozen=True)
class _ScanChange:
    """A scan change of a step, whatever its layout (`plan_step`, `plan_maxtext_step`): the
    step planned against the model in its own form, then transformed (`rescan`)."""

    scan: ScanChange
    target: Target
    scan_axes: Mapping[str, int] | None
    plain_scan: bool
    where: object

    def plan(self, against: Callable[[Target, ScanChange], Plan], source: Iterable[Path]) -> Plan:
        """``against(form, scan)``: the step planned against ``form``, the model in the step's
        own scan form; ``source``: the step's model paths (an unroll reads block scans off
        them where the target is unscanned, `rescan.forms`)."""
        if self.scan == "unroll":
            stacked, unrolled = rescan.forms(self.target, source, self.scan_axes)
            return rescan.unroll_plan(against(stacked, "unroll"), stacked, unrolled)
        if self.scan == "stack":
            stacked, unrolled = rescan.forms(self.target, (), self.scan_axes)
            # Planned against the unscanned form first: a step in another form is refused
            # for that ("the scan form differs"), one that fits it for the plain reading.
            base = against(unrolled, "stack")
            rescan.check_plain_stack(self.target, plain_scan=self.plain_scan, where=self.where)
            plan = rescan.stack_plan(base, unrolled, stacked)
            if self.target.twin is None and not rescan.is_scanned(self.target):
                # Stacked as plain scans on the caller's word (`plain_scan`): the report says so.
                plan = dataclasses.replace(plan, notes=(*plan.notes, rescan.GUESSED_SCAN))
            return plan
        raise LayoutMismatchError(f"scan must be 'unroll', 'stack' or None, not {self.scan!r}.")


_ROOTS: tuple[tuple[Path, Dest], ...] = (
    (PARAMS_ROOT, Dest.PARAMS),
    (AUX_ROOT, Dest.NNX_AUX),
    (OPT_ROOT, Dest.OPT_STATE),
    (STEP_PATH, Dest.STEP),
)


def plan_maxtext_step(
    step_dir: epath.PathLike,
    target: Target,
    *,
    scan: ScanChange,
    optimizer: OptimizerMode = "convert",
    scan_axes: Mapping[str, int] | None = None,
    plain_scan: bool = False,
    specs: FlatTree | None = None,
) -> Plan:
    """Plans a scan change of a MaxText-layout step (its ``items``) from Orbax metadata alone.

    Every leaf of ``items`` is a ``copy`` to its own path, checked against the model in the
    step's own form (`_maxtext_items_plan`); the plan is then transformed exactly as a
    Tunix step's (`plan_step`, `rescan`): Params and their optimizer moments re-sliced on
    the Param's layer axis, RNG state on axis 0, RNG state the written form lacks dropped
    with a reason, RNG state it holds and the step lacks initialised fresh. ``target``
    names the model in either form; ``scan_axes`` (recorded by a plan) sets the Params'
    layer axes, for a replay. A section the step does not hold (``nnx_aux`` and
    ``opt_state`` of a param-only step, e.g. ``merge-lora``'s) is not written either.
    ``specs``: `read_specs` of the step's ``items``, if the caller read them.

    Raises:
      UsageError: the step is in the written form already, or holds no layers; a stack
        onto an unscanned target without a scanned form (`rescan.check_plain_stack`).
      LayoutMismatchError: the step does not fit the target (every path named).
    """
    if scan not in ("unroll", "stack"):
        raise LayoutMismatchError(f"scan must be 'unroll' or 'stack', not {scan!r}.")
    step_dir = epath.Path(step_dir)
    item = step_dir / MAXTEXT_ITEM
    check_contained(item)  # before a plan lets anything be written from it
    specs = read_specs(item) if specs is None else specs
    held = scanned_form(p for p in specs if p[:2] == PARAMS_ROOT)
    if held is None or held is (scan == "stack"):
        form = {True: "scanned", False: "unscanned", None: "without layer groups"}[held]
        raise UsageError(
            f"{step_dir}: its items are {form} already; there is nothing to {scan}"
            + (f" (drop --{scan})." if held is not None else ".")
        )
    roots = {p[:2] for p in specs} | {p[:1] for p in specs}

    def against(form: Target, change: ScanChange) -> Plan:
        return _maxtext_items_plan(specs, form, optimizer, fresh=change == "stack", where=item)

    model = {p[2:] for p in specs if p[:2] in (PARAMS_ROOT, AUX_ROOT)}
    change = _ScanChange(scan, _held_sections(target, roots), scan_axes, plain_scan, step_dir)
    return change.plan(against, model)


def _held_sections(target: Target, roots: set[Path]) -> Target:
    """``target`` (and its twin) without the sections a step does not hold: a param-only
    step stays param-only (no fresh RNG state, no optimizer expected)."""

    def strip(t: Target) -> Target:
        aux = t.nnx_aux if AUX_ROOT in roots else {}
        return dataclasses.replace(
            t, nnx_aux=aux, opt_state=t.opt_state if OPT_ROOT in roots else None
        )

    return dataclasses.replace(strip(target), twin=target.twin and strip(target.twin))


def _maxtext_items_plan(
    specs: Mapping[Path, LeafSpec],
    form: Target,
    optimizer: OptimizerMode,
    *,
    fresh: bool,
    where: epath.Path,
) -> Plan:
    """Every leaf of a MaxText ``items`` as a ``copy`` to its own path, checked against
    ``form`` (the model in the step's own form) as `make_plan` checks a Tunix step: RNG
    state ``form`` lacks is dropped for an unroll ("not requested by the target", which
    `rescan.unroll_plan` names), RNG state it holds and the step lacks is noted fresh for a
    stack (``fresh``); any other difference is refused, every path named."""
    draft = _Draft()
    opt = form.opt_state if optimizer == "convert" else None
    want = {PARAMS_ROOT + p: s for p, s in form.params.items()}
    want |= {AUX_ROOT + p: s for p, s in form.nnx_aux.items()}
    want |= {OPT_ROOT + p: s for p, s in (opt or {}).items()}
    problems: list[str] = []
    for p, spec in sorted(specs.items(), key=lambda kv: keystr(kv[0])):
        dest = next((d for root, d in _ROOTS if p[: len(root)] == root), None)
        if dest is None:
            problems.append(f"{keystr(p)}: outside MaxText's items layout ({spec})")
        elif dest is Dest.OPT_STATE and optimizer == "drop":
            draft.drops.append(Drop(MAXTEXT_ITEM, p, spec, "optimizer='drop'"))
        elif p in want and not spec.same_layout(want[p]):
            problems.append(f"{keystr(p)}: the step has {spec}, target expects {want[p]}")
        elif p in want or dest is Dest.STEP or (dest is Dest.OPT_STATE and opt is None):
            # Without the target's optimizer, the step's own is taken as it is: its moments
            # re-slice on their Params' axes (`rescan.layer_axis`).
            draft.moves.append(Move(MAXTEXT_ITEM, p, p, dest, spec))
        elif dest is Dest.NNX_AUX and is_rng(p) and not fresh:
            draft.drops.append(Drop(MAXTEXT_ITEM, p, spec, "not requested by the target"))
        else:
            problems.append(f"{keystr(p)}: not in the target model ({spec})")
    for p in sorted(want.keys() - specs.keys(), key=keystr):
        if fresh and p[:2] == AUX_ROOT and is_rng(p):
            draft.notes.append(rescan.fresh_note(p[2:]))
        else:
            problems.append(f"{keystr(p)}: expected by the target ({want[p]}), missing in items")
    if problems:
        raise LayoutMismatchError(
            f"{where} does not match the target model{rescan.named(form)} ({len(problems)} offending "
            "paths):",
            problems,
            hint=_model_hint({p[2:]: p for p in specs if p[:2] == PARAMS_ROOT}, form),
        )
    draft.rules.append("maxtext_items")
    if optimizer == "drop" and any(p[:1] == OPT_ROOT for p in specs):
        draft.rules.append("drop_optimizer")
    return draft.plan(None, "")


def narrow(plan: Plan, wanted: Iterable[Path]) -> Plan:
    """The part of ``plan`` that writes ``wanted`` destination paths (a partial restore).

    Moves to other destinations become drops ("not requested"); ``step`` is kept
    only if requested.
    """
    wanted = set(wanted)
    moves = tuple(m for m in plan.moves if m.dst in wanted)
    unread = tuple(
        Drop(m.item, m.src, m.spec, "not requested")
        for m in plan.moves
        if m.dst not in wanted and m.sources
    )
    step = plan.step if STEP_PATH in wanted else None
    return dataclasses.replace(plan, moves=moves, drops=plan.drops + unread, step=step)
