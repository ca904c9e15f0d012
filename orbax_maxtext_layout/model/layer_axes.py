"""The layer axis of each leaf of a scanned model, read from its `Target`, and where a leaf
of a tree sits in that model.

MaxText's ``scan_layers=True`` keeps decoder layers in stacked scans (DOMAIN.md section
6): an ``nnx.Param`` has its layers at its ``param_scan_axis`` (usually 1), every other
Variable (RNG counts and keys, custom Variables) at axis 0, and optimizer moments
(``mu``/``nu``, ...) at the axis of the Param they mirror. The axis always comes from the
model (a `Target`), never from a leaf's rank: rank rules are what crashed earlier
unrollers on ``(L,)`` counts, raw ``(L, 2)`` keys, rank-2 custom Variables, unstacked
scalars and models past 256 layers (DOMAIN.md section 9, 22-28).

This module owns what the target says of each model leaf (`ModelLeaf`, `model_leaves`):
its layer axis (`scan_axes`), the scans it sits in (`layer_map`, a `layermap.LayerMap`),
its stacked and one-layer shapes (`layer_forms`); and where a tree leaf sits (`locate`,
`Hit`). The scan changes built on it are `scan_trees` (trees of values) and `scan_targets`
(abstract targets).

**Paths.** `scan_axes` is keyed by full items paths: ``("params", "params",
*model)``, ``("nnx_aux", "model", *model)`` and ``("opt_state", *path)``. `locate` takes
tree paths in any layout that *end* in a model path (MaxText items; Tunix
``model_params`` with its ``base/`` adapter and ``value`` levels; optimizer states, whose
moments mirror the Params).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..base.treepaths import Path
from ..orbax_io.spec import LeafSpec
from . import layermap as LM
from .layermap import LayerMap
from .rng import is_rng
from .target import AUX_ROOT, OPT_ROOT, PARAMS_ROOT, Target

__all__ = [
    "Hit",
    "ModelLeaf",
    "layer_forms",
    "layer_map",
    "locate",
    "logical_rank",
    "model_leaves",
    "scan_axes",
    "splice",
]


@dataclasses.dataclass(frozen=True)
class ModelLeaf:
    """What the target says of one model leaf."""

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
        return logical_rank(self.spec) > self.axis


def logical_rank(spec: LeafSpec) -> int:
    """The rank of the leaf's logical shape (a typed key's stored form has one more axis)."""
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
    shapes = {p: (s.shape[: logical_rank(s)], a) for p, (s, _, a) in leaves.items()}
    return LM.infer(shapes, num_layers, lengths=lengths)


def model_leaves(
    target: Target, param_scan_axis: int, num_layers: int | None = None, lengths: bool = True
) -> tuple[dict[Path, ModelLeaf], LayerMap]:
    """Every model leaf of ``target`` (Params and ``nnx_aux``, by model path), and its
    `layer_map`."""
    lm = layer_map(target, num_layers=num_layers, param_scan_axis=param_scan_axis, lengths=lengths)
    out: dict[Path, ModelLeaf] = {}
    for p, (s, param, axis) in _axes_in(target, param_scan_axis).items():
        prefix, scan = lm.stacked_prefix(p), lm.scan_at(p)
        rng = not param and is_rng(p)
        out[p] = ModelLeaf(s, param, rng, axis if scan else None, prefix, scan)
    return out, lm


def scan_axes(target: Target, *, param_scan_axis: int = 1) -> dict[Path, int | None]:
    """The axis each leaf's layers are stacked on, or None outside scanned blocks.

    A Param uses its own ``param_scan_axis`` metadata (`Target.from_nnx`) or else
    ``param_scan_axis``; every other Variable uses 0; an ``opt_state`` moment uses
    the axis of the Param it mirrors. Keys are full items paths (module docstring).
    """
    leaves, _ = model_leaves(target, param_scan_axis, lengths=False)
    out = {PARAMS_ROOT + p: leaves[p].axis for p in target.params}
    out |= {AUX_ROOT + p: leaves[p].axis for p in target.nnx_aux}
    for p in target.opt_state or {}:
        hit = locate(OPT_ROOT + p, tuple(range(len(p) + 1)), leaves)
        out[OPT_ROOT + p] = hit.leaf.axis if hit else None
    return out


def layer_forms(leaf: ModelLeaf, n: int) -> tuple[tuple[int, ...] | None, tuple[int, ...]]:
    """(stacked, one-layer) stored shapes of a block leaf with ``n`` layers."""
    s, a = leaf.spec.shape, leaf.axis
    assert a is not None
    if leaf.stacked:
        return s, s[:a] + s[a + 1 :]
    # The target holds one value for all layers; its stacked form is the one a
    # scan that split it would have (None where the axis is past its rank).
    return (s[:a] + (n,) + s[a:] if a <= logical_rank(leaf.spec) else None), s


# -- where a tree leaf sits -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Hit:
    """The model leaf a tree path ends in, and where its layer's keys sit in that path."""

    leaf: ModelLeaf
    model: Path
    span: tuple[int, int] | None  # tree path positions of its layer's keys (the prefix)
    frame: tuple[Path, Path]  # tree keys before the model path, 'value' levels after it


def locate(path: Path, kept: tuple[int, ...], leaves: Mapping[Path, ModelLeaf]) -> Hit | None:
    """The longest model path the (unwrapped) tree path ends in; ``kept`` are the
    positions of ``path`` left once unwrapped (`rules.unwrapped_positions`)."""
    u = tuple(path[i] for i in kept)
    start = next((s for s in range(len(u)) if u[s:] in leaves), None)
    if start is None:
        return None
    leaf = leaves[u[start:]]
    span = None
    if leaf.prefix is not None:
        span = (kept[start], kept[start + len(leaf.prefix) - 1] + 1)
    return Hit(leaf, u[start:], span, (path[: kept[start]], path[kept[-1] + 1 :]))


def splice(path: Path, span: tuple[int, int], new: Path) -> Path:
    """``path`` with the keys at positions ``span`` replaced by ``new``."""
    return (*path[: span[0]], *new, *path[span[1] :])
