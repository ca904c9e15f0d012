"""``import-hf``: a Hugging Face directory written as the step MaxText's own ``to_maxtext``
writes (``<out>/0/items``, ``params/params/...``, ``step`` 0, an empty ``opt_state``, and
``scan_layers`` in the step's custom metadata), streaming, within a memory budget.

MaxText's mapping decides everything (`hf_mapping.load_import`: ``PARAM_MAPPING``,
``HOOK_FNS`` with ``saving_to_hf=False``, ``HF_SHAPE``, and ``to_maxtext``'s abstract model),
as ``to_maxtext`` runs it, with four differences (docs/import-hf.md):

- the Hugging Face config is resized to the MaxText config first, so a resized model maps;
- a scanned MoE param stacks on its layer axis (``to_maxtext`` stacks MaxText 0.2.5's
  scanned mixtral router on the expert axis and crashes);
- ``--save-dtype`` means what ``to_maxtext``'s means with torch installed, with or without
  it: every source tensor cast first (float32 to bfloat16 rounds to nearest even), then
  MaxText's hooks;
- the Hugging Face ``config.json`` must agree with the MaxText config; and the directory is
  read as untrusted input (`formats.safetensors_reader`).

With ``--adapter`` (issue 60) a PEFT LoRA adapter is a source transform of the same plan
(`lora.peft_adapter`): each HF tensor it changes gets ``W + s·B@A`` in float32 as it is read,
then the cast and MaxText's hooks as for the base; with ``--base STEP`` the base's slices come
from a MaxText step (`lora.base_step`) and the hooked deltas are added to them.

The unit of work is one slice: one HF tensor (or a fused group) of one layer (and expert),
read with one range read, cast, put through MaxText's hooks and written as its own chunk
of the stacked MaxText array. Slices run on two workers a core, the bytes in flight held
within the budget (`storage.memory.Gate`). The step is built in a work directory beside
``<out>/0`` and appears only once complete (`stepdir.publish_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import threading
import time
from collections.abc import Callable, Container, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypedDict, Unpack

import ml_dtypes
import numpy as np
import tensorstore as ts
from etils import epath

from .._version import __version__
from ..base.futures import results
from ..base.reports import Report
from ..base.treepaths import Path
from ..errors import LayoutMismatchError, StepExistsError, UsageError
from ..execute.options import resolve
from ..formats.safetensors_reader import HfDir
from ..lora import peft_adapter, peft_as_lora
from ..lora.base_step import BaseStep
from ..model import hf_mapping
from ..model.hf_mapping import HfModel
from ..orbax_io import item_writer, orbax_files, stepdir
from ..plan.provenance import SCAN_LAYERS_KEY
from ..storage import transpose
from ..storage.memory import DEFAULT_BUDGET, IMPORT, Gate
from ..storage.scratch import small_pages
from ..storage.store import StepStore, store_for
from .hooks_by_box import PieceFn

SAVE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
DEFAULT_SAVE_DTYPE = "bfloat16"  # to_maxtext's default
HOLD = 3  # a slice is held read, cast and hooked: three times its bytes at most
CHUNK_BYTES = 64 << 20  # a written chunk at most this (a slice larger is cut in row blocks)
SOURCE_LAYOUT = "huggingface"
# Where MaxText's mapping names a tensor as a model class holds it in memory and the files
# name it otherwise: MaxText 0.2.5's gemma3 reads ``model.language_model.*``
# (``Gemma3ForConditionalGeneration`` in memory); ``Gemma3ForCausalLM`` saves ``model.*``
# and older multimodal files ``language_model.model.*``. The name MaxText gives is used
# when the directory has it, else the first of these that it has.
NAME_ALIASES = (
    ("model.language_model.", "model."),
    ("model.language_model.", "language_model.model."),
)

# config.json fields that must agree with the MaxText config (through MaxText's own resized
# Hugging Face config of the model): the model's kind and every size.
CHECKED_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "head_dim",
    "vocab_size",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "tie_word_embeddings",
)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One MaxText param (or a composite group of them, fused in one HF tensor) and where it
    comes from: ``hf`` as MaxText's mapping names it (a name, a tuple of names a hook fuses,
    or lists of those, one level per stacked axis), stacked on ``axes`` (outermost first)."""

    keys: tuple[str, ...]
    paths: tuple[Path, ...]
    shapes: tuple[tuple[int, ...], ...]
    hf: Any
    axes: tuple[int, ...]
    hooks: Any

    @property
    def slice_shape(self) -> tuple[int, ...]:
        """What MaxText's hooks make of one slice (its ``target_shape``)."""
        shape = self.shapes[0]
        return tuple(d for i, d in enumerate(shape) if i not in self.axes)

    def slices(self) -> Iterator[tuple[tuple[int, ...], Any]]:
        """``(index on axes, the HF name(s) of that slice)``, every slice."""
        yield from _slices(self.hf, ())


def _slices(node: Any, idx: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], Any]]:
    """`Leaf.slices` below ``node`` (a module function: a closure calling itself is a
    reference cycle)."""
    if isinstance(node, list):
        for i, sub in enumerate(node):
            yield from _slices(sub, (*idx, i))
    else:
        yield idx, node


@dataclasses.dataclass
class ImportPlan:
    """The import as planned from metadata only: every MaxText leaf and its HF sources."""

    hf: HfDir | None  # None: the base is a MaxText step (``base``)
    model: HfModel
    leaves: list[Leaf]
    save_dtype: np.dtype
    budget: int
    adapter: Adapter | None = None  # ``--adapter``: merged into its base tensors as read
    base: BaseStep | None = None  # ``--base STEP``: the params read from it, not from ``hf``

    @property
    def bytes_read(self) -> int:
        if self.base is not None:
            source = sum(
                math.prod(s) * self.base.dtypes[p].itemsize
                for lf in self.leaves
                for p, s in zip(lf.paths, lf.shapes, strict=True)
            )
        else:
            source = sum(self.hf.tensors[n].nbytes for lf in self.leaves for n in _names(lf.hf))
        return source + (self.adapter.bytes_read if self.adapter else 0)

    def hf_shape(self, name: str) -> tuple[int, ...]:
        """The shape of Hugging Face tensor ``name``: the directory's, or with ``--base``
        MaxText's ``HF_SHAPE`` (no directory)."""
        if self.hf is None:
            return tuple(self.model.shape_map[_maxtext_name(self.model.shape_map, name)])
        return tuple(self.hf.tensors[name].shape)

    @property
    def bytes_written(self) -> int:
        return sum(math.prod(s) * self.save_dtype.itemsize for lf in self.leaves for s in lf.shapes)

    @property
    def largest_slice(self) -> int:
        return max(
            (_slice_bytes(self, lf, hf) for lf in self.leaves for _, hf in lf.slices()), default=0
        )

    @property
    def memory(self) -> int:
        """Bytes held at the peak: the budget's worth of slices in flight (one slice over it
        runs alone), each held read, cast and hooked."""
        return max(
            min(self.budget, HOLD * self.largest_slice * _workers()), HOLD * self.largest_slice
        )


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A PEFT adapter merged while importing: its directory, read as untrusted input as the
    base is (`HfDir`), and its plan against the base (`peft_adapter.plan_adapter`)."""

    dir: HfDir
    plan: peft_adapter.AdapterPlan

    @property
    def bytes_read(self) -> int:
        """The factors read, once per tensor they change (a fused experts pair once an
        expert and part: small next to the base)."""
        d = self.dir.tensors
        return sum(d[x.a].nbytes + d[x.b].nbytes for x in self.plan.deltas.values())

    def merge(self, name: str, w: np.ndarray, dtype: np.dtype, *, in_place: bool) -> np.ndarray:
        """``w`` with its delta merged, in ``dtype`` (`AdapterPlan.merge`)."""
        return self.plan.merge(name, w, self.dir.read, dtype=dtype, in_place=in_place)


@dataclasses.dataclass
class ImportReport(Report):
    """What `import_hf` did (or, ``dry_run``, would do)."""

    hf_dir: str
    out: str
    model_name: str
    scan_layers: bool
    save_dtype: str
    params: int
    hf_tensors: int
    bytes_read: int
    bytes_written: int
    memory: int
    dry_run: bool
    seconds: float = 0.0
    adapter: dict | None = None  # ``--adapter``: what was merged (`AdapterPlan.to_dict`)

    def __str__(self) -> str:
        did = "would write" if self.dry_run else "wrote"
        return (
            f"{self.hf_dir}: {did} {self.out}/0 ({self.model_name}, scan_layers="
            f"{str(self.scan_layers).lower()}, {self.save_dtype}): {self.params} params from "
            f"{self.hf_tensors} Hugging Face tensors, {self.bytes_read:,} bytes read, "
            f"{self.bytes_written:,} bytes of values written, about {self.memory:,} bytes "
            f"held at once"
            + (f", {self.seconds:.1f} s" if self.seconds else "")
            + _adapter_line(self)
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImportOptions:
    """How `import_hf` writes the step: its keyword arguments of the same names, as one
    object (``import_hf(hf_dir, out, ImportOptions(save_dtype="float32"), maxtext_config=c)``).

    ``save_dtype``: the params' dtype (a name of `SAVE_DTYPES`, to_maxtext's ``--save_dtype``).
    ``memory_budget``: bytes of slices held at once (None: `DEFAULT_BUDGET`). ``dry_run``:
    report only (reads the directory's metadata). ``progress``: called with (slices done,
    slices in all).
    """

    save_dtype: str | None = None
    memory_budget: int | None = None
    dry_run: bool = False
    progress: Callable[[int, int], None] | None = None
    adapter: epath.PathLike | None = None
    base: epath.PathLike | None = None
    as_lora: bool = False


class ImportKeywords(TypedDict, total=False):
    """`ImportOptions` as `import_hf`'s keyword arguments (for type checkers)."""

    save_dtype: str | None
    memory_budget: int | None
    dry_run: bool
    progress: Callable[[int, int], None] | None
    adapter: epath.PathLike | None
    base: epath.PathLike | None
    as_lora: bool


def import_hf(
    hf_dir: epath.PathLike | None,
    out: epath.PathLike,
    options: ImportOptions | None = None,
    *,
    maxtext_config: Sequence[str],
    **keywords: Unpack[ImportKeywords],
) -> ImportReport:
    """Writes the Hugging Face directory ``hf_dir`` as ``<out>/0`` (MaxText's layout), as
    MaxText's ``to_maxtext`` does for the model of ``maxtext_config`` (its config file, then
    ``KEY=VALUE`` overrides; ``scan_layers`` picks the form). Nothing is written before the
    whole directory was read as metadata and checked against the model. The options
    (`ImportOptions`) come as one object or as keyword arguments, not both.

    ``adapter``: a PEFT LoRA adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors``) for this base, merged in: each tensor it adapts becomes
    ``W + s·B@A`` in float32 with PEFT's scale for its module, before the cast and MaxText's
    hooks (docs/import-hf.md, "A PEFT adapter merged in").

    ``base``: a MaxText step of the model (``<step>`` or ``<step>/items``) as the base in
    place of ``hf_dir`` (then None), with ``adapter``: each adapted slice is the step's plus
    MaxText's hooks of the adapter's delta, computed in float32; every other param the
    step's own values. ``save_dtype`` None: the step's dtype (``hf_dir``: bfloat16).

    ``as_lora``: with ``adapter`` (``hf_dir`` optional, checked against the config where
    given), the adapter written as the Tunix LoRA step MaxText's ``train_sft`` writes and
    resumes from (``lora.lora_restore_path=<out>/0/model_params``): ``<out>/0/model_params``
    holding only qwix's ``kernel_lora_a``/``kernel_lora_b`` (float32), each PEFT module's
    scale exact (smaller ranks zero-padded, scale ratios folded into ``b``), rank, alpha and
    the modules in ``custom_metadata["lora"]``. The config's ``lora.lora_rank``,
    ``lora.lora_alpha`` and ``lora.lora_module_path`` are used where set (docs/lora.md).

    Raises:
      HfInputError: the directory is malformed or names anything outside itself.
      LayoutMismatchError: ``config.json`` or a tensor disagrees with the MaxText config
        (every mismatch named); an ``AdapterRefusedError``, the adapter's settings or
        factors cannot be merged exactly into this base (every problem named).
      StepExistsError: ``<out>/0`` exists.
      UsageError: an unknown ``save_dtype``; ``options`` together with option keywords; both
        or neither of ``hf_dir`` and ``base``; ``base`` without ``adapter``; ``as_lora``
        without ``adapter`` or with ``base``.
    """
    o = resolve(ImportOptions, options, keywords, "import_hf")
    # The collector is left as the caller set it (a library call changes no process setting,
    # issue 57); the command line runs with the objects alive at its start frozen.
    return _import_hf(hf_dir, out, o, maxtext_config=maxtext_config)


def _import_hf(
    hf_dir: epath.PathLike | None,
    out: epath.PathLike,
    o: ImportOptions,
    *,
    maxtext_config: Sequence[str],
) -> ImportReport:
    save_dtype, memory_budget, dry_run = o.save_dtype, o.memory_budget, o.dry_run
    adapter, base = o.adapter, o.base
    start = time.monotonic()
    if o.as_lora:
        return _import_as_lora(hf_dir, out, o, maxtext_config=maxtext_config)
    if save_dtype is not None and save_dtype not in SAVE_DTYPES:
        raise UsageError(f"--save-dtype {save_dtype}: one of {', '.join(SAVE_DTYPES)}.")
    if (hf_dir is None) == (base is None):
        raise UsageError("import-hf: give either HF_DIR or --base STEP (one of them).")
    if base is not None and adapter is None:
        raise UsageError("--base STEP merges an adapter into a MaxText step: give --adapter.")
    # the directory is checked first: a hostile one is refused whether MaxText is here or not
    hf = HfDir.open(hf_dir) if base is None else None
    config = hf_mapping.load_config(maxtext_config)
    model = hf_mapping.load_import(config)
    budget = DEFAULT_BUDGET if memory_budget is None else memory_budget
    if hf is not None:
        check_config(hf, model)
        plan = plan_import(hf, model, SAVE_DTYPES[save_dtype or DEFAULT_SAVE_DTYPE], budget)
    else:
        plan = plan_base(base, model, save_dtype, budget)
    if adapter is not None:
        plan = with_adapter(adapter, plan)
    dest = epath.Path(out) / "0"
    try:
        if dest.exists():
            raise StepExistsError(
                f"{dest} exists; import-hf writes a new step: pass another --out."
            )
        if not dry_run:
            _write_step(plan, dest, o.progress)
    finally:
        if plan.adapter is not None:
            plan.adapter.dir.close()
    read = plan.bytes_read if plan.hf is None else plan.hf.bytes_read
    read += plan.adapter.dir.bytes_read if plan.adapter and plan.hf else 0
    return ImportReport(
        str(hf_dir if base is None else base),
        str(out),
        config.model_name,
        bool(config.scan_layers),
        plan.save_dtype.name,
        sum(len(lf.paths) for lf in plan.leaves),
        len({n for lf in plan.leaves for n in _names(lf.hf)}),
        plan.bytes_read if dry_run else read,
        plan.bytes_written,
        plan.memory,
        dry_run,
        0.0 if dry_run else time.monotonic() - start,
        plan.adapter.plan.to_dict() if plan.adapter else None,
    )


def with_adapter(adapter: epath.PathLike, plan: ImportPlan) -> ImportPlan:
    """``plan`` with the PEFT adapter directory ``adapter`` opened as untrusted input
    (`HfDir`'s checks: containment, sizes, the safetensors header) and planned against the
    base tensors ``plan`` reads; `HfInputError` or `AdapterRefusedError`, nothing written.

    With no Hugging Face directory (``--base``, ``--as-lora``) the base tensors are named as
    the adapter names them, where MaxText's mapping and the model class PEFT ran on spell
    them apart (`NAME_ALIASES`: gemma3's ``model.language_model.*``, ``model.*`` in a
    ``Gemma3ForCausalLM`` adapter), as a directory's own names are read."""
    files = (peft_adapter.CONFIG_FILE, peft_adapter.WEIGHTS_FILE)
    ad = HfDir.open(adapter, files=files)
    try:
        if plan.hf is None:
            named = {_factor_module(n) + ".weight" for n in ad.tensors}
            leaves = [dataclasses.replace(lf, hf=_as_stored(named, lf.hf)) for lf in plan.leaves]
            plan = dataclasses.replace(plan, leaves=leaves)
        where = str(ad.dir)
        settings = peft_adapter.settings(ad.config, f"{where}/{peft_adapter.CONFIG_FILE}")
        factors = {n: (t.shape, t.dtype) for n, t in ad.tensors.items()}
        base = {n: plan.hf_shape(n) for lf in plan.leaves for n in _names(lf.hf)}
        kind = plan.hf.config if plan.hf is not None else plan.model.hf_config.to_dict()
        model_type = str(kind.get("model_type"))
        made = peft_adapter.plan_adapter(
            settings, factors, base, model_type=model_type, where=where
        )
    except BaseException:
        ad.close()
        raise
    return dataclasses.replace(plan, adapter=Adapter(ad, made))


def _factor_module(name: str) -> str:
    """The module a PEFT factor tensor belongs to (``base_model.model.<module>.lora_A...``)."""
    return name.removeprefix(peft_adapter.PREFIX).split(".lora_", 1)[0]


# -- --as-lora: the adapter as the Tunix LoRA step train_sft resumes from ----------------------
def _import_as_lora(
    hf_dir: epath.PathLike | None,
    out: epath.PathLike,
    o: ImportOptions,
    *,
    maxtext_config: Sequence[str],
) -> ImportReport:
    """``import-hf --adapter DIR --as-lora``: the plan of the import (MaxText's leaves of the
    model, each with its HF tensors and hooks), the adapter planned against it as for a
    merge, then each adapted weight's factors carried through its hooks into qwix's
    (`peft_as_lora`), written as ``<out>/0/model_params``."""
    start = time.monotonic()
    _check_as_lora(o)
    hf = HfDir.open(hf_dir) if hf_dir is not None else None
    config = hf_mapping.load_config(maxtext_config)
    model = hf_mapping.load_import(config)
    budget = DEFAULT_BUDGET if o.memory_budget is None else o.memory_budget
    if hf is not None:
        check_config(hf, model)
        plan = plan_import(hf, model, peft_as_lora.DTYPE, budget)
    else:
        abstract = _abstract_params(model.config)
        leaves = [_leaf(model, key, abstract) for key in _mapped_keys(model, abstract)]
        plan = ImportPlan(None, model, leaves, peft_as_lora.DTYPE, budget)
    plan = with_adapter(o.adapter, plan)
    ad = plan.adapter
    dest = epath.Path(out) / "0"
    try:
        rank, alpha, module_path = hf_mapping.lora_settings(config)
        explicit = bool(config.lora.lora_module_path)
        weights, unheld = _lora_weights(plan, ad.plan, module_path, explicit)
        written = module_path if explicit else peft_as_lora.module_pattern(weights)
        lp = peft_as_lora.plan_as_lora(
            ad.plan, weights, unheld=unheld, rank=rank, alpha=alpha, module_path=written
        )
        if dest.exists():
            raise StepExistsError(
                f"{dest} exists; import-hf writes a new step: pass another --out."
            )
        if not o.dry_run:
            arrays = peft_as_lora.factors(lp, ad.dir.read)
            provenance = {
                "source_layout": peft_as_lora.SOURCE_LAYOUT,
                "converter": f"orbax-maxtext-layout {__version__}",
                "adapter": ad.plan.to_dict(),
                "as_lora": lp.to_dict(),
            }
            lora = lp.lora_metadata()
            renamed = _renames(model, [n for w in weights for n in w.hf])
            if renamed:  # export-hf --adapter gives the adapter's own names back
                lora["hf_names"] = renamed
            custom = {"lora": lora, SCAN_LAYERS_KEY: bool(config.scan_layers)}
            zarr3 = bool(getattr(config, "checkpoint_storage_use_zarr3", True))
            peft_as_lora.write_step(
                arrays, dest, provenance=provenance, custom=custom, use_zarr3=zarr3
            )
    finally:
        ad.dir.close()
        if hf is not None:  # its headers and config were all the step needed of it
            hf.close()
    shapes = lp.shapes()
    written = sum(math.prod(x) * 4 for x in shapes.values())
    # held: every factor (written at the end), and a weight's probes and checks, float64
    # copies of one layer's kernel
    held = written + 3 * 8 * max((math.prod(w.kernel) for w in weights), default=0)
    return ImportReport(
        str(o.adapter), str(out), config.model_name, bool(config.scan_layers), "float32",
        len(shapes), len(ad.plan.deltas), ad.bytes_read, written, held, o.dry_run,
        0.0 if o.dry_run else time.monotonic() - start,
        {**ad.plan.to_dict(), "as_lora": lp.to_dict()},
    )  # fmt: skip


def _check_as_lora(o: ImportOptions) -> None:
    if o.adapter is None or o.base is not None or o.save_dtype not in (None, "float32"):
        raise UsageError(
            "--as-lora writes a PEFT adapter as a MaxText LoRA step: give --adapter, and no "
            "--base (the step holds the adapter alone) or --save-dtype (its factors are "
            "float32, as qwix makes them for MaxText's float32 weights)."
        )


def _lora_weights(
    plan: ImportPlan, adapter: peft_adapter.AdapterPlan, module_path: str, explicit: bool
) -> tuple[list[peft_as_lora.Weight], dict[str, str]]:
    """The weights of the step: each weight of a module the adapter changes in any layer
    (unscanned: in every layer, zero where PEFT leaves a layer, as a scanned weight is), if
    MaxText's LoRA adapts it (qwix fullmatches ``module_path``); and why each other adapted
    HF tensor has no place in the step. An ``explicit`` module path (the config's) must
    match no other weight: ``train_sft`` would find no factors for it and fail."""
    weights, unheld, held = [], {}, set()
    for leaf in plan.leaves:
        hit = [n for n in _names(leaf.hf) if n in adapter.deltas]
        if not hit or any(adapter.deltas[n].experts for n in hit):
            continue  # nothing adapted; expert adapters are refused by the LoRA plan
        module = "/".join(leaf.paths[0][2:-1])
        why = _unheld(plan, leaf, module, module_path)
        if why is None:
            held.add(peft_as_lora.generic(module))
        else:
            unheld.update(dict.fromkeys(hit, why))
    others = []
    for leaf in plan.leaves:
        module = "/".join(leaf.paths[0][2:-1])
        if peft_as_lora.generic(module) in held:
            weights.append(_weight(plan, leaf))
        elif explicit and re.fullmatch(module_path, module) and _matrix(plan, leaf):
            others.append(module)
    if others:
        raise peft_as_lora.AsLoraRefusedError(
            f"lora.lora_module_path {module_path!r} matches modules the adapter has no "
            "factors for (train_sft would find none to restore):",
            others,
            hint="Nothing was written. Leave lora.lora_module_path unset: the step records "
            "the adapter's own modules, and the command to resume with.",
        )
    return weights, unheld


def _matrix(plan: ImportPlan, leaf: Leaf) -> bool:
    names = list(_names(leaf.hf))
    return bool(names) and len(plan.hf_shape(names[0])) == 2


def _unheld(plan: ImportPlan, leaf: Leaf, module: str, module_path: str) -> str | None:
    """Why MaxText's LoRA holds no factors for ``leaf``'s HF tensors, or None."""
    if not re.fullmatch(module_path, module):
        return (
            f"MaxText's LoRA does not adapt {module} (lora_module_path {module_path!r} does "
            "not match it: embeddings, the output layer and norms hold no LoRA factors)"
        )
    if len(leaf.keys) != 1 or any(isinstance(hf, tuple) for _, hf in leaf.slices()):
        return f"MaxText's mapping fuses it with other tensors into {module}"
    if len(leaf.axes) > 1 or not _matrix(plan, leaf):
        return f"{module} is not one matrix a layer (an expert or a stacked weight)"
    return None


def _weight(plan: ImportPlan, leaf: Leaf) -> peft_as_lora.Weight:
    """``leaf`` as a weight of the LoRA step: MaxText's import hooks of one layer, on the
    whole HF tensor and, traced when first asked, on a box of it (`hooks_by_box`)."""
    from maxtext.checkpoint_conversion.utils.tensor_handling import apply_hook_fns

    names = tuple(_names(leaf.hf))
    shape = tuple(plan.hf_shape(names[0]))

    def run(m: Any) -> Any:  # float32, as the import runs the hooks
        return apply_hook_fns(m, leaf.slice_shape, leaf.hooks)

    def hook(m: np.ndarray) -> np.ndarray:
        return np.asarray(run(np.asarray(m, np.float32)))

    traced: list[PieceFn | None] = []

    def box(start: tuple[int, ...], data: np.ndarray) -> list | None:
        if not traced:
            traced.append(PieceFn.trace(run, shape, np.dtype(np.float32), [leaf.slice_shape]))
        return None if traced[0] is None else traced[0].apply(start, data)

    axis = leaf.axes[0] if leaf.axes else None
    hooks = leaf.hooks if isinstance(leaf.hooks, (list, tuple)) else [leaf.hooks]
    return peft_as_lora.Weight(
        leaf.paths[0][2:], leaf.slice_shape, axis, names, shape, hook, box,
        tuple(id(h) for h in hooks),  # MaxText's own functions: shared by a module's layers
    )  # fmt: skip


def _adapter_line(report: ImportReport) -> str:
    a = report.adapter
    if not a:
        return ""
    lora = a.get("as_lora")
    if lora:
        return (
            f"; the PEFT adapter {a['adapter']} as a MaxText LoRA step: {len(lora['modules'])} "
            f"weights, rank {lora['rank']}, alpha {lora['alpha']:g} (scale {lora['scale']:g}; "
            f"PEFT ranks {a['ranks']}, scales {a['scales']}). Resume it with train_sft "
            f"lora.enable_lora=true lora.lora_rank={lora['rank']} lora.lora_alpha="
            f"{lora['alpha']:g} 'lora.lora_module_path={lora['module_path']}' "
            f"lora.lora_restore_path={report.out}/0/model_params"
        )
    return (
        f"; merged the PEFT adapter {a['adapter']} into {a['tensors']} tensors of "
        f"{a['modules']} modules (ranks {a['ranks']}, scales {a['scales']})"
    )


# -- checks and the plan -------------------------------------------------------------------
def check_config(hf: HfDir, model: HfModel) -> None:
    """``config.json`` against MaxText's Hugging Face config of the model, resized to the
    MaxText config: every field of `CHECKED_FIELDS` either holds, the MaxText value
    differing is a `LayoutMismatchError` naming each (field, HF value, MaxText value)."""
    mine = model.hf_config.to_dict()
    theirs = hf.config
    if "text_config" in mine and theirs.get("model_type") != mine.get("model_type"):
        mine = {**mine["text_config"], "tie_word_embeddings": mine.get("tie_word_embeddings")}
    problems = []
    for field in CHECKED_FIELDS:
        want = mine.get(field)
        got = theirs.get(field, _derived(theirs, field))
        if want is None or got is None:
            continue
        if field == "model_type" and _same_kind(got, want):
            continue
        if got != want:
            problems.append(f"{field} (HF={got!r} vs MaxText={want!r})")
    if problems:
        raise LayoutMismatchError(
            f"{hf.dir}/config.json does not describe the MaxText model "
            f"{model.model_name} of the config:",
            problems,
            hint="Pass the --maxtext-config (model_name and sizes) of this checkpoint.",
        )


def _derived(cfg: dict, field: str) -> Any:
    if field == "head_dim" and cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    if field == "tie_word_embeddings":
        return False  # transformers' default
    return None


def _same_kind(got: str, want: str) -> bool:
    """A text-only checkpoint of a multimodal family (``gemma3_text`` for ``gemma3``)."""
    return got.removesuffix("_text") == want.removesuffix("_text")


def plan_base(
    base: epath.PathLike, model: HfModel, save_dtype: str | None, budget: int
) -> ImportPlan:
    """The plan of ``--base STEP``: MaxText's leaves of the model (its mapping, without a
    Hugging Face directory), each checked in the step (`BaseStep.open`); the dtype written is
    ``save_dtype``, else the step's own (one for every param, or refused)."""
    abstract = _abstract_params(model.config)
    leaves = [_leaf(model, key, abstract) for key in _mapped_keys(model, abstract)]
    wanted = {p: s for lf in leaves for p, s in zip(lf.paths, lf.shapes, strict=True)}
    step = BaseStep.open(base, wanted)
    if save_dtype is None:
        kinds = sorted({d.name for d in step.dtypes.values()})
        if len(kinds) != 1 or kinds[0] not in SAVE_DTYPES:
            raise UsageError(
                f"{base}: its params are {', '.join(kinds)}: pass --save-dtype "
                f"({' or '.join(SAVE_DTYPES)})."
            )
        save_dtype = kinds[0]
    return ImportPlan(None, model, leaves, SAVE_DTYPES[save_dtype], budget, base=step)


def _mapped_keys(model: HfModel, abstract: dict[str, tuple[int, ...]]) -> list[Any]:
    from maxtext.checkpoint_conversion.utils.utils import validate_and_filter_param_map_keys

    return validate_and_filter_param_map_keys(model.param_map.keys(), abstract.keys())


def plan_import(hf: HfDir, model: HfModel, save_dtype: np.dtype, budget: int) -> ImportPlan:
    """Every MaxText param of the model with its HF sources, from metadata only: each HF
    tensor named must be in the directory with the shape MaxText's ``HF_SHAPE`` gives it,
    and every param of MaxText's abstract model must have a source."""
    abstract = _abstract_params(model.config)
    keys = _mapped_keys(model, abstract)
    leaves, problems = [], []
    for key in keys:
        leaf = _leaf(model, key, abstract)
        problems += _missing(hf, model, leaf)
        leaves.append(dataclasses.replace(leaf, hf=_as_stored(hf.tensors, leaf.hf)))
    mapped = {k for lf in leaves for k in lf.keys}
    problems += [
        f"{k}: MaxText's mapping gives it no Hugging Face source"
        for k in abstract
        if k not in mapped
    ]
    if problems:
        raise LayoutMismatchError(
            f"{hf.dir} does not hold the tensors MaxText's {model.model_name} is made of:",
            problems,
            hint="Pass the --maxtext-config (model_name and sizes) of this checkpoint.",
        )
    return ImportPlan(hf, model, leaves, save_dtype, budget)


def _abstract_params(config: Any) -> dict[str, tuple[int, ...]]:
    """MaxText key (``params-decoder-...``) -> shape, from ``to_maxtext``'s own abstract model."""
    import sys

    with contextlib.redirect_stdout(sys.stderr):
        from maxtext.checkpoint_conversion import to_maxtext

        abstract, _ = to_maxtext.get_maxtext_model_info(config)
    return {k: tuple(shape) for k, (_, shape) in abstract.items()}


def _leaf(model: HfModel, key: Any, abstract: dict[str, tuple[int, ...]]) -> Leaf:
    from maxtext.checkpoint_conversion.utils.tensor_handling import nesting_depth, stacked_axes

    keys = key if isinstance(key, tuple) else (key,)
    hf = model.param_map[key]
    shapes = tuple(abstract[k] for k in keys)
    depth = nesting_depth(hf) if isinstance(hf, list) else 0
    if depth == 0:
        axes: tuple[int, ...] = ()
    elif depth == 1:
        axes = (_single_axis(model.config, keys[0], shapes[0]),)
    else:
        axes = tuple(stacked_axes(keys[0], model.config, depth))
    paths = tuple(("params", *k.split("-")) for k in keys)
    return Leaf(keys, paths, shapes, hf, axes, model.hook_map.get(key))


def _single_axis(config: Any, key: str, shape: tuple[int, ...]) -> int:
    """The axis a one-level list of HF tensors stacks on: the layer axis of a scanned
    model (``param_scan_axis``, or 0 for a rank it exceeds), the expert axis (0) of an
    unscanned MoE param. ``to_maxtext`` also stacks a scanned ``MoeBlock`` param that is a
    list of layers on 0, and crashes on MaxText's own scanned mixtral: its layers are on
    ``param_scan_axis`` there as everywhere."""
    if not config.scan_layers or "MoEBiasVar" in key or "Tid2EidVar" in key:
        return 0
    return config.param_scan_axis if len(shape) > config.param_scan_axis else 0


def _names(hf: Any) -> Iterator[str]:
    if isinstance(hf, (list, tuple)):
        for sub in hf:
            yield from _names(sub)
    elif hf is not None:
        yield hf


def _missing(hf: HfDir, model: HfModel, leaf: Leaf) -> list[str]:
    """The problems of ``leaf``'s sources: HF tensors absent, or of the wrong shape."""
    out = []
    for name in _names(leaf.hf):
        info = hf.tensors.get(_stored_name(hf.tensors, name))
        want = model.shape_map.get(name)
        if info is None:
            out.append(f"{leaf.keys[0]}: no tensor {name}")
        elif want is not None and tuple(info.shape) != tuple(want):
            # the shape, not only its count: the hooks reshape what they are given, so a
            # permuted label would pass through them as scrambled values (HF_SHAPE is the
            # HF side's shape, before MaxText's transposes: each family the interop suite
            # writes with transformers stores exactly it)
            out.append(f"{name}: {list(info.shape)}, MaxText's {model.model_name} has {list(want)}")
    return out


def _stored_name(stored: Container[str], name: str) -> str:
    """The name of MaxText's tensor ``name`` among the ``stored`` names (a directory's
    tensors, an adapter's modules), through `NAME_ALIASES`; else ``name`` itself."""
    if name in stored:
        return name
    for theirs, ours in NAME_ALIASES:
        if name.startswith(theirs) and ours + name[len(theirs) :] in stored:
            return ours + name[len(theirs) :]
    return name


def _maxtext_name(known: Container[str], name: str) -> str:
    """`_stored_name` undone: the name MaxText's mapping gives the tensor stored as ``name``."""
    if name in known:
        return name
    for theirs, ours in NAME_ALIASES:
        if name.startswith(ours) and theirs + name[len(ours) :] in known:
            return theirs + name[len(ours) :]
    return name


def _renames(model: HfModel, names: Sequence[str]) -> dict[str, str]:
    """The `NAME_ALIASES` prefixes by which ``names`` (as an adapter spells them) differ from
    MaxText's mapping: MaxText's prefix -> the adapter's."""
    out = {}
    for n in names:
        m = _maxtext_name(model.shape_map, n)
        for theirs, ours in NAME_ALIASES:
            if m != n and m.startswith(theirs) and n == ours + m[len(theirs) :]:
                out[theirs] = ours
    return out


def _as_stored(stored: Container[str], node: Any) -> Any:
    """MaxText's nested names with each name as ``stored`` spells it (`_stored_name`)."""
    if isinstance(node, list):
        return [_as_stored(stored, n) for n in node]
    if isinstance(node, tuple):
        return tuple(_as_stored(stored, n) for n in node)
    return None if node is None else _stored_name(stored, node)


def _slice_bytes(plan: ImportPlan, leaf: Leaf, hf: Any) -> int:
    if plan.hf is None:  # --base: the slice read, in float32 to be merged
        read = 4 * math.prod(leaf.slice_shape) * len(leaf.keys)
    else:
        read = sum(plan.hf.tensors[n].nbytes for n in _names(hf))
    if plan.adapter is not None:  # a merged tensor also holds its block of float32 sums
        read += sum(plan.adapter.plan.held(n, 4 * math.prod(plan.hf_shape(n))) for n in _names(hf))
    made = math.prod(leaf.slice_shape) * plan.save_dtype.itemsize * len(leaf.keys)
    return max(read, made)


def _workers() -> int:
    """Two workers a core, at most 8 (`storage.memory.IMPORT`): a worker spends most of a
    slice waiting for tensorstore to encode and write its blocks, and a page-cache write on
    a VM's disk sleeps in writeback (an 8B import on 2 cores spent 20% of its slices idle or
    in iowait with one worker a core: a median of 2.09x the read-and-encode floor in 9 runs,
    1.95x in 8 with two; docs/performance.md, import-hf). The budget, not the worker count,
    bounds what is held: a worker past it waits at the gate."""
    return IMPORT.count()


# -- writing ----------------------------------------------------------------------------------
def _write_step(plan: ImportPlan, dest: epath.Path, progress: Callable | None) -> None:
    """``dest`` built where its store builds a new step and published whole, as `merge-lora`
    publishes (`stepdir.building_step`)."""
    store = store_for(dest)
    with stepdir.building_step(dest, store=store) as work:
        tmp = stepdir.new_tmp_dir(work, store=store)
        _write_items(plan, tmp, progress, store=store)
        provenance = {
            "source_layout": SOURCE_LAYOUT,
            "converter": f"orbax-maxtext-layout {__version__}",
            "hf_dir": str(plan.hf.dir) if plan.hf is not None else None,
            "save_dtype": plan.save_dtype.name,
            "bytes_read": plan.hf.bytes_read if plan.hf is not None else plan.bytes_read,
        }
        if plan.base is not None:
            provenance["base"] = str(plan.base.dir)
        if plan.adapter is not None:
            provenance["adapter"] = plan.adapter.plan.to_dict()
        custom = {SCAN_LAYERS_KEY: bool(plan.model.config.scan_layers)}
        stepdir.commit(work, tmp, provenance, store=store, meta={}, custom=custom)


def _write_items(
    plan: ImportPlan, tmp: epath.Path, progress: Callable | None, *, store: StepStore
) -> None:
    """Every param's arrays made (each slice its own chunk), every slice written, then
    ``step`` and the item's JSON files, ``_METADATA`` last."""
    ctx = item_writer.ts_context()
    zarr3 = bool(getattr(plan.model.config, "checkpoint_storage_use_zarr3", True))
    kv = orbax_files.open_kvstore(tmp, ctx, use_ocdbt=True)
    dst = kv.spec().to_json()
    arrays: dict[Path, ts.TensorStore] = {}
    chunks: dict[Path, list[int]] = {}
    for leaf in plan.leaves:
        for path, shape in zip(leaf.paths, leaf.shapes, strict=True):
            chunk = chunk_shape(shape, leaf.axes, plan.save_dtype.itemsize)
            name = orbax_files.param_name(path)
            arrays[path] = item_writer.create_array(
                dst, name, shape, plan.save_dtype, chunk, use_zarr3=zarr3, context=ctx
            )
            chunks[path] = chunk
    # the new data files leave the page cache once written (nothing here reads them back)
    with store.drop_written(tmp / item_writer.DATA_DIR):
        _run_slices(plan, arrays, chunks, progress)
    item_writer.write_array(dst, "step", np.asarray(0, np.int64), use_zarr3=zarr3, context=ctx)
    leaves = {
        path: orbax_files.leaf_files(None, None, list(shape), None)
        for lf in plan.leaves
        for path, shape in zip(lf.paths, lf.shapes, strict=True)
    }
    for path, files in leaves.items():
        files.array_meta["chunk_shape"] = chunks[path]
    others = {
        ("step",): {"value_type": "scalar", "skip_deserialize": False},
        ("opt_state",): {"value_type": "Dict", "skip_deserialize": True},
    }
    orbax_files.write_metadata(tmp, leaves, use_zarr3=zarr3, others=others)


def _run_slices(plan: ImportPlan, arrays: dict, chunks: dict, progress: Callable | None) -> None:
    """Every slice read, cast, hooked and written, two workers a core (`_workers`), within the
    budget.

    What a real-size import spends its time on is memory traffic, so none of it goes to
    fresh memory where it can be helped (`_SliceScratch`: a new page is zeroed by the kernel first,
    1 to 3 s a GiB on a VM): each worker reads its slices into a buffer of its own and copies
    their row blocks into another, which tensorstore references instead of copying
    (docs/performance.md, import-hf)."""
    jobs = [(lf, idx, hf) for lf in plan.leaves for idx, hf in lf.slices()]
    jobs.sort(key=lambda j: -_slice_bytes(plan, j[0], j[2]))  # the largest first
    gate = Gate(plan.budget, cap=True)  # a slice over the budget holds the budget, alone
    done, lock = [0], threading.Lock()
    scratch = _SliceScratch()

    def tick() -> None:
        if progress is not None:
            with lock:
                done[0] += 1
                progress(done[0], len(jobs))

    def one(job: tuple[Leaf, tuple[int, ...], Any]) -> None:
        leaf, idx, hf = job
        held = gate.take(HOLD * _slice_bytes(plan, leaf, hf))
        try:
            made = _slice(plan, leaf, hf, scratch, idx=idx)
            for path, data in zip(leaf.paths, made, strict=True):
                _write_slice(arrays[path], leaf.axes, idx, data, chunks[path], scratch=scratch)
        finally:
            gate.give(held)
        tick()

    # A slice over the budget runs alone, first: waiting for the gate to empty while other
    # workers keep taking small slices would leave it to the end, on one core (117 s at 8B).
    # Its row blocks are written by every worker (`_write_slice`'s ``pool``).
    big = [j for j in jobs if HOLD * _slice_bytes(plan, j[0], j[2]) > plan.budget]
    # each block in flight holds its copy and its encoding: together at most half the budget
    in_flight = max(1, min(_workers(), plan.budget // (4 * CHUNK_BYTES)))
    with ThreadPoolExecutor(_workers()) as pool:
        for leaf, idx, hf in big:
            made = _slice(plan, leaf, hf, scratch, idx=idx)
            for path, data in zip(leaf.paths, made, strict=True):
                _write_slice(
                    arrays[path], leaf.axes, idx, data, chunks[path], pool=(pool, in_flight)
                )
            del made
            tick()
        scratch.drop()  # this thread's read buffer (the largest slice's size), reused till here
        results(pool.submit(one, j) for j in jobs if j not in big)


class _SliceScratch(threading.local):
    """Each thread's reused buffers (``"read"``: its slice's source bytes; ``"block"``: the
    row block it copies; ``"packed"``: `_transpose`'s words), grown to the largest asked for,
    kept until the import ends."""

    def __init__(self) -> None:
        self.bufs: dict[Any, np.ndarray] = {}

    def get(self, kind: Any, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes (uint8) of this thread's buffer ``kind``."""
        buf = self.bufs.get(kind)
        if buf is None or buf.nbytes < nbytes:
            self.bufs.pop(kind, None)
            buf = self.bufs[kind] = small_pages(nbytes)
        return buf[:nbytes]

    def drop(self) -> None:
        self.bufs.clear()


def chunk_shape(shape: Sequence[int], axes: tuple[int, ...], itemsize: int) -> list[int]:
    """The chunks of a written param: one slice each (1 on every stacked axis), a slice over
    `CHUNK_BYTES` cut on its first other axis into row blocks under it (`_rows`)."""
    chunk = [1 if i in axes else d for i, d in enumerate(shape)]
    free = [i for i in range(len(shape)) if i not in axes and shape[i] > 1]
    if free and math.prod(chunk) * itemsize > CHUNK_BYTES:
        row = math.prod(chunk) // chunk[free[0]] * itemsize
        chunk[free[0]] = _rows(shape[free[0]], max(1, CHUNK_BYTES // row))
    return chunk


def _rows(n: int, most: int) -> int:
    """Rows of a row block: the most rows under ``most`` that divide ``n`` (at least half
    of ``most``), else ``most``. A block that ends past the array is an edge chunk, and
    tensorstore writes one through a copy of the whole chunk padded with the fill value
    (its own buffer, zeroed page by page, and the padding encoded); an 8B llama's MLP
    kernels (4,096 rows of 2,340 a chunk) made half their chunks edges: 4.6 of 15 GiB."""
    for rows in range(most, max(1, most // 2) - 1, -1):
        if n % rows == 0:
            return rows
    return most


def _write_slice(
    array: ts.TensorStore,
    axes: tuple[int, ...],
    idx: tuple[int, ...],
    data,
    chunk: list[int],
    *,
    scratch: _SliceScratch | None = None,
    pool: tuple[ThreadPoolExecutor, int] | None = None,
) -> None:
    """``data`` written at index ``idx`` on ``axes`` of ``array`` (the whole array for none),
    a chunk's row block at a time: tensorstore holds one block's encoding, never a second copy
    of the slice. A block ``data`` holds contiguous is written from ``data`` itself; any other
    (a transposed view: MaxText's ``reshape_kernel``) is first copied into a buffer of this
    thread (`_SliceScratch`, ``scratch``; else a new one). With ``pool`` (a pool and how many
    blocks may be in flight), its workers write the blocks."""
    box = [slice(None)] * array.rank
    for axis, i in zip(axes, idx, strict=True):
        box[axis] = i
    array = array[tuple(box)]
    kept = [d for i, d in enumerate(chunk) if i not in axes]  # the chunk on the slice's axes
    cut = next((k for k, (c, n) in enumerate(zip(kept, data.shape, strict=True)) if c < n), None)
    if cut is None:
        parts = [(slice(None),) * data.ndim]
    else:
        step, n = kept[cut], data.shape[cut]
        parts = [(slice(None),) * cut + (slice(lo, min(lo + step, n)),) for lo in range(0, n, step)]
    if pool is not None and len(parts) > 1:
        executor, per = pool
        local = _SliceScratch()
        results(
            executor.submit(_write_blocks, array, data, parts[k::per], local) for k in range(per)
        )
        return
    _write_blocks(array, data, parts, scratch)


def _write_blocks(array: ts.TensorStore, data, parts: list[tuple], scratch: _SliceScratch | None):
    """`_write_slice`'s blocks ``parts`` of ``data``, in order, on this thread, one write in
    flight: a second (the next block copied while tensorstore encodes this one) held 0.3 GiB
    more at 8B, over the RSS goal's margin under load, for no time measurable here."""
    for part in parts:
        src = data[part]
        if isinstance(src, np.ndarray) and not src.flags.c_contiguous:
            if scratch is None:
                buf = np.empty(src.shape, src.dtype)
            else:
                buf = scratch.get("block", src.nbytes).view(src.dtype).reshape(src.shape)
            _copy(buf, src, scratch)
            src = buf
        # from memory nothing changes before the write is done: tensorstore need not copy it
        array[part].write(src, can_reference_source_data_indefinitely=True).result()


STRIP = 8  # columns a transposing copy of elements moves at once (fastest at 8 to 16 here)
# 8-byte words a transposing copy moves at once (`_transpose`): a wider strip is fewer NumPy
# calls for the same bytes, which two threads make under one GIL; 32 words moved 3.3 GiB/s
# on 2 threads here, 8 words 2.3 (an 8B llama's MLP kernels)
WORD_STRIP = 32
PACKED_BYTES = 16 << 20  # a transposing copy's packed rows (`_transpose`), at most


def _copy(out: np.ndarray, src: np.ndarray, scratch: _SliceScratch | None = None) -> None:
    """``out[...] = src`` (``out`` C-contiguous), as unsigned integers of the same size: NumPy
    copies an ``ml_dtypes`` bfloat16 element by element through its dtype's functions. A
    transposed view (MaxText's ``reshape_kernel``: HF ``[out, in]`` as ``[in, out]``, maybe
    with one side split into heads) is copied as the 2-D transpose it is: compiled for 2-byte
    items where the package was built with it (`storage.transpose`), else `_transpose`."""
    if src.dtype.itemsize in (1, 2, 4, 8):
        as_int = np.dtype(f"u{src.dtype.itemsize}")
        out, src = out.view(as_int), src.view(as_int)
    shape, strides = _merged(src.shape, src.strides)
    if len(shape) == 2 and strides[0] == src.itemsize and shape[1] > STRIP:
        src = np.lib.stride_tricks.as_strided(src, shape, strides, writeable=False)
        dst = out.reshape(shape)
        if not transpose.transpose_into(dst, src):  # compiled, 2-byte items
            _transpose(dst, src, scratch)
    else:
        np.copyto(out, src)


def _transpose(out: np.ndarray, src: np.ndarray, scratch: _SliceScratch | None) -> None:
    """``out[...] = src``, ``src`` a transposed view (``src.T``'s rows contiguous). NumPy
    copies a transposed 2-byte array at 0.25 GiB/s here, in strips of `STRIP` columns at 1.4,
    and as this does at 2.3 to 3.3: ``g`` elements of a row of ``src.T`` moved as one 8-byte
    word (a transpose of ``g`` x ``g`` blocks, in strips of `WORD_STRIP` words), then each
    block transposed inside, a sequential pass. A ``src`` whose rows do not pack into words
    goes in strips."""
    rows, cols = src.shape
    g = 8 // src.itemsize
    words = src.T.view(np.uint64) if g > 1 and rows % g == 0 else None
    if words is None:
        for j in range(0, cols, STRIP):
            out[:, j : j + STRIP] = src[:, j : j + STRIP]
        return
    step = max(g, PACKED_BYTES // (cols * 8) * g)  # rows of ``out`` per pass
    for lo in range(0, rows, step):
        n = min(step, rows - lo)
        if scratch is None:
            packed = np.empty((n // g, cols), np.uint64)
        else:
            packed = scratch.get("packed", n * cols * src.itemsize).view(np.uint64)
            packed = packed.reshape(n // g, cols)
        part = words[:, lo // g : (lo + n) // g].T  # [n / g, cols], transposed
        for j in range(0, cols, WORD_STRIP):
            packed[:, j : j + WORD_STRIP] = part[:, j : j + WORD_STRIP]
        # packed[r, c] holds src[lo + g r : lo + g (r + 1), c]
        unpacked = packed.view(src.dtype).reshape(n // g, cols, g).transpose(0, 2, 1)
        np.copyto(out[lo : lo + n].reshape(n // g, g, cols), unpacked)


def _merged(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[list, list]:
    """``shape`` and ``strides`` with every axis of length 1 dropped and every two adjacent
    axes that step as one merged: the same elements in the same order, fewest axes."""
    dims = [(n, s) for n, s in zip(shape, strides, strict=True) if n != 1]
    out: list[list[int]] = []
    for n, s in dims:
        if out and out[-1][1] == n * s:
            out[-1] = [out[-1][0] * n, s]
        else:
            out.append([n, s])
    return [d[0] for d in out], [d[1] for d in out]


def _slice(
    plan: ImportPlan,
    leaf: Leaf,
    hf: Any,
    scratch: _SliceScratch | None = None,
    *,
    idx: tuple[int, ...] = (),
) -> list[np.ndarray]:
    """One slice of ``leaf`` (per MaxText param of it; ``idx`` on its stacked axes), as
    ``to_maxtext`` makes it: its HF tensors read (into this thread's buffer of ``scratch``,
    if given) and cast (`cast`), then MaxText's hooks for the slice's shape. With ``--base``,
    the step's slice with the adapter merged (`_base_slice`)."""
    from maxtext.checkpoint_conversion.utils.tensor_handling import apply_hook_fns

    if plan.base is not None:
        return _base_slice(plan, leaf, hf, idx)
    if hf is None:
        raw = None
    elif isinstance(hf, tuple):
        at, parts = 0, []
        for n in hf:
            parts.append(cast(_source(plan, n, scratch, at), plan.save_dtype))
            at += plan.hf.tensors[n].nbytes
        raw = tuple(parts)
    else:
        raw = cast(_source(plan, hf, scratch), plan.save_dtype)
    made = np.asarray(apply_hook_fns(raw, leaf.slice_shape, leaf.hooks))
    if len(leaf.keys) == 1:
        return [made.reshape(leaf.slice_shape)]
    # a composite key: the hook's output split on its last axis, as to_maxtext splits it
    return [made[..., i] for i in range(len(leaf.keys))]


def _base_slice(plan: ImportPlan, leaf: Leaf, hf: Any, idx: tuple[int, ...]) -> list[np.ndarray]:
    """``--base STEP``: the step's slice of each param of ``leaf``, plus MaxText's hooks of
    the adapter's float32 deltas of the slice's HF tensors (zero where it has none), minus
    the hooks of zero: what a hook adds to ``W + delta`` beyond what it adds to ``W`` where it
    is affine (every MaxText 0.2.5 weight hook: reshapes, transposes, a constant scale), with
    the base's own values where the adapter changes nothing; cast once."""
    from maxtext.checkpoint_conversion.utils.tensor_handling import apply_hook_fns

    step = [plan.base.read(p, leaf.axes, idx) for p in leaf.paths]
    names = [n for n in _names(hf) if n in plan.adapter.plan.deltas]
    if not names:
        return [cast(x, plan.save_dtype) for x in step]

    def hooked(delta: Callable[[str], np.ndarray]) -> list[np.ndarray]:
        raw = tuple(map(delta, hf)) if isinstance(hf, tuple) else delta(hf)
        made = np.asarray(apply_hook_fns(raw, leaf.slice_shape, leaf.hooks), np.float32)
        if len(leaf.keys) == 1:
            return [made.reshape(leaf.slice_shape)]
        return [made[..., i] for i in range(len(leaf.keys))]

    def zero(n: str) -> np.ndarray:
        return np.zeros(plan.hf_shape(n), np.float32)

    ad = plan.adapter

    def delta(n: str) -> np.ndarray:
        d = ad.plan.deltas.get(n)
        return zero(n) if d is None else d.compute(ad.dir.read)

    out = []
    for x, d, z in zip(step, hooked(delta), hooked(zero), strict=True):
        # float32 (a hook run by JAX gives a read-only array: new ones), then the cast once
        out.append(cast((d - z) + x, plan.save_dtype))
    return out


def _source(plan: ImportPlan, name: str, scratch: _SliceScratch | None, at: int = 0) -> np.ndarray:
    """HF tensor ``name`` as the import takes it: read (`_read`), and with ``--adapter`` its
    delta added in float32 where the adapter changes it (before the cast, as PEFT merges into
    the float32 weights its ``merge_and_unload`` returns), each sum cast as `cast` casts it,
    into the bytes just read where the dtypes agree (the read buffer is this read's own)."""
    x = _read(plan.hf, name, scratch, at)
    if plan.adapter is None:
        return x
    return plan.adapter.merge(name, x, plan.save_dtype, in_place=True)


def _read(hf: HfDir, name: str, scratch: _SliceScratch | None, at: int = 0) -> np.ndarray:
    """Tensor ``name``, read into bytes ``[at, ...)`` of this thread's read buffer where
    ``scratch`` gives one (`HfDir.read_into`), else into a fresh array. Read, never mapped:
    a mapped page of a shard cut short meanwhile raises SIGBUS, where a read is refused
    (`HfInputError` naming the file; a read copies each byte from the page cache: 6 of the
    60 s of CPU an 8B import spent)."""
    if scratch is None:
        return hf.read(name)
    nbytes = hf.tensors[name].nbytes
    return hf.read_into(name, scratch.get("read", at + nbytes)[at : at + nbytes])


def cast(x: np.ndarray, save_dtype: np.dtype) -> np.ndarray:
    """A source tensor as ``to_maxtext``'s ``_convert_tensor_to_numpy`` gives it with torch
    installed: float32 for a float32 save; for a bfloat16 save a bfloat16 tensor as it is and
    any other through float32 to bfloat16 (round to nearest even)."""
    if save_dtype == np.float32:
        return x if x.dtype == np.float32 else x.astype(np.float32)
    if x.dtype == save_dtype:
        return x
    return x.astype(np.float32).astype(save_dtype)


# -- a Hugging Face directory read as a checkpoint ----------------------------------------------
def is_hf_dir(path: epath.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face directory (``config.json`` and safetensors)."""
    d = epath.Path(str(path).rstrip("/"))
    store = store_for(d)  # within a restore, an object store is asked each once
    try:
        # config.json first: an Orbax item has none, and on an object store each check
        # waits a round trip
        if not store.exists(d / "config.json"):
            return False
        return store.exists(d / "model.safetensors") or store.exists(
            d / "model.safetensors.index.json"
        )
    except OSError:
        return False


def load_params(
    hf_dir: epath.PathLike, collection: Any, *, maxtext_config: Sequence[str] | None
) -> Any:
    """MaxText's params (``collection``: the abstract ``items/params`` tree, ``{"params":
    {...}}``) read from the Hugging Face directory ``hf_dir``, converted on read exactly as
    `import_hf` writes them (the same slices, casts to each leaf's dtype, MaxText's hooks).
    Each leaf comes with its abstract sharding (none: a host array); each process reads only
    the slices (layers, experts) its addressable shards hold, each once.

    Raises:
      UsageError: no MaxText config to map with (``maxtext_config`` None).
      HfInputError, LayoutMismatchError: as `import_hf`, and a leaf whose shape differs.
    """
    if not maxtext_config:
        raise UsageError(
            f"{hf_dir} is a Hugging Face directory: reading it as MaxText params needs the "
            "model's MaxText config. Run the trainer through `python -m "
            "orbax_maxtext_layout.maxtext MODULE CONFIG KEY=VALUE...` (it passes its own), or "
            "call load_params_from_path(..., maxtext_config=[CONFIG, 'KEY=VALUE', ...])."
        )
    import jax

    hf = HfDir.open(hf_dir)
    model = hf_mapping.load_import(hf_mapping.load_config(maxtext_config))
    check_config(hf, model)
    flat = {
        tuple(str(k.key) for k in p): v
        for p, v in jax.tree_util.tree_flatten_with_path(collection)[0]
    }
    plan = plan_import(hf, model, np.dtype(np.float32), DEFAULT_BUDGET)
    out = {}
    problems = []
    for leaf in plan.leaves:
        for k, (path, shape) in enumerate(zip(leaf.paths, leaf.shapes, strict=True)):
            want = flat.get(path[1:])
            if want is None:
                continue  # a partial restore: only the leaves asked for
            if tuple(want.shape) != tuple(shape):
                problems.append(
                    f"{'/'.join(path[1:])}: asked {tuple(want.shape)}, the model has {shape}"
                )
                continue
            out[path[1:]] = _leaf_array(plan, leaf, k, want)
    missing = sorted("/".join(p) for p in flat if p not in out)
    if problems or missing:
        raise LayoutMismatchError(
            f"{hf_dir} cannot give the params asked for:",
            problems + [f"{p}: not in MaxText's mapping of {model.model_name}" for p in missing],
            hint="Pass the --maxtext-config of the model being trained.",
        )
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(collection), [out[p] for p in flat]
    )


def _leaf_array(plan: ImportPlan, leaf: Leaf, k: int, want: Any) -> Any:
    """Part ``k`` of ``leaf`` as an array like ``want`` (shape, dtype, sharding): each
    addressable shard filled from the slices it holds, then put on its device."""
    import jax

    dtype = np.dtype(want.dtype)
    sharding = getattr(want, "sharding", None)
    shape = tuple(want.shape)
    if sharding is None:
        boxes = {None: tuple(slice(0, n) for n in shape)}
    else:
        boxes = {
            d: _box(idx, shape)
            for d, idx in sharding.addressable_devices_indices_map(shape).items()
        }
    bufs = {b: np.empty([s.stop - s.start for s in b], dtype) for b in set(boxes.values())}
    cast_plan = dataclasses.replace(plan, save_dtype=_cast_dtype(dtype))  # once per leaf
    for idx, hf in leaf.slices():
        held = [
            b
            for b in bufs
            if all(b[a].start <= i < b[a].stop for a, i in zip(leaf.axes, idx, strict=True))
        ]
        if not held:
            continue  # no shard of this process holds this slice: not read
        data = _slice(cast_plan, leaf, hf)[k]
        for b in held:
            _fill(bufs[b], b, leaf.axes, idx, np.asarray(data).astype(dtype, copy=False))
    if sharding is None:
        return bufs[boxes[None]]
    arrays = [jax.device_put(bufs[b], d) for d, b in boxes.items()]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _cast_dtype(dtype: np.dtype) -> np.dtype:
    """The cast a leaf's slices get: to its own dtype where `cast` knows it (float32,
    bfloat16), else float32 (then converted as stock Orbax converts a float32 step)."""
    return dtype if dtype in SAVE_DTYPES.values() else np.dtype(np.float32)


def _box(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def _fill(
    buf: np.ndarray,
    box: tuple[slice, ...],
    axes: tuple[int, ...],
    idx: tuple[int, ...],
    data: np.ndarray,
) -> None:
    """The part of slice ``data`` (index ``idx`` on ``axes``) inside ``box`` copied into
    ``buf`` (the shard at ``box``)."""
    dst: list[Any] = []
    src: list[Any] = []
    for a, s in enumerate(box):
        if a in axes:
            dst.append(idx[axes.index(a)] - s.start)
        else:
            dst.append(slice(None))
            src.append(slice(s.start, s.stop))
    buf[tuple(dst)] = data[tuple(src)]
