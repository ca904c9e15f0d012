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
flattened as qwix flattens it; each probe one line of the tensor put through the hooks
where they can take a box of it, `Weight.box`), once per distinct map: the module's kind,
shapes and hook functions (`Weight.hooks_id`; the layers of an unscanned module share
theirs). Then each map is checked on the first layer it carries: ``(alpha/rank) ·
reshape(a @ b)`` against MaxText's real hooks of PEFT's ``s · B @ A``, the delta
``import-hf --adapter`` merges, every entry to float32 rounding. What cannot be written
exactly is refused before anything is written, naming the module and why
(`AsLoraRefusedError`).
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
from ..storage.scratch import small_pages, small_zeros
from ..storage.store import store_for
from . import adapter_factors
from .peft_adapter import AdapterPlan, AdapterRefusedError, Delta

SOURCE_LAYOUT = "peft-as-lora"
DTYPE = np.dtype(np.float32)  # qwix's factors of MaxText's float32 weights (weight_dtype)
TOLERANCE = adapter_factors.TOLERANCE  # relative to the delta's largest entry
# bytes of the product's rows at once: 4 MiB beat 1 and 32 at 8B (the passes over a block
# stay in cache, and BLAS is called a few hundred times a weight, not thousands)
CHECK_BLOCK = 4 << 20


class AsLoraRefusedError(AdapterRefusedError):
    """A PEFT adapter that the Tunix LoRA step cannot hold exactly, refused before anything
    is written, each module named with why."""


@dataclasses.dataclass(frozen=True)
class Weight:
    """A MaxText weight qwix adapts (it matches MaxText's ``lora_module_path``): its path in
    the model (``decoder/layers/self_attention/query/kernel``), one layer's kernel shape,
    its layer axis (None: unscanned), the Hugging Face tensor of each layer (one, unscanned)
    with its shape ``(out, in)``, and MaxText's import hooks of one layer (an HF tensor to
    the kernel). ``box``: the same hooks on a box of the HF tensor, ``(start, values) ->
    [(start, values)]`` of the kernel, or None where the box cannot go through them
    (`hf/hooks_by_box`); None: only whole tensors. ``hooks_id``: equal for weights whose
    hooks are the same functions (None: told apart by the module's kind and shapes)."""

    path: Path
    kernel: tuple[int, ...]
    axis: int | None
    hf: tuple[str, ...]
    hf_shape: tuple[int, int]
    hook: Callable[[np.ndarray], np.ndarray]
    box: Callable[[tuple[int, ...], np.ndarray], list | None] | None = None
    hooks_id: Any = None

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

    @property
    def map_key(self) -> tuple:
        """What weights sharing one factor map share: the module's kind (no layer number),
        the shapes and the hook functions."""
        return (generic(self.module), self.kernel, self.hf_shape, self.hooks_id)

    @property
    def check_key(self) -> Any:
        """What weights checked once share: their map, where their hooks are known to be the
        same functions (`hooks_id`); else each weight is checked."""
        return self.map_key if self.hooks_id is not None else self.path


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
        key = w.map_key
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

    fmap = adapter_factors.carry(hook, delta, in_hf, out_hf, line=_line(w, n_in, n_out))
    if isinstance(fmap, str):
        return f"MaxText's import hooks cannot be carried onto qwix's factors: {fmap}"
    return fmap, n_in, n_out


def _line(w: Weight, n_in: int, n_out: int) -> adapter_factors.Line | None:
    """A probe's hooked delta through ``w.box``: the HF tensor's one nonzero line (column 0,
    ``axis`` 0; row 0, ``axis`` 1) in a box widened with zeros until the hooks take it
    (llama's RoPE order needs a whole head of rows), as entries of qwix's kernel view
    ``(out, in)``; None where no box short of the whole tensor goes through."""
    if w.box is None:
        return None
    box = w.box
    out_hf, in_hf = w.hf_shape

    def line(axis: int, vec: np.ndarray) -> adapter_factors.Entries | None:
        width = 1
        while width < (in_hf if axis == 0 else out_hf):
            data = np.zeros((out_hf, width) if axis == 0 else (width, in_hf), np.float32)
            if axis == 0:
                data[:, 0] = vec
            else:
                data[0, :] = vec
            got = box((0, 0), data)
            if got is not None and len(got) == 1:
                return _entries(got[0], w.kernel, n_in, n_out)
            width *= 2
        return None

    return line


def _entries(
    got: tuple[tuple[int, ...], np.ndarray], kernel: tuple[int, ...], n_in: int, n_out: int
) -> adapter_factors.Entries:
    """A box of the kernel (its start, its values) as the nonzero entries of the kernel's
    view ``(out, in)``: qwix's ``reshape(kernel, (in, out))``, transposed."""
    start, values = got
    values = np.asarray(values)
    axes = np.ix_(*(np.arange(s, s + n) for s, n in zip(start, values.shape, strict=True)))
    flat = np.ravel_multi_index(axes, kernel)
    nonzero = values != 0
    i, j = np.divmod(np.broadcast_to(flat, values.shape)[nonzero], n_out)
    return adapter_factors.Entries(j, i, values[nonzero], (n_out, n_in))


def weight_factors(
    plan: AsLoraPlan, p: _Planned, read: Callable[[str], np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """``p``'s qwix factors of every layer, ``a (in, rank)`` and ``b (rank, out)`` a layer
    in the step's layout (the layers on the weight's layer axis; unscanned, its one layer):
    PEFT's pairs through the hooks' map, each module's scale ratio to the step's folded
    into ``b`` (float64, rounded once to float32), zero-padded from the module's rank to
    the step's, zero where PEFT leaves a layer. The layers of one rank and scale go through
    the map together."""
    w, rank, fm = p.weight, plan.rank, p.fmap
    axis = 0 if w.axis is None else w.axis
    layers = len(w.hf)
    a = small_zeros(_with_layers((p.n_in, rank), layers, axis), DTYPE)
    b = small_zeros(_with_layers((rank, p.n_out), layers, axis), DTYPE)
    a_l, b_l = np.moveaxis(a, axis, 0), np.moveaxis(b, axis, 0)  # views, a layer a row
    groups: dict[tuple[int, float], list[int]] = {}
    for i, d in enumerate(p.deltas):
        if d is not None:
            groups.setdefault((d.rank, d.scale), []).append(i)
    for (r, scale), idx in groups.items():
        lora_a = np.stack([read(p.deltas[i].a) for i in idx])  # (n, r, in)
        lora_b = np.stack([read(p.deltas[i].b) for i in idx])  # (n, out, r)
        if scale != plan.scale:
            lora_b = lora_b * (np.float64(scale) / plan.scale)  # float64 until assigned
        # gathered as stored (rows of ``r`` for ``b``), transposed where assigned
        a_l[idx, :, :r] = np.swapaxes(_moved(lora_a, fm.in_index, fm.in_scale, 2), 1, 2)
        b_l[idx, :r, :] = np.swapaxes(_moved(lora_b, fm.out_index, fm.out_scale, 1), 1, 2)
    return (a[0], b[0]) if w.axis is None else (a, b)


def _moved(x: np.ndarray, index: np.ndarray, scale: np.ndarray, axis: int) -> np.ndarray:
    """``x``'s entries on ``axis`` taken at ``index``, times ``scale`` there: in float64,
    rounded once where the caller stores them (a scale of 1 changes no value: no product)."""
    got = np.take(x, index, axis=axis)
    if np.all(scale == 1):
        return got
    return got * np.asarray(scale, np.float64).reshape([-1 if k == axis else 1 for k in range(3)])


def layer_views(p: _Planned, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``p``'s factors ``a``, ``b`` (`weight_factors`) as views ``(layer, in, rank)`` and
    ``(layer, rank, out)``."""
    if p.weight.axis is None:
        return a[None], b[None]
    return np.moveaxis(a, p.weight.axis, 0), np.moveaxis(b, p.weight.axis, 0)


def _with_layers(shape: tuple[int, int], layers: int, axis: int) -> tuple[int, ...]:
    return (*shape[:axis], layers, *shape[axis:])


def check_layer(
    plan: AsLoraPlan,
    p: _Planned,
    d: Delta,
    read: Callable[[str], np.ndarray],
    ab,
    *,
    scratch: np.ndarray | None = None,
) -> float:
    """How far ``(alpha/rank) · reshape(a @ b)`` of one layer is from MaxText's import
    hooks of PEFT's delta (what ``import-hf --adapter`` adds to the kernel), relative to the
    delta's largest entry; every entry, in float32. ``scratch``: float32 bytes for the delta
    (`check_scratch`), else fresh. Memory, not arithmetic, is the cost at 8B (a fresh
    kernel-size float64 copy took 3 s a weight): the delta is made in ``scratch``, the
    product a block of rows at a time into one buffer, in the order the hooked delta lies
    in memory (a transposing hook gives a view)."""
    a, b = (np.asarray(x, np.float32) for x in ab)
    out_hf, in_hf = p.weight.hf_shape
    buf = None if scratch is None else scratch[: out_hf * in_hf].reshape(out_hf, in_hf)
    want = np.asarray(p.weight.hook(d.compute(read, buf)), np.float32).reshape(p.n_in, p.n_out)
    if not want.flags.c_contiguous and want.T.flags.c_contiguous:
        want, a, b = want.T, b.T, a.T  # the same entries, compared as they lie
    a = a * np.float32(plan.scale)  # (alpha/rank) on the small factor, not on the product
    n, m = want.shape
    rows = max(1, min(n, CHECK_BLOCK // max(1, 4 * m)))
    block = np.empty((rows, m), np.float32)
    top = err = 0.0
    for r0 in range(0, n, rows):
        w = want[r0 : r0 + rows]
        got = np.matmul(a[r0 : r0 + rows], b, out=block[: len(w)])
        got -= w
        top = max(top, float(w.max()), -float(w.min()))
        err = max(err, float(got.max()), -float(got.min()))
    return 0.0 if top == err == 0 else err / (top or 1.0)


def check_scratch(plan: AsLoraPlan) -> np.ndarray:
    """float32 room for the largest delta `check_layer` makes, in small pages (first
    touched once, and on a VM at 2.6 GB/s where a huge page's is 0.5: `storage/scratch`)."""
    n = max((math.prod(p.weight.hf_shape) for p in plan.weights), default=0)
    return small_pages(4 * n).view(np.float32)


def factors(plan: AsLoraPlan, read: Callable[[str], np.ndarray]) -> dict[Path, np.ndarray]:
    """Every factor leaf's array, each factor map checked on the first layer it carries
    (`check_layer`; `Weight.check_key`: the layers of a weight, and of an unscanned module
    whose hooks are the same functions, share them); `AsLoraRefusedError` naming each
    weight that misses."""
    out: dict[Path, np.ndarray] = {}
    bad = []
    checked: set[tuple] = set()
    scratch = check_scratch(plan)
    for p in plan.weights:
        w = p.weight
        a, b = weight_factors(plan, p, read)
        out[w.factor_path("a")], out[w.factor_path("b")] = a, b
        adapted = [i for i, d in enumerate(p.deltas) if d is not None]
        if adapted and w.check_key not in checked:
            checked.add(w.check_key)
            i = adapted[0]
            a_l, b_l = layer_views(p, a, b)
            err = check_layer(plan, p, p.deltas[i], read, (a_l[i], b_l[i]), scratch=scratch)
            if not err <= TOLERANCE:
                bad.append(
                    f"{w.module} ({w.hf[i]}): qwix's factors miss the hooked delta by {err:.3g}"
                )
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
    named = {orbax_files.param_name(path): x for path, x in arrays.items()}
    item_writer.write_arrays(dst, named, use_zarr3=use_zarr3, context=ctx)
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
