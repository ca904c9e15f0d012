"""LoRA adapter steps: recognise them from metadata, and refuse to drop them.

With LoRA on, Tunix's ``PeftTrainer`` (MaxText 0.2.5's ``train_sft``, Tunix's RL
and distillation trainers) saves only the adapters: ``model_params`` holds the
qwix factors ``<weight>_lora_a`` / ``<weight>_lora_b`` of each adapted module
(``nnx.LoRAParam``, with a ``value`` level) and nothing else: no base weight, no
RNG state, no rank or alpha in the step's metadata.

Such a step is not a model. Converting or restoring it against a target that has
no place for the adapters would keep nothing of it (a restore of MaxText's
pre-training target reads only ``step``), so every planner refuses it with one
error (`LoraAdapterStepError`) that names the step, its modules and rank, and the
two ways forward. `merge` folds the adapters into a base checkpoint.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from etils import epath

from ..base.treepaths import Path, keystr
from ..errors import LayoutMismatchError
from ..orbax_io.spec import LeafSpec, read_specs
from . import rules as R
from .layermap import group_at
from .rules import ADAPTER_KEY

_FACTOR = re.compile(r"^(?P<weight>.+)_lora_(?P<which>[ab])$")
# The qwix factor of the einsum/dot_general weight `weight`: `weight_lora_a` (in, r) and
# `weight_lora_b` (r, out), each with the layer axis of the weight when scanned.


@dataclasses.dataclass(frozen=True)
class Factors:
    """The two factors of one adapted weight, as stored (model paths, no ``value`` level).

    ``weight`` is the path of the weight they adapt (e.g. ``decoder/layers/mlp/wo/kernel``);
    ``a``/``b`` are the factors' source paths in ``model_params`` (with ``value``).
    """

    weight: Path
    a: Path
    b: Path
    a_spec: LeafSpec
    b_spec: LeafSpec


@dataclasses.dataclass(frozen=True)
class LoraAdapters:
    """What a LoRA adapter step holds, from metadata alone.

    ``layer_axis`` is the axis the scanned factors stack their layers on, inferred
    from their shapes (None when unscanned, or when the shapes allow either axis:
    a merge takes it from the base kernel). ``alpha`` is what the step records
    (MaxText's ``custom_metadata["lora"]["lora_alpha"]``), else None: Tunix records
    neither rank nor alpha.
    """

    factors: tuple[Factors, ...]
    rank: int
    layer_axis: int | None
    num_layers: int | None
    dtype: str
    scanned: bool
    alpha: float | None = None

    @property
    def modules(self) -> list[str]:
        """The adapted modules (paths of the weights' parents), sorted."""
        return sorted({keystr(f.weight[:-1]) for f in self.factors})

    @property
    def nbytes(self) -> int:
        return sum(f.a_spec.nbytes + f.b_spec.nbytes for f in self.factors)

    def describe(self) -> str:
        """One line: the modules, rank, layer axis and dtype."""
        axis = (
            "unscanned"
            if not self.scanned
            else f"layer axis {self.layer_axis}, {_steps(self.num_layers)}"
            if self.layer_axis is not None
            else f"scanned, {_steps(self.num_layers)}"
        )
        alpha = f", alpha {self.alpha:g}" if self.alpha is not None else ""
        return (
            f"LoRA adapters: {len(self.factors)} adapted weights in {len(self.modules)} "
            f"modules, rank {self.rank}{alpha}, {axis}, {self.dtype}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "modules": self.modules,
            "weights": [keystr(f.weight) for f in self.factors],
            "rank": self.rank,
            "alpha": self.alpha,
            "layer_axis": self.layer_axis,
            "num_layers": self.num_layers,
            "scanned": self.scanned,
            "dtype": self.dtype,
            "leaves": 2 * len(self.factors),
            "bytes": self.nbytes,
            "base_weights": False,
        }


class LoraAdapterStepError(LayoutMismatchError):
    """A LoRA adapter step was asked for where its adapters have no place.

    Raised before anything is read, written or moved. ``adapters`` is what the step
    holds (`LoraAdapters`).
    """

    def __init__(self, step: str, adapters: LoraAdapters, why: str = "") -> None:
        self.step = step
        self.adapters = adapters
        params = step if step.endswith("model_params") else f"{step}/model_params"
        step_dir = params.removesuffix("/model_params")
        summary = (
            f"{step_dir}: this is a LoRA adapter step ({adapters.describe()}); it holds no "
            "base weights, so it cannot be restored or converted as a model"
            + (f": {why}" if why else ".")
        )
        hint = (
            "Either merge the adapters into the base checkpoint the LoRA run started from:\n"
            f"    orbax-maxtext-layout merge-lora {step_dir} --base <base step or its items> "
            "--alpha <lora_alpha> --out <dir>\n"
            "  (then train or export from <dir>/0/items with load_parameters_path), or go on "
            "training the adapters with MaxText's train_sft and\n"
            f"    lora.enable_lora=true lora.lora_restore_path={params}"
        )
        super().__init__(summary, [f"adapted module {m}" for m in adapters.modules], hint)


def factor_paths(paths: Iterable[Path]) -> dict[Path, tuple[str, str]]:
    """``{path: (weight name, "a" | "b")}`` of the paths that are qwix LoRA factors.

    ``paths`` are model paths after ``value`` levels are removed.
    """
    out = {}
    for p in paths:
        hit = _FACTOR.match(str(p[-1])) if p else None
        if hit:
            out[p] = (hit["weight"], hit["which"])
    return out


def adapters_of(
    params: Mapping[Path, Path],
    specs: Mapping[Path, LeafSpec],
    custom_metadata: Mapping[str, Any] | None = None,
) -> LoraAdapters | None:
    """The `LoraAdapters` of a ``model_params`` tree that holds only LoRA factors, else None.

    ``params`` maps model path (``value`` levels removed) to source path; ``specs`` maps
    source path to its spec. A leading adapter ``base`` level (RL) is dropped from the
    weight paths.
    """
    if not params:
        return None
    kinds = factor_paths(params)
    if len(kinds) != len(params):
        return None  # holds something else too: a model, perhaps with adapters
    pairs: dict[Path, dict[str, Path]] = {}
    for p, (weight, which) in kinds.items():
        model = p[1:] if p[:1] == (ADAPTER_KEY,) else p
        pairs.setdefault(model[:-1] + (weight,), {})[which] = params[p]
    if any(set(v) != {"a", "b"} for v in pairs.values()):
        return None
    factors = tuple(
        Factors(w, v["a"], v["b"], specs[v["a"]], specs[v["b"]])
        for w, v in sorted(pairs.items(), key=lambda kv: keystr(kv[0]))
    )
    ranks = {f.a_spec.shape[-1] for f in factors if f.a_spec.shape}
    # Scanned: the factors sit in a scanned layer group (`layermap.group_at`), as their
    # weights do; their ranks alone do not tell (an expert weight's factors have 3 or 4).
    scanned = any(group_at(f.weight) is not None for f in factors)
    axis, layers = _layer_axis(factors) if scanned else (None, None)
    dtypes = sorted({np.dtype(f.a_spec.dtype).name for f in factors})
    return LoraAdapters(
        factors,
        rank=ranks.pop() if len(ranks) == 1 else -1,
        layer_axis=axis,
        num_layers=layers,
        dtype="/".join(dtypes),
        scanned=scanned,
        alpha=recorded_alpha(custom_metadata or {}),
    )


def model_paths(specs: Mapping[Path, LeafSpec]) -> dict[Path, Path]:
    """``{model path: stored path}`` of a ``model_params`` item: ``value`` levels removed."""
    cur, _ = R.apply(R.unwrap_value, {p: p for p in specs})
    return cur


def adapters_in(
    item_dir: epath.PathLike, custom_metadata: Mapping[str, Any] | None = None
) -> LoraAdapters | None:
    """The `LoraAdapters` of a ``model_params`` item directory (metadata only), or None."""
    specs = read_specs(epath.Path(item_dir))
    return adapters_of(model_paths(specs), specs, custom_metadata)


def _layer_axis(factors: Iterable[Factors]) -> tuple[int | None, int | None]:
    """The axis (0 or 1) every factor pair stacks its layers on, if the shapes tell.

    Scanned factors are ``A (in, L, r)``/``B (r, L, out)`` (axis 1) or ``A (L, in, r)``
    /``B (L, r, out)`` (axis 0). Shapes with equal sizes can fit both; then None.
    """
    fits = {0: set(), 1: set()}
    for f in factors:
        a, b = f.a_spec.shape, f.b_spec.shape
        r = a[-1]
        if b[0] == r and a[1] == b[1]:
            fits[1].add(a[1])
        if b[1] == r and a[0] == b[0]:
            fits[0].add(a[0])
        if not (b[0] == r and a[1] == b[1]) and not (b[1] == r and a[0] == b[0]):
            fits[0].add(-1)
            fits[1].add(-1)
    ok = [ax for ax, ls in fits.items() if len(ls) == 1 and -1 not in ls]
    if len(ok) == 1:
        return ok[0], next(iter(fits[ok[0]]))
    return None, None


def recorded_alpha(custom_metadata: Mapping[str, Any]) -> float | None:
    """LoRA alpha a step records: MaxText's ``lora`` config, or our merge provenance."""
    for rec in (custom_metadata.get("lora"), custom_metadata.get("orbax_maxtext_layout")):
        if isinstance(rec, Mapping):
            alpha = rec.get("lora_alpha", rec.get("alpha"))
            if isinstance(alpha, int | float) and not isinstance(alpha, bool) and alpha > 0:
                return float(alpha)
    return None


def refuse_unplaced(
    cur: Mapping[Path, Path],
    specs: Mapping[Path, LeafSpec],
    placed: Iterable[Path],
    where: str,
) -> None:
    """Raises `LoraAdapterStepError` if ``cur`` is a LoRA adapter step whose factors
    are not all in ``placed`` (the model paths the target has a place for).

    A target built from a qwix-applied model holds the factors: then nothing is refused.
    """
    adapters = adapters_of(cur, specs)
    if adapters is None:
        return
    placed = set(placed)
    missing = [p for p in cur if p not in placed]
    if missing:
        why = (
            "the target has no place for its adapters"
            if len(missing) == len(cur)
            else f"the target has no place for {len(missing)} of its {len(cur)} adapter leaves"
        )
        raise LoraAdapterStepError(where, adapters, why)


def layer_slices(shape: tuple[int, ...], axis: int | None) -> int:
    """Number of layers a stacked shape holds on ``axis`` (1 when unscanned)."""
    return 1 if axis is None else shape[axis]


def per_layer_shape(shape: tuple[int, ...], axis: int | None) -> tuple[int, ...]:
    return shape if axis is None else shape[:axis] + shape[axis + 1 :]


def delta_layouts(
    kernel: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]
) -> list[tuple[int, ...]]:
    """Every way per-layer factors ``a`` and ``b`` can lay ``a @ b`` onto ``kernel``.

    qwix makes two kinds of factors (its ``LoraProvider``):
    - of a ``dot_general`` weight (MaxText's dense kernels): ``a (in, r)``, ``b (r, out)``,
      the kernel's leading (contracting) dims flattened into ``in``, the rest into
      ``out``: the delta is ``reshape(a @ b, kernel)``, layout ``()``;
    - of an ``einsum`` weight (MoE experts, ``wi_0 (experts, emb, mlp)``): ``a`` holds the
      kernel's dims the input shares (contracting or batch) in the kernel's order, then
      ``r``; ``b`` holds ``r``, then the other dims in the kernel's order: the delta is
      ``tensordot(a, b)`` with its dims put back in the kernel's order, the layout being
      that permutation (``kernel = delta.transpose(layout)``).

    Two-dimensional factors are a ``dot_general`` weight's (MaxText's dense kernels all are);
    any other is an einsum weight's. More than one layout means the shapes alone cannot tell
    (e.g. an expert weight whose experts number its input dim: the caller refuses).
    """
    if not a or not b or a[-1] != b[0]:
        return []
    if len(a) == 2 and len(b) == 2 and fits_kernel(kernel, a, b):
        return [()]
    da, db = tuple(a[:-1]), tuple(b[1:])
    n, out = len(kernel), []
    for pos in itertools.combinations(range(n), len(da)):
        rest = [i for i in range(n) if i not in pos]
        if tuple(kernel[i] for i in pos) == da and tuple(kernel[i] for i in rest) == db:
            where = {k: j for j, k in enumerate(pos)} | {k: len(da) + j for j, k in enumerate(rest)}
            layout = tuple(where[i] for i in range(n))
            out.append(() if layout == tuple(range(n)) else layout)
    return out


def fits_kernel(kernel: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether per-layer factors ``a (in, r)``, ``b (r, out)`` reshape onto ``kernel``.

    qwix flattens the kernel's contracting dims (its leading ones) into ``in`` and the
    rest into ``out``, in the kernel's own order, so some split of the kernel's dims
    must give exactly ``(in, out)``.
    """
    if len(a) != 2 or len(b) != 2 or a[1] != b[0]:
        return False
    return any(
        math.prod(kernel[:k]) == a[0] and math.prod(kernel[k:]) == b[1]
        for k in range(1, len(kernel))
    )


def _steps(n: int) -> str:
    """``n`` scan steps, as words: a scanned factor's layer axis holds scan steps, which are
    layers only for a plain scan (a block scan's step holds several layers)."""
    return f"{n} scan step{'s' if n != 1 else ''}"
