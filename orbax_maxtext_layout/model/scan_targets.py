"""A Target in the other scan form: `unroll_target` (scanned -> unscanned) and
`stack_target` (unscanned -> scanned), spec by spec and without any array.

Each leaf's layer axis and scans come from the model (`layer_axes`); the layers' names in
both forms from its `layermap.LayerMap`. An unrolled target keeps each Param's
``param_scan_axis`` metadata under its per-layer paths, so that `stack_target` restores it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Collection, Mapping
from typing import Any

import jax

from ..base.treepaths import FlatTree, Path, keystr
from ..errors import LayoutMismatchError
from ..orbax_io.spec import LeafSpec
from . import layermap as LM
from .layer_axes import layer_forms, locate, logical_rank, model_leaves, splice
from .layermap import LayerMap
from .rng import is_rng
from .target import AUX_ROOT, OPT_ROOT, PARAMS_ROOT, Target

__all__ = ["stack_target", "unroll_target"]


def _full_specs(target: Target) -> dict[Path, LeafSpec]:
    out = {PARAMS_ROOT + p: s for p, s in target.params.items()}
    out |= {AUX_ROOT + p: s for p, s in target.nnx_aux.items()}
    return out | {OPT_ROOT + p: s for p, s in (target.opt_state or {}).items()}


def _abstract(like: Any, spec: LeafSpec, shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
    """``like``'s dtype (typed keys stay typed) with a new logical shape; no sharding."""
    dtype = getattr(like, "dtype", None)
    return jax.ShapeDtypeStruct(shape, dtype) if dtype is not None else spec.abstract()


def _build(
    target: Target,
    specs: Mapping[Path, LeafSpec],
    abstract: FlatTree,
    intermediates: Collection[Path],
    axes: Mapping[Path, int],
) -> Target:
    def section(root: Path) -> dict[Path, LeafSpec]:
        return {p[len(root) :]: s for p, s in specs.items() if p[: len(root)] == root}

    opt = section(OPT_ROOT) if target.opt_state is not None else None
    old = _full_specs(target)
    rest = {p: v for p, v in target.abstract.items() if p not in old}  # e.g. step
    return Target(
        section(PARAMS_ROOT),
        section(AUX_ROOT),
        opt,
        frozenset(intermediates),
        dict(axes),
        rest | dict(abstract),
        origin=target.origin,  # the other form of the same target, for errors
    )


def unroll_target(
    target: Target, *, num_layers: int | None = None, param_scan_axis: int = 1
) -> Target:
    """The unscanned Target of a scanned one: every layer under its own name
    (``layers_<i>``, `layer_axes.layer_map`), with per-layer specs.

    Params keep their ``param_scan_axis`` metadata under the new paths, so that
    `stack_target` restores it; abstract leaves lose their shardings. Every layer keeps
    its own RNG state: MaxText's own unscanned model, which shares one stream, is a
    better target where its config is at hand.
    """
    leaves, lm = model_leaves(target, param_scan_axis, num_layers)
    specs: dict[Path, LeafSpec] = {}
    abstract: FlatTree = {}
    axes: dict[Path, int] = {}
    for p, s in _full_specs(target).items():
        hit = locate(p, tuple(range(len(p))), leaves)
        if hit is None or hit.span is None:
            specs[p] = s
            if p in target.abstract:
                abstract[p] = target.abstract[p]
            continue
        leaf = hit.leaf
        one = (
            s
            if leaf.scan is None
            else dataclasses.replace(s, shape=layer_forms(leaf, leaf.scan.length)[1])
        )
        like = target.abstract.get(p)
        for la in lm.of_stacked(leaf.prefix):  # type: ignore[arg-type]
            q = splice(p, hit.span, la.unrolled)
            specs[q] = one
            abstract[q] = _abstract(like, one, one.shape[: logical_rank(one)])
            if p[:2] == PARAMS_ROOT and hit.model in target.param_scan_axes:
                axes[q[2:]] = target.param_scan_axes[hit.model]
    inter = set()
    for p in target.intermediates:
        prefix = lm.stacked_prefix(p)
        if prefix is None:
            inter.add(p)
            continue
        inter |= {(*la.unrolled, *p[len(prefix) :]) for la in lm.of_stacked(prefix)}
    return _build(target, specs, abstract, inter, axes)


# stacked path -> {scan step: its unscanned path}
_Groups = dict[Path, dict[int, Path]]


def _sort_layers(
    target: Target, full: Mapping[Path, LeafSpec], lm: LayerMap
) -> tuple[_Groups, dict[Path, LM.Scan], dict[Path, LeafSpec], FlatTree]:
    """``full`` sorted by scan step: the leaves of each step grouped under their stacked
    path, with the scan of each; the specs and abstract leaves of every other leaf as the
    scanned target holds them (a remainder layer's renamed only)."""
    groups: _Groups = defaultdict(dict)
    scans: dict[Path, LM.Scan] = {}  # stacked path -> its scan
    specs: dict[Path, LeafSpec] = {}
    abstract: FlatTree = {}
    for p, s in full.items():
        u = lm.find_unrolled(p)
        if u is None:
            specs[p] = s
            if p in target.abstract:
                abstract[p] = target.abstract[p]
            continue
        pos, la = u
        sp = splice(p, (pos, pos + len(la.unrolled)), la.stacked)
        if la.index is None or la.scan is None:  # a remainder layer: renamed only
            specs[sp] = s
            abstract[sp] = _abstract(target.abstract.get(p), s, s.shape[: logical_rank(s)])
            continue
        groups[sp][la.index] = p
        scans[sp] = la.scan
    return groups, scans, specs, abstract


def stack_target(
    target: Target, *, param_scan_axis: int = 1, layers: LayerMap | None = None
) -> Target:
    """The scanned Target of an unscanned one.

    ``layers`` says which unscanned layers are which scan step of which scan (the
    `layer_axes.layer_map` of the scanned model, e.g. read off a scanned checkpoint of
    it); without it every ``<group>_<i>`` family is stacked as one plain scan
    ``<group>``, which is all an unscanned tree can tell (a block-scanned model such as
    gemma3 needs ``layers``). Params go on their ``param_scan_axis`` metadata (else
    ``param_scan_axis``), other Variables on 0, moments on their Param's axis. An RNG leaf
    held by some layers only (a shared stream) is stacked over all of them; a Param or
    custom Variable missing from a layer raises. A real scanned model is a better target
    where one exists: only it knows state the unscanned model lacks (``decoder/rngs``).
    """
    full = _full_specs(target)
    lm = layers if layers is not None else LM.plain(target.model_paths())
    groups, scans, specs, abstract = _sort_layers(target, full, lm)

    def first(sp: Path) -> Path:
        return groups[sp][min(groups[sp])]

    axes: dict[Path, int] = {}  # stacked Param model path -> axis
    for sp in groups:
        if sp[:2] == PARAMS_ROOT:
            axes[sp[2:]] = target.param_scan_axes.get(first(sp)[2:], param_scan_axis)

    def axis_of(sp: Path) -> int | None:
        if sp[:2] == PARAMS_ROOT:
            return axes[sp[2:]]
        if sp[:2] == AUX_ROOT:
            return 0
        # A moment: the axis of the Param its path ends in.
        return next((axes[sp[k:]] for k in range(len(sp)) if sp[k:] in axes), None)

    problems: list[str] = []
    for sp, got in groups.items():
        s, n, a = full[first(sp)], scans[sp].length, axis_of(sp)
        missing = [i for i in range(n) if i not in got]
        differ = [keystr(q) for q in got.values() if full[q] != s]
        if a is None or a > logical_rank(s):
            problems.append(f"{keystr(sp)}: cannot tell the layer axis of {s}")
        elif differ:
            problems.append(f"{keystr(sp)}: layers differ from {keystr(first(sp))} ({s}): {differ}")
        elif missing and not (sp[:2] == AUX_ROOT and is_rng(sp)):
            problems.append(f"{keystr(sp)}: layers {missing} missing")
        else:
            specs[sp] = dataclasses.replace(s, shape=s.shape[:a] + (n,) + s.shape[a:])
            logical = specs[sp].shape[: logical_rank(specs[sp])]
            abstract[sp] = _abstract(target.abstract.get(first(sp)), specs[sp], logical)
    if problems:
        summary = f"The unscanned target does not stack ({len(problems)} leaves):"
        raise LayoutMismatchError(summary, problems)
    kept_axes = {
        m: a for m, a in axes.items() if first(PARAMS_ROOT + m)[2:] in target.param_scan_axes
    }
    inter = set()
    for p in target.intermediates:
        u = lm.find_unrolled(p)
        inter.add(splice(p, (u[0], u[0] + len(u[1].unrolled)), u[1].stacked) if u else p)
    return _build(target, specs, abstract, inter, kept_axes)
