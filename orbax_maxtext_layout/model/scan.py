"""Scanned layer blocks: the axis each leaf's layers are stacked on, and (un)stacking.

MaxText's ``scan_layers=True`` keeps decoder layers in stacked scans (DOMAIN.md section
6): an ``nnx.Param`` has its layers at its ``param_scan_axis`` (usually 1), every other
Variable (RNG counts and keys, custom Variables) at axis 0, and optimizer moments
(``mu``/``nu``, ...) at the axis of the Param they mirror. The axis always comes from the
model (a `Target`), never from a leaf's rank: rank rules are what crashed earlier
unrollers on ``(L,)`` counts, raw ``(L, 2)`` keys, rank-2 custom Variables, unstacked
scalars and models past 256 layers (DOMAIN.md section 9, 22-28).

**Layers.** Which subtrees are scans and what each layer is called unrolled is the
model's `layermap.LayerMap` (`layer_map`): llama's plain scan ``decoder/layers``
(step ``i`` is ``decoder/layers_<i>``); gemma3's block scan ``decoder/layers/layers_<k>``
(step ``r`` of sub-layer ``k`` of ``B`` is ``decoder/layers_<r·B+k>``) and its
``layers_remainder/layers_<j>``, stored per layer in both forms; DeepSeek's
``dense_layers`` and ``moe_layers``; gemma4's ``scanned_blocks``.

**Paths.** `scan_axes` is keyed by full items paths: ``("params", "params",
*model)``, ``("nnx_aux", "model", *model)`` and ``("opt_state", *path)``. The
tree functions take pure trees in any layout whose leaf paths *end* in a model
path (MaxText items; Tunix ``model_params`` with its ``base/`` adapter and
``value`` levels; optimizer states, whose moments mirror the Params) and keep
that layout; only the layer's own keys change (``layers`` <-> ``layers_<i>``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..base.treepaths import FlatTree, Path, flatten, keystr, unflatten
from ..errors import LayoutMismatchError
from ..orbax_io.spec import LeafSpec, spec_of
from . import layermap as LM
from . import rules as R
from .layermap import SCAN_GROUPS, Layer, LayerMap, layer_of
from .rng import fresh_rng, is_rng
from .target import AUX_ROOT, OPT_ROOT, PARAMS_ROOT, Target

__all__ = [
    "SCAN_GROUPS",
    "StackReport",
    "layer_map",
    "layer_of",
    "scan_axes",
    "stack",
    "stack_target",
    "unroll",
    "unroll_target",
    "unstack_layer",
]


@dataclasses.dataclass(frozen=True)
class StackReport:
    """What `stack` could not carry over from the unscanned tree.

    ``fresh`` maps the path of every RNG leaf it had to initialise (key from
    ``rng_seed``, count 0) to the layers initialised, or ``None`` for a whole
    leaf outside any block. Unscanned MaxText models store a shared RNG stream
    once (e.g. at ``layers_0/.../attention_op/rngs``), so its other layers, and
    a ``decoder/rngs`` the unscanned model never had, end up here.
    """

    fresh: Mapping[Path, tuple[int, ...] | None] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        if not self.fresh:
            return "all state carried over"
        lines = [f"{len(self.fresh)} RNG leaves freshly initialised:"]
        for p, layers in self.fresh.items():
            lines.append(f"  {keystr(p)}" + ("" if layers is None else f" layers {list(layers)}"))
        return "\n".join(lines)


# -- what the target says -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Leaf:
    spec: LeafSpec  # stored form (a typed key of shape S is uint32 S + (2,))
    param: bool
    rng: bool  # RNG state: nnx_aux ``.../rngs/<stream>/{count,key}``
    axis: int | None  # layer axis; None outside scans
    prefix: Path | None  # its layer's path in the scanned model (`LayerMap.stacked_prefix`)
    scan: LM.Scan | None  # the scan it is stacked in (None: a remainder layer, or no layer)

    @property
    def stacked(self) -> bool:
        """False when the target holds one value for all layers (a scan-broadcast scalar)."""
        assert self.axis is not None
        return _rank(self.spec) > self.axis


def _rank(spec: LeafSpec) -> int:
    return len(spec.shape) - (1 if spec.key_impl else 0)


def _axes_in(target: Target, param_scan_axis: int) -> dict[Path, tuple[LeafSpec, bool, int]]:
    out = {
        p: (s, True, target.param_scan_axes.get(p, param_scan_axis))
        for p, s in target.params.items()
    }
    return out | {p: (s, False, 0) for p, s in target.nnx_aux.items()}


def layer_map(
    target: Target,
    *,
    num_layers: int | None = None,
    param_scan_axis: int = 1,
    lengths: bool = True,
) -> LayerMap:
    """The layers of a scanned model (`layermap.LayerMap`): its scans, their lengths, and
    every layer's name in both forms. Empty for an unscanned target.

    The scans are read from the target's paths and each leaf's layer axis (a Param's
    ``param_scan_axis`` metadata, else ``param_scan_axis``; 0 for other Variables);
    ``num_layers`` gives the length of a scan none of whose leaves is stacked;
    ``lengths=False`` skips the lengths (`layermap.infer`).
    """
    leaves = _axes_in(target, param_scan_axis)
    shapes = {p: (s.shape[: _rank(s)], a) for p, (s, _, a) in leaves.items()}
    return LM.infer(shapes, num_layers, lengths=lengths)


def _model_leaves(
    target: Target, param_scan_axis: int, num_layers: int | None = None, lengths: bool = True
) -> tuple[dict[Path, _Leaf], LayerMap]:
    lm = layer_map(target, num_layers=num_layers, param_scan_axis=param_scan_axis, lengths=lengths)
    out: dict[Path, _Leaf] = {}
    for p, (s, param, axis) in _axes_in(target, param_scan_axis).items():
        prefix, scan = lm.stacked_prefix(p), lm.scan_at(p)
        rng = not param and is_rng(p)
        out[p] = _Leaf(s, param, rng, axis if scan else None, prefix, scan)
    return out, lm


def scan_axes(target: Target, *, param_scan_axis: int = 1) -> dict[Path, int | None]:
    """The axis each leaf's layers are stacked on, or None outside scanned blocks.

    A Param uses its own ``param_scan_axis`` metadata (`Target.from_nnx`) or else
    ``param_scan_axis``; every other Variable uses 0; an ``opt_state`` moment uses
    the axis of the Param it mirrors. Keys are full items paths (module docstring).
    """
    leaves, _ = _model_leaves(target, param_scan_axis, lengths=False)
    out = {PARAMS_ROOT + p: leaves[p].axis for p in target.params}
    out |= {AUX_ROOT + p: leaves[p].axis for p in target.nnx_aux}
    for p in target.opt_state or {}:
        hit = _hit(OPT_ROOT + p, tuple(range(len(p) + 1)), leaves)
        out[OPT_ROOT + p] = hit.leaf.axis if hit else None
    return out


# -- where a tree leaf sits -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Hit:
    leaf: _Leaf
    model: Path
    span: tuple[int, int] | None  # tree path positions of its layer's keys (the prefix)
    frame: tuple[Path, Path]  # tree keys before the model path, 'value' levels after it


def _hit(path: Path, kept: tuple[int, ...], leaves: Mapping[Path, _Leaf]) -> _Hit | None:
    """The longest model path the (unwrapped) tree path ends in."""
    u = tuple(path[i] for i in kept)
    start = next((s for s in range(len(u)) if u[s:] in leaves), None)
    if start is None:
        return None
    leaf = leaves[u[start:]]
    span = None
    if leaf.prefix is not None:
        span = (kept[start], kept[start + len(leaf.prefix) - 1] + 1)
    return _Hit(leaf, u[start:], span, (path[: kept[start]], path[kept[-1] + 1 :]))


def _splice(path: Path, span: tuple[int, int], new: Path) -> Path:
    return (*path[: span[0]], *new, *path[span[1] :])


def _kept_after(kept: tuple[int, ...], span: tuple[int, int], new: Path) -> tuple[int, ...]:
    """`rules.unwrapped_positions` of a path after `_splice` (the new keys are all kept)."""
    delta = len(new) - (span[1] - span[0])
    before = tuple(i for i in kept if i < span[0])
    after = tuple(i + delta for i in kept if i >= span[1])
    return (*before, *range(span[0], span[0] + len(new)), *after)


def _number(layer: Layer) -> int:
    """The layer's index among its unrolled group's layers (``layers_<i>``)."""
    hit = layer_of(layer.unrolled[-1])
    assert hit is not None, layer
    return hit[1]


def _flat(tree: Any) -> FlatTree:
    return flatten(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))


# -- arrays ---------------------------------------------------------------------------
def _is_key(x: Any) -> bool:
    try:
        return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    except (AttributeError, TypeError):  # plain scalars, lazy readers' own dtype types
        return False


def _stored_shape(x: Any) -> tuple[int, ...]:
    return spec_of(x).shape if _is_key(x) else tuple(getattr(x, "shape", ()))


def _forms(leaf: _Leaf, n: int) -> tuple[tuple[int, ...] | None, tuple[int, ...]]:
    """(stacked, one-layer) stored shapes of a block leaf with ``n`` layers."""
    s, a = leaf.spec.shape, leaf.axis
    assert a is not None
    if leaf.stacked:
        return s, s[:a] + s[a + 1 :]
    # The target holds one value for all layers; its stacked form is the one a
    # scan that split it would have (None where the axis is past its rank).
    return (s[:a] + (n,) + s[a:] if a <= _rank(leaf.spec) else None), s


def _fit(path: Path, x: Any, leaf: _Leaf, n: int, problems: list[str]) -> bool | None:
    """True if ``x`` is stacked, False if it is one value for all layers, None if neither."""
    got, (stacked, one) = _stored_shape(x), _forms(leaf, n)
    if got == stacked or got == one:
        return got == stacked
    problems.append(
        f"{keystr(path)}: found {list(got)}, expected {list(stacked or ())} ({n} layers on "
        f"axis {leaf.axis}) or {list(one)} (one value for every layer)"
    )
    return None


def _take(x: Any, axis: int, i: int) -> Any:
    # Basic indexing: a view for numpy/memmap, one slice for jax (typed keys too),
    # and a lazy view for readers such as tensorstore; other layers are never read.
    return x[(slice(None),) * axis + (i,)]


def _bits(x: Any) -> np.ndarray:
    return np.asarray(jax.random.key_data(x) if _is_key(x) else x)


def _same(a: Any, b: Any) -> bool:
    return a is b or np.array_equal(_bits(a), _bits(b))


def _join(slices: list[Any], leaf: _Leaf, path: Path, problems: list[str]) -> Any:
    if leaf.stacked:
        xp = jnp if any(isinstance(s, jax.Array) for s in slices) else np
        return xp.stack(slices, axis=leaf.axis)
    if all(_same(slices[0], s) for s in slices[1:]):
        return slices[0]
    problems.append(f"{keystr(path)}: the target holds one value for all layers; layers differ")
    return None


def _raise(problems: list[str], summary: str, hint: str = "") -> None:
    if problems:
        raise LayoutMismatchError(f"{summary} ({len(problems)} leaves):", problems, hint=hint)


_HINT = "Pass the scanned model's own Target (same architecture, scan_layers=True)."


# -- trees ----------------------------------------------------------------------------
def _unroll_flat(
    tree: Any, target: Target, num_layers: int | None, param_scan_axis: int, only: int | None
) -> FlatTree:
    flat = _flat(tree)
    kept = R.unwrapped_positions(flat)
    leaves, lm = _model_leaves(target, param_scan_axis, num_layers)
    out: FlatTree = {}
    problems: list[str] = []
    for p, x in flat.items():
        hit = _hit(p, kept[p], leaves)
        if hit is None or hit.span is None:
            keys = tuple(p[i] for i in kept[p])
            if hit is None and (lm.find_stacked(keys) or any(k in SCAN_GROUPS for k in keys)):
                problems.append(f"{keystr(p)}: in a scanned block but not in the target")
            elif only is None:
                out[p] = x
            continue
        assert hit.leaf.prefix is not None
        layers = lm.of_stacked(hit.leaf.prefix)
        stacked = None
        if hit.leaf.scan is not None:
            stacked = _fit(p, x, hit.leaf, hit.leaf.scan.length, problems)
            if stacked is None:
                continue
        for la in layers:
            if only is not None and _number(la) != only:
                continue
            assert hit.leaf.axis is not None or not stacked
            value = _take(x, hit.leaf.axis, la.index) if stacked else x  # type: ignore[arg-type]
            out[_splice(p, hit.span, la.unrolled)] = value
    _raise(problems, "The tree does not fit the target's scanned layout", _HINT)
    return out


def unroll(
    tree: Any, target: Target, *, num_layers: int | None = None, param_scan_axis: int = 1
) -> Any:
    """A scanned tree in the unscanned form: every layer under its own name
    (``layers_<i>``), each leaf sliced on its own axis.

    Args:
      tree: pure nested dicts/lists of arrays (layouts in the module docstring).
      target: the *scanned* model's Target; it decides every leaf's axis and length.
      num_layers: the scan length, for a block none of whose target leaves is
        stacked; otherwise checked against the target.
      param_scan_axis: the Param axis where the target carries no metadata.

    A leaf the target says is per-layer but that holds one value (a scan-broadcast
    scalar) is replicated once per layer; a remainder layer (``layers_remainder/layers_<j>``)
    is only renamed. Raises `LayoutMismatchError` naming every leaf inside a layer the
    target does not know, or whose shape fits neither form.
    """
    return unflatten(_unroll_flat(tree, target, num_layers, param_scan_axis, None))


def unstack_layer(
    tree: Any,
    target: Target,
    i: int,
    *,
    num_layers: int | None = None,
    param_scan_axis: int = 1,
) -> Any:
    """Layer ``i`` of every layer group (``…/layers_<i>/…``, as `unroll` names it) without
    touching other layers.

    Leaves are sliced by basic indexing, so numpy inputs give views, jax inputs
    one slice, and lazy array readers (anything with ``shape``, ``dtype`` and
    ``__getitem__``, e.g. a ``tensorstore.TensorStore``) read nothing yet. Groups
    with fewer than ``i + 1`` layers (DeepSeek ``dense_layers``) contribute nothing.
    """
    out = _unroll_flat(tree, target, num_layers, param_scan_axis, i) if i >= 0 else {}
    if not out:
        raise IndexError(f"layer {i} is in no scanned block of the tree")
    return unflatten(out)


def stack(
    tree: Any,
    target: Target,
    *,
    num_layers: int | None = None,
    param_scan_axis: int = 1,
    rng_seed: int = 0,
) -> tuple[Any, StackReport]:
    """The inverse of `unroll`: every layer's leaves stacked back onto the target's axes.

    ``nnx_aux`` follows the *target's* paths: an RNG leaf (or some layers of it)
    that the unscanned tree lacks is initialised and listed in the `StackReport`;
    a missing custom Variable, a missing layer of a Param, or a layer beyond the
    target's length raises `LayoutMismatchError`. Fresh RNG state is what
    ``convert --stack`` writes for the same leaf (`rng.fresh_rng`: count 0, a key
    derived from the leaf's items path and layer), with ``rng_seed`` folded in when
    it is not 0.
    """
    leaves, lm = _model_leaves(target, param_scan_axis, num_layers)
    run = _Stacking(leaves, lm, rng_seed)
    parts, seen = run.sort(_flat(tree))
    for path, (hit, got) in parts.items():
        run.family(path, hit, got)
    run.never_had(seen)
    _raise(run.problems, "The tree does not stack onto the target", _HINT)
    return unflatten(run.out), StackReport(run.fresh)


# stacked tree path -> (its hit, {scan step: (the unrolled path, its leaf)})
_Parts = dict[Path, tuple[_Hit, dict[int, tuple[Path, Any]]]]
_Seen = dict[tuple[Path, Path], set[Path]]  # a tree frame -> the non-Param model paths it holds


@dataclasses.dataclass
class _Stacking:
    """One `stack` call: what the target says, and the stacked leaves made so far."""

    leaves: Mapping[Path, _Leaf]
    layers: LayerMap
    seed: int
    out: FlatTree = dataclasses.field(default_factory=dict)
    fresh: dict[Path, tuple[int, ...] | None] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)

    def sort(self, flat: FlatTree) -> tuple[_Parts, _Seen]:
        """Leaves outside layers go to ``out`` as they are; per-layer leaves are grouped
        under their stacked path (a remainder layer's only renamed)."""
        kept = R.unwrapped_positions(flat)
        parts: _Parts = {}
        seen: _Seen = defaultdict(set)
        for p, x in flat.items():
            hit = _hit(p, kept[p], self.leaves)
            if hit is not None and hit.span is None:
                self.out[p] = x
            elif hit is not None:
                self.problems.append(f"{keystr(p)}: already stacked")
                continue
            elif (u := self.layers.find_unrolled(tuple(p[i] for i in kept[p]))) is None:
                if (past := self.layers.past_end(tuple(p[i] for i in kept[p]))) is not None:
                    i, n = past
                    self.problems.append(
                        f"{keystr(p)}: layer {i} is beyond the target's {n} layers"
                    )
                else:
                    self.out[p] = x  # no model leaf (optimizer counts, step, ...)
                continue
            else:
                pos, la = u
                span = (kept[p][pos], kept[p][pos + len(la.unrolled) - 1] + 1)
                sp = _splice(p, span, la.stacked)
                hit = _hit(sp, _kept_after(kept[p], span, la.stacked), self.leaves)
                if hit is None or hit.leaf.prefix != la.stacked:
                    self.problems.append(f"{keystr(p)}: a per-layer leaf the target does not have")
                    continue
                if la.index is None:
                    self.out[sp] = x  # a remainder layer: stored per layer in both forms
                else:
                    parts.setdefault(sp, (hit, {}))[1][la.index] = (p, x)
            if not hit.leaf.param:
                seen[hit.frame].add(hit.model)
        return parts, seen

    def family(self, path: Path, hit: _Hit, got: dict[int, tuple[Path, Any]]) -> None:
        """The layers ``got`` of one leaf stacked at ``path``; missing RNG layers made fresh."""
        leaf = hit.leaf
        assert leaf.scan is not None
        n = leaf.scan.length
        one = _forms(leaf, n)[1]
        before = len(self.problems)
        for i, (where, x) in got.items():
            if i >= n:
                self.problems.append(
                    f"{keystr(where)}: layer {i} is beyond the target's {n} layers"
                )
            elif _stored_shape(x) != one:
                self.problems.append(
                    f"{keystr(where)}: found {list(_stored_shape(x))}, expected {list(one)}"
                )
        values = {i: x for i, (_, x) in got.items()}
        missing = tuple(i for i in range(n) if i not in values)
        if not leaf.stacked:  # one value for all layers: any layer holding it is enough
            missing, values = (), {i: next(iter(values.values())) for i in range(n)} | values
        if missing and not leaf.rng:
            self.problems.append(f"{keystr(path)}: layers {list(missing)} missing")
        if len(self.problems) > before:
            return
        like = next(iter(values.values()))
        for i in missing:
            values[i] = self.new_rng(leaf, one, hit.model, i, like)
        if missing:
            self.fresh[path] = missing
        self.out[path] = _join([values[i] for i in range(n)], leaf, path, self.problems)

    def never_had(self, seen: _Seen) -> None:
        """RNG state the unscanned tree never had (a deduplicated shared stream), in
        every frame (e.g. ``nnx_aux/model``) that holds other non-Param state."""
        for (prefix, suffix), present in seen.items():
            for m, leaf in self.leaves.items():
                if leaf.param or m in present:
                    continue
                path = (*prefix, *m, *suffix)
                if not leaf.rng:
                    self.problems.append(
                        f"{keystr(path)}: expected by the target, missing in the tree"
                    )
                elif leaf.scan is None:
                    self.out[path] = self.new_rng(leaf, leaf.spec.shape, m, 0, None)
                    self.fresh[path] = None
                else:
                    n = leaf.scan.length
                    one = _forms(leaf, n)[1]
                    slices = [self.new_rng(leaf, one, m, i, None) for i in range(n)]
                    self.out[path] = _join(slices, leaf, path, self.problems)
                    self.fresh[path] = tuple(range(n))

    def new_rng(self, leaf: _Leaf, shape: tuple[int, ...], model: Path, i: int, like: Any) -> Any:
        """Fresh RNG state of stored ``shape`` for layer ``i`` of nnx_aux leaf ``model``.

        Keyed by the leaf's items path, not its path in this tree (which may carry a
        Tunix ``base``/``value`` frame), so it equals what ``convert --stack`` writes.
        Typed keys unless ``like`` (a layer the tree holds) is raw key data; a typed
        ``like`` also names the key impl.
        """
        spec = dataclasses.replace(leaf.spec, shape=shape)
        if spec.key_impl and _is_key(like):
            spec = dataclasses.replace(spec, key_impl=spec_of(like).key_impl)
        data = fresh_rng(spec, AUX_ROOT + model, i, seed=self.seed)
        if spec.key_impl and (like is None or _is_key(like)):
            return jax.random.wrap_key_data(jnp.asarray(data), impl=spec.key_impl)
        return data


# -- targets --------------------------------------------------------------------------
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
    (``layers_<i>``, `layer_map`), with per-layer specs.

    Params keep their ``param_scan_axis`` metadata under the new paths, so that
    `stack_target` restores it; abstract leaves lose their shardings. Every layer keeps
    its own RNG state: MaxText's own unscanned model, which shares one stream, is a
    better target where its config is at hand.
    """
    leaves, lm = _model_leaves(target, param_scan_axis, num_layers)
    specs: dict[Path, LeafSpec] = {}
    abstract: FlatTree = {}
    axes: dict[Path, int] = {}
    for p, s in _full_specs(target).items():
        hit = _hit(p, tuple(range(len(p))), leaves)
        if hit is None or hit.span is None:
            specs[p] = s
            if p in target.abstract:
                abstract[p] = target.abstract[p]
            continue
        leaf = hit.leaf
        one = (
            s
            if leaf.scan is None
            else dataclasses.replace(s, shape=_forms(leaf, leaf.scan.length)[1])
        )
        like = target.abstract.get(p)
        for la in lm.of_stacked(leaf.prefix):  # type: ignore[arg-type]
            q = _splice(p, hit.span, la.unrolled)
            specs[q] = one
            abstract[q] = _abstract(like, one, one.shape[: _rank(one)])
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


def stack_target(
    target: Target, *, param_scan_axis: int = 1, layers: LayerMap | None = None
) -> Target:
    """The scanned Target of an unscanned one.

    ``layers`` says which unscanned layers are which scan step of which scan (the
    `layer_map` of the scanned model, e.g. read off a scanned checkpoint of it); without
    it every ``<group>_<i>`` family is stacked as one plain scan ``<group>``, which is
    all an unscanned tree can tell (a block-scanned model such as gemma3 needs
    ``layers``). Params go on their ``param_scan_axis`` metadata (else
    ``param_scan_axis``), other Variables on 0, moments on their Param's axis. An RNG leaf
    held by some layers only (a shared stream) is stacked over all of them; a Param or
    custom Variable missing from a layer raises. A real scanned model is a better target
    where one exists: only it knows state the unscanned model lacks (``decoder/rngs``).
    """
    full = _full_specs(target)
    lm = layers if layers is not None else LM.plain(target.model_paths())
    groups: dict[Path, dict[int, Path]] = defaultdict(dict)  # stacked path -> {step: path}
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
        sp = _splice(p, (pos, pos + len(la.unrolled)), la.stacked)
        if la.index is None or la.scan is None:  # a remainder layer: renamed only
            specs[sp] = s
            abstract[sp] = _abstract(target.abstract.get(p), s, s.shape[: _rank(s)])
            continue
        groups[sp][la.index] = p
        scans[sp] = la.scan

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
        if a is None or a > _rank(s):
            problems.append(f"{keystr(sp)}: cannot tell the layer axis of {s}")
        elif differ:
            problems.append(f"{keystr(sp)}: layers differ from {keystr(first(sp))} ({s}): {differ}")
        elif missing and not (sp[:2] == AUX_ROOT and is_rng(sp)):
            problems.append(f"{keystr(sp)}: layers {missing} missing")
        else:
            specs[sp] = dataclasses.replace(s, shape=s.shape[:a] + (n,) + s.shape[a:])
            logical = specs[sp].shape[: _rank(specs[sp])]
            abstract[sp] = _abstract(target.abstract.get(first(sp)), specs[sp], logical)
    _raise(problems, "The unscanned target does not stack")
    kept_axes = {
        m: a for m, a in axes.items() if first(PARAMS_ROOT + m)[2:] in target.param_scan_axes
    }
    inter = set()
    for p in target.intermediates:
        u = lm.find_unrolled(p)
        inter.add(_splice(p, (u[0], u[0] + len(u[1].unrolled)), u[1].stacked) if u else p)
    return _build(target, specs, abstract, inter, kept_axes)
