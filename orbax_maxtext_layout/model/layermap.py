"""The layer map: which subtrees of a scanned model are scans, and what each layer is called
once unrolled.

MaxText 0.2.5 builds a model's decoder layers scanned (``scan_layers=true``) in one of a few
forms, and unscanned as ``<group>_<i>`` modules (FAMILIES_AND_SCALE, DOMAIN.md section 6):

- **a plain scan** ``decoder/layers`` (llama, qwen, mistral, mixtral, gemma2): scan step ``i``
  is the unscanned ``decoder/layers_<i>``;
- **a block scan** ``decoder/layers/layers_0 … layers_<B-1>`` (gemma3, gpt-oss, llama4): each
  scan step runs ``B`` sub-layers, so step ``r`` of sub-layer ``k`` is ``decoder/layers_<r·B+k>``;
  the layers past the last whole block are stored per layer at
  ``decoder/layers_remainder/layers_<j>``, which is ``decoder/layers_<n·B+j>`` unscanned;
- **several scans** ``dense_layers`` and ``moe_layers`` (deepseek), each unrolled from 0;
- gemma4's block scan ``scanned_blocks``, whose layers unroll as ``layers_<i>``.

A `LayerMap` lists every `Layer`: its module path in the scanned model, its scan step, and
its module path in the unscanned model. It is built from a scanned model's paths and the
layer axis of each leaf (`infer`), and, where MaxText's own unscanned model is at hand,
checked against it path by path and shape by shape (`check`): the model decides, the names
only propose.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping

from ..base.treepaths import Path, keystr
from ..errors import LayoutMismatchError

__all__ = [
    "SCAN_GROUPS",
    "Layer",
    "LayerMap",
    "Scan",
    "check",
    "from_forms",
    "group_at",
    "infer",
    "layer_of",
    "plain",
    "scanned_form",
]

SCAN_GROUPS: tuple[str, ...] = ("layers", "dense_layers", "moe_layers", "scanned_blocks")
# The unscanned name of a scan group's layers, where it is not the group's own name.
_UNROLLED_NAME = {"scanned_blocks": "layers"}
_UNROLLED = re.compile(rf"^({'|'.join(SCAN_GROUPS)})_(\d+)$")
_SUBLAYER = re.compile(r"^layers_(\d+)$")
_REMAINDER = "_remainder"


def layer_of(key: str | int) -> tuple[str, int] | None:
    """``(group, i)`` of an unrolled layer key ``<group>_<i>`` (``layers_0``,
    ``moe_layers_3``), or None for any other key."""
    m = _UNROLLED.match(key) if isinstance(key, str) else None
    return (m[1], int(m[2])) if m else None


@dataclasses.dataclass(frozen=True)
class Scan:
    """One scanned module of the model.

    Attributes:
      path: its model path (``("decoder", "layers")``).
      length: its scan steps.
      block: sub-layers per scan step (``layers_0 … layers_<block-1>``), 0 for a plain scan.
      unrolled: the parent and name of its layers unscanned (``("decoder", "layers")``: they
        are ``decoder/layers_<i>``).
    """

    path: Path
    length: int
    block: int
    unrolled: Path

    @property
    def layers(self) -> int:
        """Unscanned layers it holds."""
        return self.length * max(self.block, 1)


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer of the model in both forms.

    ``stacked`` is its module path in the scanned model: the scan's path (plain scan), a
    sub-layer of it (block scan), or a remainder layer stored per layer in both forms.
    ``index`` is its scan step (None for a remainder layer), ``unrolled`` its module path in
    the unscanned model, ``scan`` the scan it is a step of.
    """

    stacked: Path
    index: int | None
    unrolled: Path
    scan: Scan | None


@dataclasses.dataclass(frozen=True)
class LayerMap:
    """Every layer of a model, scanned and unscanned (module docstring)."""

    scans: tuple[Scan, ...] = ()
    layers: tuple[Layer, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.layers)

    def scan_at(self, model: Path) -> Scan | None:
        """The scan a scanned model path lies in, or None."""
        return next((s for s in self.scans if model[: len(s.path)] == s.path), None)

    def stacked_prefix(self, model: Path) -> Path | None:
        """The part of a scanned model path that names its layer(s): a scan's path, a block
        scan's sub-layer, or a remainder layer; None outside every layer."""
        hit = self.find_stacked(model, at=0)
        return hit[1] if hit else None

    def of_stacked(self, prefix: Path) -> tuple[Layer, ...]:
        """The layers stored under a `stacked_prefix`, in scan-step order."""
        return self._by_stacked().get(prefix, ())

    def find_unrolled(self, keys: Path) -> tuple[int, Layer] | None:
        """``(position, layer)`` of the first unscanned layer path inside ``keys`` (a tree
        path without its ``value`` levels, whatever frame precedes the model path)."""
        index = self._by_unrolled()
        for s in range(len(keys)):
            for n in self._unrolled_lengths():
                layer = index.get(keys[s : s + n])
                if layer is not None:
                    return s, layer
        return None

    def find_stacked(self, keys: Path, at: int | None = None) -> tuple[int, Path] | None:
        """``(position, stacked prefix)`` of the first scanned layer path inside ``keys``
        (only at position ``at`` if given)."""
        index = self._by_stacked()
        lengths = sorted({len(p) for p in index}, reverse=True)
        for s in range(len(keys)) if at is None else (at,):
            for n in lengths:
                if keys[s : s + n] in index:
                    return s, keys[s : s + n]
        return None

    def past_end(self, keys: Path) -> tuple[int, int] | None:
        """``(i, n)`` where ``keys`` name layer ``i`` of a layer group that has only ``n``."""
        counts: dict[Path, int] = defaultdict(int)
        for la in self.layers:
            counts[(*la.unrolled[:-1], layer_of(la.unrolled[-1])[0])] += 1  # type: ignore[index]
        for group, n in counts.items():
            m = len(group) - 1
            for s in range(m, len(keys)):
                hit = layer_of(keys[s])
                if keys[s - m : s] == group[:-1] and hit and hit[0] == group[-1] and hit[1] >= n:
                    return hit[1], n
        return None

    def describe(self) -> list[str]:
        """One line per scan and per remainder layer, for reports."""
        lines = []
        for s in self.scans:
            name = keystr((*s.unrolled[:-1], f"{s.unrolled[-1]}_<i>"))
            form = f"blocks of {s.block} sub-layers" if s.block else "one layer a step"
            lines.append(f"{keystr(s.path)}: {s.length} scan steps, {form} -> {name}")
        for la in self.layers:
            if la.index is None:
                lines.append(f"{keystr(la.stacked)}: stored per layer -> {keystr(la.unrolled)}")
        return lines

    # -- indexes (derived; a LayerMap is small and immutable) --------------------------------
    def _by_stacked(self) -> dict[Path, tuple[Layer, ...]]:
        got = self.__dict__.get("_stacked")
        if got is None:
            acc: dict[Path, list[Layer]] = defaultdict(list)
            for la in self.layers:
                acc[la.stacked].append(la)
            got = {p: tuple(sorted(v, key=lambda la: la.index or 0)) for p, v in acc.items()}
            object.__setattr__(self, "_stacked", got)
        return got

    def _by_unrolled(self) -> dict[Path, Layer]:
        got = self.__dict__.get("_unrolled")
        if got is None:
            got = {la.unrolled: la for la in self.layers}
            object.__setattr__(self, "_unrolled", got)
        return got

    def _unrolled_lengths(self) -> list[int]:
        return sorted({len(p) for p in self._by_unrolled()}, reverse=True)


def group_at(path: Path) -> int | None:
    """Position of the first scan group key (`SCAN_GROUPS`) of a path, or None.

    A group holding a list (``layers/0/...``, NNX's unscanned decoders) is no scan.
    """
    for i, k in enumerate(path):
        nxt = path[i + 1] if i + 1 < len(path) else None
        if k in SCAN_GROUPS and not (isinstance(nxt, int) or str(nxt).isdigit()):
            return i
    return None


def scanned_form(paths: Iterable[Path]) -> bool | None:
    """Whether a tree's layers are stored scanned: True if it holds a scan group (``layers``,
    gemma3's ``layers/layers_<k>`` too), False if only per-layer keys (``layers_<i>``, or a
    list ``layers/0``), None if neither. The one reader of a tree's scan form."""
    unrolled = False
    for p in paths:
        if group_at(p) is not None:
            return True
        unrolled = unrolled or any(
            layer_of(k) is not None or (k in SCAN_GROUPS and str(n).isdigit())
            for k, n in zip(p, (*p[1:], None), strict=True)
        )
    return False if unrolled else None


def _remainder_at(path: Path) -> tuple[int, str, int] | None:
    """(position, unrolled name, j) of ``<name>_remainder/layers_<j>`` in a path."""
    for i, k in enumerate(path[:-1]):
        if isinstance(k, str) and k.endswith(_REMAINDER):
            name = k[: -len(_REMAINDER)]
            m = _SUBLAYER.match(str(path[i + 1]))
            if name in SCAN_GROUPS and m:
                return i, _UNROLLED_NAME.get(name, name), int(m[1])
    return None


def _structure(
    paths: Iterable[Path],
) -> tuple[dict[Path, set[int]], dict[tuple[Path, str], set[int]]]:
    """The scans of a scanned model's paths (each with its sub-layer numbers, empty for a
    plain scan) and its remainder layers (by parent and unrolled name)."""
    blocks: dict[Path, set[int]] = {}
    remainders: dict[tuple[Path, str], set[int]] = defaultdict(set)
    for p in paths:
        if (rem := _remainder_at(p)) is not None:
            i, name, j = rem
            remainders[(p[:i], name)].add(j)
            continue
        i = group_at(p)
        if i is None:
            continue
        sub = blocks.setdefault(p[: i + 1], set())
        if i + 1 < len(p) - 1 and (m := _SUBLAYER.match(str(p[i + 1]))):
            sub.add(int(m[1]))
    return blocks, remainders


def _scans(
    blocks: Mapping[Path, set[int]], lengths: Mapping[Path, int | None], problems: list[str]
) -> list[Scan]:
    scans = []
    for group, b in blocks.items():
        if b and b != set(range(len(b))):
            problems.append(f"{keystr(group)}: sub-layers {sorted(b)} are not layers_0..k")
        name = _UNROLLED_NAME.get(str(group[-1]), str(group[-1]))
        n = lengths.get(group)
        if n is not None:
            scans.append(Scan(group, n, len(b), (*group[:-1], name)))
    return scans


def infer(
    leaves: Mapping[Path, tuple[tuple[int, ...], int]],
    num_layers: int | None = None,
    *,
    lengths: bool = True,
) -> LayerMap:
    """The layer map of a scanned model, from its model paths.

    ``leaves`` maps every model path (params and nnx_aux, no ``value`` levels) to its
    logical shape and its layer axis (a Param's ``param_scan_axis``, 0 for other
    Variables). A leaf whose rank does not reach its axis holds one value for every layer.
    The scan length is read from the stacked leaves' shapes (``num_layers`` for a scan none
    of whose leaves is stacked); leaves that disagree raise `LayoutMismatchError`.
    ``lengths=False`` reads only which leaves are in which scan (e.g. for their axes),
    not how long the scans are (each is then 0 steps long).
    """
    blocks, remainders = _structure(leaves)
    found: dict[Path, dict[int, list[Path]]] = {g: defaultdict(list) for g in blocks}
    for p, (shape, axis) in leaves.items():
        i = group_at(p) if _remainder_at(p) is None else None
        if i is not None and len(shape) > axis:
            found[p[: i + 1]][shape[axis]].append(p)
    problems: list[str] = []
    sizes = {g: _length(g, f, num_layers, problems) if lengths else 0 for g, f in found.items()}
    scans = _scans(blocks, sizes, problems)
    if problems:
        raise LayoutMismatchError("Cannot tell the scanned layers of the model:", problems)
    return _assemble(scans, remainders)


def from_forms(stacked: Iterable[Path], unrolled: Iterable[Path]) -> LayerMap:
    """The layer map read off a model's two forms, without shapes or axes: the scans, their
    sub-layers and remainder layers from the scanned model's paths (e.g. a scanned
    checkpoint's), how many layers each group has from the unscanned model's (e.g. the
    unscanned target). Model paths, without ``value`` levels or adapter frames."""
    blocks, remainders = _structure(stacked)
    counts: dict[Path, int] = defaultdict(int)
    for p in unrolled:
        for i, k in enumerate(p):
            if (hit := layer_of(k)) is not None:
                group = (*p[:i], hit[0])
                counts[group] = max(counts[group], hit[1] + 1)
                break
    problems: list[str] = []
    sizes: dict[Path, int | None] = {}
    for g, b in blocks.items():
        name = (*g[:-1], _UNROLLED_NAME.get(str(g[-1]), str(g[-1])))
        rest = counts.get(name, 0) - len(remainders.get((g[:-1], name[-1]), ()))
        steps, extra = divmod(rest, max(len(b), 1))
        sizes[g] = steps
        if extra or steps <= 0:
            problems.append(
                f"{keystr(g)}: the unscanned model has {counts.get(name, 0)} layers "
                f"{keystr(name)}_<i>, which do not fill its blocks of {max(len(b), 1)}"
            )
    scans = _scans(blocks, sizes, problems)
    if problems:
        raise LayoutMismatchError("The two forms of the model do not correspond:", problems)
    return _assemble(scans, remainders)


def _length(
    group: Path, sizes: Mapping[int, list[Path]], num_layers: int | None, problems: list[str]
) -> int | None:
    if len(sizes) == 1 and num_layers in (None, *sizes):
        return next(iter(sizes))
    if not sizes and num_layers is not None:
        return num_layers
    if not sizes:
        problems.append(f"{keystr(group)}: no leaf is stacked; pass num_layers")
        return None
    seen = "; ".join(f"{n} layers at {keystr(ps[0])}" for n, ps in sizes.items())
    want = f" (num_layers={num_layers})" if num_layers is not None else ""
    problems.append(f"{keystr(group)}: leaves disagree on the scan length{want}: {seen}")
    return None


def _assemble(scans: list[Scan], remainders: Mapping[tuple[Path, str], set[int]]) -> LayerMap:
    layers: list[Layer] = []
    offset: dict[Path, int] = defaultdict(int)  # unrolled parent+name -> layers so far
    named: dict[Path, list[Scan]] = defaultdict(list)
    for s in scans:
        named[s.unrolled].append(s)
    bad = [
        f"{keystr(u)}_<i>: the unrolled name of {' and '.join(keystr(s.path) for s in ss)}"
        for u, ss in named.items()
        if len(ss) > 1
    ]
    if bad:  # which comes first is not in the names
        raise LayoutMismatchError("Two scanned layer groups unroll to one name:", bad)
    for s in sorted(scans, key=lambda s: keystr(s.path)):
        base = offset[s.unrolled]
        for r in range(s.length):
            for k in range(max(s.block, 1)):
                stacked = (*s.path, f"layers_{k}") if s.block else s.path
                name = f"{s.unrolled[-1]}_{base + r * max(s.block, 1) + k}"
                layers.append(Layer(stacked, r, (*s.unrolled[:-1], name), s))
        offset[s.unrolled] = base + s.layers
    for (parent, name), js in sorted(remainders.items(), key=lambda kv: keystr(kv[0][0])):
        base = offset[(*parent, name)]
        for j in sorted(js):
            stacked = (*parent, f"{name}{_REMAINDER}", f"layers_{j}")
            layers.append(Layer(stacked, None, (*parent, f"{name}_{base + j}"), None))
    return LayerMap(tuple(scans), tuple(layers))


def plain(unrolled_paths: Iterable[Path]) -> LayerMap:
    """The layer map of an unscanned model read as plain scans: every ``<group>_<i>`` family
    one scan ``<group>`` (what an unscanned tree alone can tell; a block-scanned model needs
    its scanned form or MaxText's config)."""
    families: dict[Path, set[int]] = defaultdict(set)
    for p in unrolled_paths:
        for i, k in enumerate(p):
            if (hit := layer_of(k)) is not None:
                families[(*p[:i], hit[0])].add(hit[1])
                break
    scans = [Scan(g, max(ix) + 1, 0, g) for g, ix in families.items()]
    return _assemble(scans, {})


def check(
    layer_map: LayerMap,
    scanned: Mapping[Path, tuple[int, ...]],
    unscanned: Mapping[Path, tuple[int, ...]],
    axes: Mapping[Path, int],
) -> None:
    """Checks a layer map against the model's two forms: every scanned weight, unrolled,
    is a weight of the unscanned model with the shape of one layer of it, and every
    unscanned weight is reached. ``scanned``/``unscanned`` map the weights' model paths to
    their shapes, ``axes`` the scanned ones to their layer axes. Raises
    `LayoutMismatchError` naming every path that does not fit.
    """
    reached: set[Path] = set()
    problems = []
    for p, shape in scanned.items():
        prefix = layer_map.stacked_prefix(p)
        if prefix is None:
            targets = [(p, shape)]
        else:
            a = axes.get(p)
            one = shape if a is None or a >= len(shape) else shape[:a] + shape[a + 1 :]
            rest = p[len(prefix) :]
            if layer_map.of_stacked(prefix)[0].index is None:
                one = shape
            targets = [((*la.unrolled, *rest), one) for la in layer_map.of_stacked(prefix)]
        for q, want in targets:
            if q not in unscanned:
                problems.append(f"{keystr(p)} -> {keystr(q)}: not in the unscanned model")
            elif tuple(unscanned[q]) != tuple(want):
                problems.append(
                    f"{keystr(p)} -> {keystr(q)}: {list(want)}, the unscanned model has "
                    f"{list(unscanned[q])}"
                )
            reached.add(q)
    problems += [
        f"{keystr(q)}: in the unscanned model, reached by no scanned weight"
        for q in sorted(set(unscanned) - reached, key=keystr)
    ]
    if problems:
        raise LayoutMismatchError(
            "The scanned and unscanned forms of the model do not correspond layer by layer:",
            problems,
            hint="This model's scan form is not one this library knows; please report it.",
        )
