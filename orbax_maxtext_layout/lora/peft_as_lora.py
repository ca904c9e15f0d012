"""A PEFT LoRA adapter written as the Tunix LoRA step MaxText's ``train_sft`` writes and
resumes from (``import-hf --adapter DIR --as-lora``, issue 60).

The step is ``<out>/0/model_params`` holding only qwix's factors, ``<weight>_lora_a`` and
``<weight>_lora_b`` with the ``value`` level Tunix saves an ``nnx.LoRAParam`` with, scanned on
the weight's layer axis (MaxText's ``param_scan_axis``: ``a (in, L, r)``, ``b (r, L, out)``
for axis 1) or unscanned under ``layers_<i>``: the paths and numbering of MaxText's own
mapping, which the import planned (`Weight`).

qwix applies one ``alpha / rank`` to every module; PEFT has a scale per module (``alpha/r``,
rsLoRA's ``alpha/sqrt(r)``, ``rank_pattern``/``alpha_pattern``). Each is expressed exactly:
a module of smaller rank is zero-padded to the step's rank (zero rows of ``b`` and zero
columns of ``a`` add nothing), and its scale's ratio to the step's is folded into ``b``
(docs/lora.md, "As a LoRA step"). The step's rank is the config's ``lora.lora_rank`` (else
the largest module rank); its alpha the config's ``lora.lora_alpha`` (else the one that makes
the most common module scale need no folding).

A layer's PEFT factors become qwix's through MaxText's own import hooks of the weight
(`adapter_factors.carry`, probing the hook of an HF ``(out, in)`` tensor onto the kernel
flattened as qwix flattens it), then each weight is checked on its first adapted layer
(an unscanned module's layers each): ``(alpha/rank) · reshape(a @ b)`` against the hooks of PEFT's ``s · B @ A``, the delta
``import-hf --adapter`` merges, to float32 rounding. What cannot be written exactly is
refused before anything is written, naming the module and why (`AsLoraRefusedError`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from ..base.treepaths import Path, keystr
from ..orbax_io import item_writer, orbax_files, stepdir
from ..orbax_io.layout import TUNIX_PARAMS_ITEM
from ..storage.store import store_for
from . import adapter_factors
from .peft_adapter import AdapterPlan, AdapterRefusedError, Delta

SOURCE_LAYOUT = "peft-as-lora"
DTYPE = np.dtype(np.float32)  # qwix's factors of MaxText's float32 weights (weight_dtype)
TOLERANCE = adapter_factors.TOLERANCE  # relative to the delta's largest entry
CHECK_BLOCK = adapter_factors.CHECK_BLOCK  # bytes of a product's rows held at once


class AsLoraRefusedError(AdapterRefusedError):
    """A PEFT adapter that the Tunix LoRA step cannot hold exactly, refused before anything
    is written, each module named with why."""


@dataclasses.dataclass(frozen=True)
class Weight:
    """A MaxText weight qwix adapts (it matches MaxText's ``lora_module_path``): its path in
    the model (``decoder/layers/self_attention/query/kernel``), one layer's kernel shape,
    its layer axis (None: unscanned), the Hugging Face tensor of each layer (one, unscanned)
    with its shape ``(out, in)``, and MaxText's import hooks of one layer (an HF tensor to
    the kernel)."""

    path: Path
    kernel: tuple[int, ...]
    axis: int | None
    hf: tuple[str, ...]
    hf_shape: tuple[int, int]
    hook: Callable[[np.ndarray], np.ndarray]

    @property
    def module(self) -> str:
        return keystr(self.path[:-1])

    @property
    def split(self) -> int | None:
        """How many leading kernel dims qwix contracts (its ``in``): those whose product is
        the HF tensor's input size, the rest giving its output size."""
        out, n_in = self.hf_shape
        for k in range(1, len(self.kernel)):
            if math.prod(self.kernel[:k]) == n_in and math.prod(self.kernel[k:]) == out:
                return k
        return None

    def factor_path(self, side: str) -> Path:
        """``<weight>_lora_a`` / ``_lora_b`` with Tunix's ``value`` level."""
        return (*self.path[:-1], f"{self.path[-1]}_lora_{side}", "value")


@dataclasses.dataclass
class _Planned:
    weight: Weight
    deltas: list[Delta | None]  # per layer; None: PEFT leaves this layer
    fmap: adapter_factors.FactorMap
    n_in: int  # qwix's ``in``: the product of the contracting kernel dims
    n_out: int


@dataclasses.dataclass
class AsLoraPlan:
    """The step to write: its rank, alpha and scale, each weight with its layers' deltas."""

    rank: int
    alpha: float
    module_path: str
    weights: list[_Planned]
    adapter: AdapterPlan

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def modules(self) -> list[str]:
        return sorted(p.weight.module for p in self.weights)

    def shapes(self) -> dict[Path, tuple[int, ...]]:
        """Every factor leaf (with its ``value`` level) and its shape."""
        out = {}
        for p in self.weights:
            layers = len(p.weight.hf)
            a, b = (p.n_in, self.rank), (self.rank, p.n_out)
            if p.weight.axis is not None:
                a = (*a[: p.weight.axis], layers, *a[p.weight.axis :])
                b = (*b[: p.weight.axis], layers, *b[p.weight.axis :])
            out[p.weight.factor_path("a")] = a
            out[p.weight.factor_path("b")] = b
        return out

    def lora_metadata(self) -> dict[str, Any]:
        """The step's ``custom_metadata["lora"]``: MaxText's keys (its ``train_sft`` syncs
        ``lora_rank`` and ``lora_alpha`` from them), and the adapted modules."""
        return {
            "enable_lora": True,
            "lora_rank": self.rank,
            "lora_alpha": self.alpha,
            "lora_module_path": self.module_path,
            "target_modules": self.modules,
            "base_model_name_or_path": self.adapter.settings.base_model,
        }

    def to_dict(self) -> dict[str, Any]:
        folded = sorted({d.scale / self.scale for p in self.weights for d in p.deltas if d})
        padded = sorted(
            {d.rank for p in self.weights for d in p.deltas if d and d.rank < self.rank}
        )
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "scale": self.scale,
            "module_path": self.module_path,
            "modules": self.modules,
            "folded_ratios": folded,
            "padded_ranks": padded,
        }


def plan_as_lora(
    adapter: AdapterPlan,
    weights: Sequence[Weight],
    *,
    unheld: Mapping[str, str],
    rank: int = 0,
    alpha: float = 0.0,
    module_path: str = "",
) -> AsLoraPlan:
    """The PEFT adapter ``adapter`` (planned against the base) as factors of ``weights``,
    the weights MaxText's LoRA adapts; ``unheld``: HF tensor -> why MaxText's LoRA holds no
    factors for it. ``rank``/``alpha``: the config's ``lora.lora_rank``/``lora_alpha`` (0:
    chosen, see the module's doc). `AsLoraRefusedError` naming every problem."""
    problems: list[str] = []
    by_hf = {n: (w, i) for w in weights for i, n in enumerate(w.hf)}
    for name, d in sorted(adapter.deltas.items()):
        if d.experts:
            problems.append(
                f"{d.module}: MoE experts: qwix's LoRA of an expert weight shares one factor "
                "across the layer's experts, PEFT trains each expert's own; merge it instead "
                "(import-hf --adapter without --as-lora)"
            )
        elif name not in by_hf:
            why = unheld.get(name, "MaxText's LoRA has no factors for it")
            problems.append(f"{d.module}: {why}")
    planned = []
    carried: dict[tuple, Any] = {}  # the unscanned layers of a module share one probe
    for w in weights:  # each layer of a weight PEFT adapts in some layer: zero where it does not
        deltas = [adapter.deltas.get(n) for n in w.hf]
        if any(d is not None and d.experts for d in deltas):
            continue
        key = (generic(w.module), w.kernel, w.hf_shape)
        made = carried[key] = carried[key] if key in carried else _carry(w)
        if isinstance(made, str):
            problems.append(f"{w.module} ({w.hf[0]}): {made}")
            continue
        planned.append(_Planned(w, deltas, *made))
    top = max((d.rank for d in adapter.deltas.values()), default=1)
    if rank and rank < top:
        over = sorted({d.module for d in adapter.deltas.values() if d.rank > rank})
        problems.append(
            f"lora.lora_rank {rank}: under the adapter's rank {top} of "
            + ", ".join(over[:8])
            + (f" and {len(over) - 8} more" if len(over) > 8 else "")
            + f"; pass lora.lora_rank={top} or more (or leave it 0)"
        )
    if problems:
        raise AsLoraRefusedError(
            f"{adapter.where}: this PEFT adapter cannot be written exactly as a MaxText LoRA step:",
            problems,
            hint="Nothing was written. Merge it instead: import-hf HF_DIR --adapter (or --base "
            "STEP) without --as-lora.",
        )
    rank = rank or top
    if not alpha:
        alpha = _common_scale(adapter) * rank
    return AsLoraPlan(rank, float(alpha), module_path, planned, adapter)


def _common_scale(adapter: AdapterPlan) -> float:
    """The module scale most tensors have (the largest of those tied): the step's, so that
    the fewest modules need their scale folded into ``b``."""
    counts = collections.Counter(d.scale for d in adapter.deltas.values())
    if not counts:
        return 1.0
    best = max(counts.values())
    return max(s for s, n in counts.items() if n == best)


def _carry(w: Weight) -> tuple[adapter_factors.FactorMap, int, int] | str:
    """Where PEFT's factors of ``w``'s layers go in qwix's, through the import hooks."""
    k = w.split
    if k is None:
        return (
            f"its kernel {list(w.kernel)} does not split into the Hugging Face tensor's "
            f"input and output sizes {list(w.hf_shape[::-1])}"
        )
    n_in, n_out = math.prod(w.kernel[:k]), math.prod(w.kernel[k:])
    out_hf, in_hf = w.hf_shape

    # float32 throughout, as the import runs the hooks: the probes' entry numbers (at most
    # the larger side, 14,336 for an 8B MLP) stay exact, and the scale's rounding leaves each
    # under `adapter_factors`' 1e-3 of an entry
    def hook(m: np.ndarray) -> np.ndarray:  # an HF matrix -> qwix's kernel view, (out, in)
        return np.asarray(w.hook(m)).reshape(n_in, n_out).T

    def delta(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # a (in_hf, r), b (r, out_hf)
        return np.asarray(b, np.float32).T @ np.asarray(a, np.float32).T  # (out_hf, in_hf)

    fmap = adapter_factors.carry(hook, delta, in_hf, out_hf)
    if isinstance(fmap, str):
        return f"MaxText's import hooks cannot be carried onto qwix's factors: {fmap}"
    return fmap, n_in, n_out


def layer_factors(
    plan: AsLoraPlan, p: _Planned, d: Delta, read: Callable[[str], np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """One layer's qwix factors ``a (in, rank)`` and ``b (rank, out)`` of PEFT's pair:
    through the hooks' map, the module's scale ratio to the step's folded into ``b``, zero-
    padded from the module's rank to the step's."""
    lora_a = np.asarray(read(d.a), np.float64)
    lora_b = np.asarray(read(d.b), np.float64) * (d.scale / plan.scale)
    x, y = p.fmap.peft(lora_a.T, lora_b.T)  # x (r, in), y (out, r): qwix's a.T, b.T
    a = np.zeros((p.n_in, plan.rank), DTYPE)
    b = np.zeros((plan.rank, p.n_out), DTYPE)
    a[:, : d.rank] = x.T
    b[: d.rank] = y.T
    return a, b


def check_layer(
    plan: AsLoraPlan, p: _Planned, d: Delta, read: Callable[[str], np.ndarray], ab
) -> float:
    """How far ``(alpha/rank) · reshape(a @ b)`` of one layer is from MaxText's import
    hooks of PEFT's delta (what ``import-hf --adapter`` adds to the kernel), relative to the
    delta's largest entry; in float32, a block of rows at a time (a kernel-size float64
    copy took 3 s a weight at 8B, most of it fresh pages)."""
    a, b = (np.asarray(x, np.float32) for x in ab)
    want = np.asarray(p.weight.hook(d.compute(read)), np.float32).reshape(p.n_in, p.n_out)
    top = err = 0.0
    rows = max(1, CHECK_BLOCK // max(1, 4 * p.n_out))
    for r0 in range(0, p.n_in, rows):
        w = want[r0 : r0 + rows]
        got = a[r0 : r0 + rows] @ b
        got *= np.float32(plan.scale)
        got -= w
        top = max(top, float(np.max(np.abs(w), initial=0.0)))
        err = max(err, float(np.max(np.abs(got), initial=0.0)))
    return 0.0 if top == err == 0 else err / (top or 1.0)


def factors(plan: AsLoraPlan, read: Callable[[str], np.ndarray]) -> dict[Path, np.ndarray]:
    """Every factor leaf's array, each weight checked on its first adapted layer
    (`check_layer`); `AsLoraRefusedError` naming each weight that misses."""
    out: dict[Path, np.ndarray] = {}
    bad = []
    for p in plan.weights:
        w, layers = p.weight, len(p.weight.hf)
        a_all = np.zeros((layers, p.n_in, plan.rank), DTYPE)
        b_all = np.zeros((layers, plan.rank, p.n_out), DTYPE)
        adapted = [i for i, d in enumerate(p.deltas) if d is not None]
        for i in adapted:
            a_all[i], b_all[i] = layer_factors(plan, p, p.deltas[i], read)
        # one layer checked: a weight's layers share its hooks (an unscanned module's layers
        # are weights of their own, each checked, its map carried once)
        for i in adapted[:1]:
            err = check_layer(plan, p, p.deltas[i], read, (a_all[i], b_all[i]))
            if not err <= TOLERANCE:
                bad.append(
                    f"{w.module} ({w.hf[i]}): qwix's factors miss the hooked delta by {err:.3g}"
                )
        if w.axis is None:
            out[w.factor_path("a")], out[w.factor_path("b")] = a_all[0], b_all[0]
        else:
            out[w.factor_path("a")] = np.ascontiguousarray(np.moveaxis(a_all, 0, w.axis))
            out[w.factor_path("b")] = np.ascontiguousarray(np.moveaxis(b_all, 0, w.axis))
    if bad:
        raise AsLoraRefusedError(
            f"{plan.adapter.where}: the factors of {len(bad)} modules cannot be written exactly:",
            bad,
            hint="Nothing was written. Merge it instead: import-hf --adapter without --as-lora.",
        )
    return out


# -- the step -------------------------------------------------------------------------------
def write_step(
    arrays: Mapping[Path, np.ndarray],
    dest: epath.PathLike,
    *,
    provenance: dict[str, Any],
    custom: dict[str, Any],
    use_zarr3: bool = True,
) -> None:
    """``dest`` (``<out>/0``) written as a Tunix step holding ``model_params`` only: the
    factor leaves ``arrays`` (each one chunk), the step metadata naming the item with its
    ``custom`` entries and our ``provenance``; built aside and published whole, as the
    import publishes a MaxText step. Refused if ``dest`` exists."""
    dest = epath.Path(dest)
    store = store_for(dest)
    with stepdir.building_step(dest, store=store) as work:
        tmp = stepdir.new_tmp_dir(work, store=store, item=TUNIX_PARAMS_ITEM)
        _write_item(arrays, tmp, use_zarr3)
        stepdir.commit(
            work, tmp, provenance, store=store, meta={}, custom=custom, item=TUNIX_PARAMS_ITEM
        )


def _write_item(arrays: Mapping[Path, np.ndarray], tmp: epath.Path, use_zarr3: bool) -> None:
    ctx = item_writer.ts_context()
    kv = orbax_files.open_kvstore(tmp, ctx, use_ocdbt=True)
    dst = kv.spec().to_json()
    for path, x in arrays.items():
        item_writer.write_array(
            dst, orbax_files.param_name(path), x, use_zarr3=use_zarr3, context=ctx
        )
    leaves = {p: orbax_files.leaf_files(None, None, list(x.shape), None) for p, x in arrays.items()}
    orbax_files.write_metadata(tmp, leaves, use_zarr3=use_zarr3)


def generic(module: str) -> str:
    """A module's name without its layer number (``layers_3`` as ``layers_[0-9]+``)."""
    return re.sub(r"(^|/)layers_[0-9]+(/|$)", r"\1layers_[0-9]+\2", module)


def module_pattern(weights: Sequence[Weight]) -> str:
    """The ``lora.lora_module_path`` of exactly the modules of ``weights`` (each layer of an
    unscanned one), for ``train_sft`` to put LoRA on them and on nothing else: qwix
    fullmatches it, and ``train_sft`` refuses a LoRA module it finds no factors for."""
    names = sorted({generic(w.module) for w in weights})
    return "|".join(
        re.escape(n).replace(re.escape("layers_[0-9]+"), "layers_[0-9]+") for n in names
    )
