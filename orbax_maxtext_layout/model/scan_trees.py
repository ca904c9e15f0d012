"""Unroll and stack a tree of values: `unroll`, `unstack_layer` and `stack` (with its
`StackReport`), each leaf sliced or stacked on the layer axis the model gives it
(`layer_axes`).

**Layers.** Which subtrees are scans and what each layer is called unrolled is the
model's `layermap.LayerMap` (`layer_axes.layer_map`): llama's plain scan ``decoder/layers``
(step ``i`` is ``decoder/layers_<i>``); gemma3's block scan ``decoder/layers/layers_<k>``
(step ``r`` of sub-layer ``k`` of ``B`` is ``decoder/layers_<r·B+k>``) and its
``layers_remainder/layers_<j>``, stored per layer in both forms; DeepSeek's
``dense_layers`` and ``moe_layers``; gemma4's ``scanned_blocks``.

**Trees.** The functions take pure trees in any layout whose leaf paths *end* in a model
path (MaxText items; Tunix ``model_params`` with its ``base/`` adapter and ``value``
levels; optimizer states, whose moments mirror the Params) and keep that layout; only the
layer's own keys change (``layers`` <-> ``layers_<i>``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..base.treepaths import FlatTree, Path, flatten, keystr, unflatten
from ..errors import LayoutMismatchError
from ..orbax_io.spec import spec_of
from . import rules as R
from .layer_axes import Hit, ModelLeaf, layer_forms, locate, model_leaves, splice
from .layermap import SCAN_GROUPS, Layer, LayerMap, layer_of
from .rng import fresh_rng
from .target import AUX_ROOT, Target

__all__ = ["StackReport", "stack", "unroll", "unstack_layer"]


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


# -- layer keys -----------------------------------------------------------------------
def _kept_after(kept: tuple[int, ...], span: tuple[int, int], new: Path) -> tuple[int, ...]:
    """`rules.unwrapped_positions` of a path after `splice` (the new keys are all kept)."""
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


def _fit(path: Path, x: Any, leaf: ModelLeaf, n: int, problems: list[str]) -> bool | None:
    """True if ``x`` is stacked, False if it is one value for all layers, None if neither."""
    got, (stacked, one) = _stored_shape(x), layer_forms(leaf, n)
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


def _join(slices: list[Any], leaf: ModelLeaf, path: Path, problems: list[str]) -> Any:
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
    leaves, lm = model_leaves(target, param_scan_axis, num_layers)
    out: FlatTree = {}
    problems: list[str] = []
    for p, x in flat.items():
        hit = locate(p, kept[p], leaves)
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
            out[splice(p, hit.span, la.unrolled)] = value
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
    leaves, lm = model_leaves(target, param_scan_axis, num_layers)
    run = _Stacking(leaves, lm, rng_seed)
    parts, seen = run.sort(_flat(tree))
    for path, (hit, got) in parts.items():
        run.family(path, hit, got)
    run.never_had(seen)
    _raise(run.problems, "The tree does not stack onto the target", _HINT)
    return unflatten(run.out), StackReport(run.fresh)


# stacked tree path -> (its hit, {scan step: (the unrolled path, its leaf)})
_Parts = dict[Path, tuple[Hit, dict[int, tuple[Path, Any]]]]
_Seen = dict[tuple[Path, Path], set[Path]]  # a tree frame -> the non-Param model paths it holds


@dataclasses.dataclass
class _Stacking:
    """One `stack` call: what the target says, and the stacked leaves made so far."""

    leaves: Mapping[Path, ModelLeaf]
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
            hit = locate(p, kept[p], self.leaves)
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
                sp = splice(p, span, la.stacked)
                hit = locate(sp, _kept_after(kept[p], span, la.stacked), self.leaves)
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

    def family(self, path: Path, hit: Hit, got: dict[int, tuple[Path, Any]]) -> None:
        """The layers ``got`` of one leaf stacked at ``path``; missing RNG layers made fresh."""
        leaf = hit.leaf
        assert leaf.scan is not None
        n = leaf.scan.length
        one = layer_forms(leaf, n)[1]
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
                    one = layer_forms(leaf, n)[1]
                    slices = [self.new_rng(leaf, one, m, i, None) for i in range(n)]
                    self.out[path] = _join(slices, leaf, path, self.problems)
                    self.fresh[path] = tuple(range(n))

    def new_rng(
        self, leaf: ModelLeaf, shape: tuple[int, ...], model: Path, i: int, like: Any
    ) -> Any:
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
