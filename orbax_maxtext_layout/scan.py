"""Scanned layer blocks: the axis each leaf's layers are stacked on, and (un)stacking.

MaxText's ``scan_layers=True`` keeps all decoder layers in one stacked block
(DOMAIN.md section 6): an ``nnx.Param`` has its layers at its
``param_scan_axis`` (usually 1), every other Variable (RNG counts and keys,
custom Variables) at axis 0, and optimizer moments (``mu``/``nu``, ...) at the
axis of the Param they mirror. The axis always comes from the model (a
`Target`), never from a leaf's rank: rank rules are what crashed earlier
unrollers on ``(L,)`` counts, raw ``(L, 2)`` keys, rank-2 custom Variables,
unstacked scalars and models past 256 layers (DOMAIN.md section 9, 22-28).

**Blocks.** A scanned block is the model subtree under a key in `SCAN_GROUPS`
(the outermost one on a path): Llama ``decoder/layers``; Gemma3 ``layers``,
whose ``layers_<k>`` sub-layers belong to each scan step (the unscanned
``layers_remainder`` is no block); DeepSeek ``dense_layers`` and
``moe_layers``; Gemma4/DeepSeek ``scanned_blocks``. Unrolled, scan step ``i``
of group ``g`` is named ``g_<i>``, as in MaxText's unscanned models.

**Paths.** `scan_axes` is keyed by full items paths: ``("params", "params",
*model)``, ``("nnx_aux", "model", *model)`` and ``("opt_state", *path)``. The
tree functions take pure trees in any layout whose leaf paths *end* in a model
path (MaxText items; Tunix ``model_params`` with its ``base/`` adapter and
``value`` levels; optimizer states, whose moments mirror the Params) and keep
that layout; only the group key changes (``layers`` <-> ``layers_<i>``).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import rules as R
from .errors import LayoutMismatchError
from .rng import fresh_rng, is_rng
from .spec import LeafSpec, spec_of
from .target import AUX_ROOT, OPT_ROOT, PARAMS_ROOT, Target
from .treepaths import FlatTree, Path, flatten, keystr, unflatten

__all__ = [
    "SCAN_GROUPS",
    "StackReport",
    "layer_of",
    "scan_axes",
    "stack",
    "stack_target",
    "unroll",
    "unroll_target",
    "unstack_layer",
]

SCAN_GROUPS: tuple[str, ...] = ("layers", "dense_layers", "moe_layers", "scanned_blocks")
_UNROLLED = re.compile(rf"^({'|'.join(SCAN_GROUPS)})_(\d+)$")


def layer_of(key: str | int) -> tuple[str, int] | None:
    """``(group, i)`` of an unrolled layer key ``<group>_<i>`` (``layers_0``,
    ``moe_layers_3``), or None for any other key: the one parser of layer keys."""
    m = _UNROLLED.match(key) if isinstance(key, str) else None
    return (m[1], int(m[2])) if m else None


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
    axis: int | None  # layer axis; None outside scanned blocks
    block: Path | None  # model path of its scanned group, e.g. ("decoder", "layers")

    @property
    def stacked(self) -> bool:
        """False when the target holds one value for all layers (a scan-broadcast scalar)."""
        assert self.axis is not None
        return _rank(self.spec) > self.axis


def _rank(spec: LeafSpec) -> int:
    return len(spec.shape) - (1 if spec.key_impl else 0)


def _block(path: Path) -> Path | None:
    for i, k in enumerate(path):
        # A group holding a list (``layers/0/...``, NNX unscanned decoders) is no block.
        nxt = path[i + 1] if i + 1 < len(path) else None
        if k in SCAN_GROUPS and not (isinstance(nxt, int) or str(nxt).isdigit()):
            return path[: i + 1]
    return None


def _model_leaves(target: Target, param_scan_axis: int) -> dict[Path, _Leaf]:
    out: dict[Path, _Leaf] = {}
    for p, s in target.params.items():
        b = _block(p)
        axis = target.param_scan_axes.get(p, param_scan_axis) if b else None
        out[p] = _Leaf(s, param=True, rng=False, axis=axis, block=b)
    for p, s in target.nnx_aux.items():
        b = _block(p)
        out[p] = _Leaf(s, param=False, rng=is_rng(p), axis=0 if b else None, block=b)
    return out


def _lengths(leaves: Mapping[Path, _Leaf], num_layers: int | None) -> dict[Path, int]:
    """Scan length of every block, from its stacked leaves (checked against ``num_layers``)."""
    sizes: dict[Path, dict[int, list[Path]]] = defaultdict(lambda: defaultdict(list))
    for p, leaf in leaves.items():
        if leaf.block is not None:
            found = sizes[leaf.block]  # a block with no stacked leaf still gets an entry
            if leaf.stacked:
                found[leaf.spec.shape[leaf.axis]].append(p)
    out, problems = {}, []
    for block, found in sizes.items():
        if len(found) == 1 and num_layers in (None, *found):
            out[block] = next(iter(found))
        elif not found and num_layers is not None:
            out[block] = num_layers
        elif not found:
            problems.append(f"{keystr(block)}: no leaf is stacked; pass num_layers")
        else:
            seen = "; ".join(f"{n} layers at {keystr(ps[0])}" for n, ps in found.items())
            want = f" (num_layers={num_layers})" if num_layers is not None else ""
            problems.append(f"{keystr(block)}: leaves disagree on the scan length{want}: {seen}")
    if problems:
        raise LayoutMismatchError("Cannot tell the number of scanned layers:", problems)
    return out


def scan_axes(target: Target, *, param_scan_axis: int = 1) -> dict[Path, int | None]:
    """The axis each leaf's layers are stacked on, or None outside scanned blocks.

    A Param uses its own ``param_scan_axis`` metadata (`Target.from_nnx`) or else
    ``param_scan_axis``; every other Variable uses 0; an ``opt_state`` moment uses
    the axis of the Param it mirrors. Keys are full items paths (module docstring).
    """
    leaves = _model_leaves(target, param_scan_axis)
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
    at: int | None  # index of the scanned group key in the tree path
    frame: tuple[Path, Path]  # tree keys before the model path, 'value' levels after it


def _hit(path: Path, kept: tuple[int, ...], leaves: Mapping[Path, _Leaf]) -> _Hit | None:
    """The longest model path the (unwrapped) tree path ends in."""
    u = tuple(path[i] for i in kept)
    start = next((s for s in range(len(u)) if u[s:] in leaves), None)
    if start is None:
        return None
    leaf = leaves[u[start:]]
    at = kept[start + len(leaf.block) - 1] if leaf.block else None
    return _Hit(leaf, u[start:], at, (path[: kept[start]], path[kept[-1] + 1 :]))


def _rename(path: Path, at: int, name: str) -> Path:
    return (*path[:at], name, *path[at + 1 :])


def _unrolled_key(path: Path, kept: tuple[int, ...]) -> tuple[int, str, int] | None:
    """(position, group, layer) of the first ``<group>_<i>`` key of a path."""
    for pos in kept:
        if hit := layer_of(path[pos]):
            return pos, *hit
    return None


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
    leaves = _model_leaves(target, param_scan_axis)
    lengths = _lengths(leaves, num_layers)
    out: FlatTree = {}
    problems: list[str] = []
    for p, x in flat.items():
        hit = _hit(p, kept[p], leaves)
        if hit is None or hit.leaf.block is None:
            if hit is None and any(k in SCAN_GROUPS for k in p):
                problems.append(f"{keystr(p)}: in a scanned block but not in the target")
            elif only is None:
                out[p] = x
            continue
        assert hit.at is not None and hit.leaf.axis is not None
        n = lengths[hit.leaf.block]
        stacked = _fit(p, x, hit.leaf, n, problems)
        if stacked is None:
            continue
        for i in range(n) if only is None else range(only, min(only + 1, n)):
            name = f"{p[hit.at]}_{i}"
            out[_rename(p, hit.at, name)] = _take(x, hit.leaf.axis, i) if stacked else x
    _raise(problems, "The tree does not fit the target's scanned layout", _HINT)
    return out


def unroll(
    tree: Any, target: Target, *, num_layers: int | None = None, param_scan_axis: int = 1
) -> Any:
    """A scanned tree as ``<group>_0 … <group>_{L-1}``, each leaf sliced on its own axis.

    Args:
      tree: pure nested dicts/lists of arrays (layouts in the module docstring).
      target: the *scanned* model's Target; it decides every leaf's axis and length.
      num_layers: the scan length, for a block none of whose target leaves is
        stacked; otherwise checked against the target.
      param_scan_axis: the Param axis where the target carries no metadata.

    A leaf the target says is per-layer but that holds one value (a scan-broadcast
    scalar) is replicated once per layer. Raises `LayoutMismatchError` naming every
    leaf inside a block the target does not know, or whose shape fits neither form.
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
    """Scan step ``i`` of every block (``…/layers_<i>/…``) without touching other layers.

    Leaves are sliced by basic indexing, so numpy inputs give views, jax inputs
    one slice, and lazy array readers (anything with ``shape``, ``dtype`` and
    ``__getitem__``, e.g. a ``tensorstore.TensorStore``) read nothing yet. Blocks
    shorter than ``i + 1`` (DeepSeek ``dense_layers``) contribute nothing.
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
    """The inverse of `unroll`: ``<group>_<i>`` leaves stacked back onto the target's axes.

    ``nnx_aux`` follows the *target's* paths: an RNG leaf (or some layers of it)
    that the unscanned tree lacks is initialised and listed in the `StackReport`;
    a missing custom Variable, a missing layer of a Param, or a layer beyond the
    target's length raises `LayoutMismatchError`. Fresh RNG state is what
    ``convert --stack`` writes for the same leaf (`rng.fresh_rng`: count 0, a key
    derived from the leaf's items path and layer), with ``rng_seed`` folded in when
    it is not 0.
    """
    leaves = _model_leaves(target, param_scan_axis)
    run = _Stacking(leaves, _lengths(leaves, num_layers), rng_seed)
    parts, seen = run.sort(_flat(tree))
    for path, (hit, got) in parts.items():
        run.family(path, hit, got)
    run.never_had(seen)
    _raise(run.problems, "The tree does not stack onto the target", _HINT)
    return unflatten(run.out), StackReport(run.fresh)


_Parts = dict[Path, tuple[_Hit, dict[int, Any]]]  # stacked tree path -> (its hit, {layer: leaf})
_Seen = dict[tuple[Path, Path], set[Path]]  # a tree frame -> the non-Param model paths it holds


@dataclasses.dataclass
class _Stacking:
    """One `stack` call: what the target says, and the stacked leaves made so far."""

    leaves: Mapping[Path, _Leaf]
    lengths: Mapping[Path, int]
    seed: int
    out: FlatTree = dataclasses.field(default_factory=dict)
    fresh: dict[Path, tuple[int, ...] | None] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)

    def sort(self, flat: FlatTree) -> tuple[_Parts, _Seen]:
        """Leaves outside blocks go to ``out`` as they are; per-layer leaves are grouped
        under their stacked path."""
        kept = R.unwrapped_positions(flat)
        parts: _Parts = {}
        seen: _Seen = defaultdict(set)
        for p, x in flat.items():
            hit = _hit(p, kept[p], self.leaves)
            if hit is not None and hit.leaf.block is None:
                self.out[p] = x
            elif hit is not None:
                self.problems.append(f"{keystr(p)}: already stacked")
                continue
            elif (u := _unrolled_key(p, kept[p])) is None:
                self.out[p] = x  # no model leaf (optimizer counts, step, ...)
                continue
            else:
                pos, group, i = u
                hit = _hit(_rename(p, pos, group), kept[p], self.leaves)
                if hit is None or hit.at != pos:
                    self.problems.append(f"{keystr(p)}: a per-layer leaf the target does not have")
                    continue
                parts.setdefault(_rename(p, pos, group), (hit, {}))[1][i] = x
            if not hit.leaf.param:
                seen[hit.frame].add(hit.model)
        return parts, seen

    def family(self, path: Path, hit: _Hit, got: dict[int, Any]) -> None:
        """The layers ``got`` of one leaf stacked at ``path``; missing RNG layers made fresh."""
        leaf = hit.leaf
        assert leaf.block is not None and hit.at is not None
        n = self.lengths[leaf.block]
        one = _forms(leaf, n)[1]
        before = len(self.problems)
        for i, x in got.items():
            where = keystr(_rename(path, hit.at, f"{path[hit.at]}_{i}"))
            if i >= n:
                self.problems.append(f"{where}: layer {i} is beyond the target's {n} layers")
            elif _stored_shape(x) != one:
                self.problems.append(
                    f"{where}: found {list(_stored_shape(x))}, expected {list(one)}"
                )
        missing = tuple(i for i in range(n) if i not in got)
        if not leaf.stacked:  # one value for all layers: any layer holding it is enough
            missing, got = (), {i: next(iter(got.values())) for i in range(n)} | got
        if missing and not leaf.rng:
            self.problems.append(f"{keystr(path)}: layers {list(missing)} missing")
        if len(self.problems) > before:
            return
        like = next(iter(got.values()))
        for i in missing:
            got[i] = self.new_rng(leaf, one, hit.model, i, like)
        if missing:
            self.fresh[path] = missing
        self.out[path] = _join([got[i] for i in range(n)], leaf, path, self.problems)

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
                elif leaf.block is None:
                    self.out[path] = self.new_rng(leaf, leaf.spec.shape, m, 0, None)
                    self.fresh[path] = None
                else:
                    n = self.lengths[leaf.block]
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
    )


def unroll_target(
    target: Target, *, num_layers: int | None = None, param_scan_axis: int = 1
) -> Target:
    """The unscanned Target of a scanned one (``layers`` -> ``layers_<i>``, per-layer specs).

    Params keep their ``param_scan_axis`` metadata under the new paths, so that
    `stack_target` restores it; abstract leaves lose their shardings.
    """
    leaves = _model_leaves(target, param_scan_axis)
    lengths = _lengths(leaves, num_layers)
    specs: dict[Path, LeafSpec] = {}
    abstract: FlatTree = {}
    axes: dict[Path, int] = {}
    for p, s in _full_specs(target).items():
        hit = _hit(p, tuple(range(len(p))), leaves)
        if hit is None or hit.leaf.block is None:
            specs[p] = s
            if p in target.abstract:
                abstract[p] = target.abstract[p]
            continue
        assert hit.at is not None and hit.leaf.axis is not None
        n, a = lengths[hit.leaf.block], hit.leaf.axis
        one = dataclasses.replace(s, shape=_forms(hit.leaf, n)[1])
        like = target.abstract.get(p)
        for i in range(n):
            q = _rename(p, hit.at, f"{p[hit.at]}_{i}")
            specs[q] = one
            abstract[q] = _abstract(like, one, one.shape[: _rank(one)])
            if p[:2] == PARAMS_ROOT and hit.model in target.param_scan_axes:
                axes[q[2:]] = a
    inter = set()
    for p in target.intermediates:
        b = _block(p)
        n = lengths.get(b, 0) if b else 0
        inter |= {_rename(p, len(b) - 1, f"{b[-1]}_{i}") for i in range(n)} if b and n else {p}
    return _build(target, specs, abstract, inter, axes)


def stack_target(target: Target, *, param_scan_axis: int = 1) -> Target:
    """The scanned Target of an unscanned one: every ``<group>_<i>`` family stacked.

    Params go on their ``param_scan_axis`` metadata (else ``param_scan_axis``),
    other Variables on 0, moments on their Param's axis. An RNG leaf held by some
    layers only (a shared stream) is stacked over all of them; a Param or custom
    Variable missing from a layer raises. A real scanned model is a better target
    where one exists: only it knows state the unscanned model lacks (``decoder/rngs``).
    """
    full = _full_specs(target)
    groups: dict[Path, dict[int, Path]] = defaultdict(dict)  # stacked path -> {i: path}
    blocks: dict[Path, Path] = {}  # stacked path -> its group's stacked path
    specs: dict[Path, LeafSpec] = {}
    abstract: FlatTree = {}
    for p, s in full.items():
        u = _unrolled_key(p, tuple(range(len(p))))
        if u is None:
            specs[p] = s
            if p in target.abstract:
                abstract[p] = target.abstract[p]
            continue
        pos, group, i = u
        sp = _rename(p, pos, group)
        groups[sp][i] = p
        blocks[sp] = sp[: pos + 1]
    lengths: dict[Path, int] = defaultdict(int)
    for sp, layers in groups.items():
        lengths[blocks[sp]] = max(lengths[blocks[sp]], max(layers) + 1)
    # A block's length is the model's: MaxText's unscanned model stores a shared RNG stream
    # once, in layers_0 (NNX keeps a shared Variable at its first path), so its nnx_aux
    # alone would say one layer.
    model = {b[2:]: n for b, n in lengths.items() if b[:2] == PARAMS_ROOT}
    for b in lengths:
        if b[:2] == AUX_ROOT and b[2:] in model:
            lengths[b] = max(lengths[b], model[b[2:]])

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
    for sp, layers in groups.items():
        s, n, a = full[first(sp)], lengths[blocks[sp]], axis_of(sp)
        missing = [i for i in range(n) if i not in layers]
        differ = [keystr(q) for q in layers.values() if full[q] != s]
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
        u = _unrolled_key(p, tuple(range(len(p))))
        inter.add(_rename(p, u[0], u[1]) if u else p)
    return _build(target, specs, abstract, inter, kept_axes)
