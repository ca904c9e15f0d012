"""``export-hf --adapter``: a LoRA adapter step written as a PEFT adapter.

The plan is the merge's (`merge.adapter_moves`: the ``merge_lora`` move of each adapted
weight, against the model the config builds, without a base), with a new sink: each
module's factors are carried through MaxText's Hugging Face hooks of its weight
(`adapter_factors`) and written, layer by layer, under PEFT's names into
``adapter_model.safetensors`` (`formats.safetensors_writer.SafetensorsSink`: one file,
``adapter_config.json`` published last by `Sink.finish`). Only the factors are read,
each decoded once (`ItemReader.read_whole`: adapters are small).

A MoE layer's experts are written one PEFT module per expert, as MaxText's mapping writes
each expert's tensor: qwix's einsum factors hold one factor per expert and one shared by all
experts of the layer (`factor_cut` takes each expert's), so each expert's delta is a rank-r
LoRA of its own, the shared factor repeated. PEFT (0.21, with transformers 5) turns them into
LoRA on the fused 3-D expert parameters itself (docs/export-hf.md, "MoE experts").

Each module is checked on its first and last tensor before its tensors count: the carried
``lora_B @ lora_A`` against MaxText's hooks applied to the delta the merge adds (its own op
on the whole layer, then the tensor's slice), to float32 rounding. A module whose hooks
cannot be carried is refused, with every such module named, and nothing is published.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from etils import epath

from ..base.reports import Report
from ..base.treepaths import keystr
from ..errors import CheckpointReadError, LayoutMismatchError, StepExistsError, UsageError
from ..formats.safetensors_writer import SafetensorsSink
from ..formats.sink import Part, Sink, Tensor
from ..model import hf_mapping
from ..model.hf_mapping import HfModel, Unit
from ..model.lora import per_layer_shape
from ..model.target import Target
from ..orbax_io import item_writer, stepmeta
from ..orbax_io.orbax_files import param_name
from ..orbax_io.reader import ItemReader
from ..plan.moves import LoraFactor, Move
from ..storage.store import EXPORT_WORK_SUFFIX, store_for
from . import adapter_factors
from .delta import lora_delta_added
from .merge_plan import adapter_item, adapter_moves, read_adapters

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"  # published last on an object store
PEFT_PREFIX = "base_model.model."  # PEFT's names: the model wrapped once (``PeftModel``)


@dataclasses.dataclass
class AdapterReport(Report):
    """What ``export-hf --adapter`` wrote (or, with ``dry_run``, would write)."""

    step: str
    out: str
    status: str  # "dry-run" | "exported"
    model_name: str
    scan_layers: bool
    rank: int
    alpha: float
    dtype: str
    base_model_name_or_path: str
    target_modules: list[str]  # the adapted modules' last names (q_proj, ...), for people
    # What adapter_config.json's target_modules holds: a regular expression PEFT fullmatches
    # against module names, selecting exactly the adapted modules (`target_pattern`).
    target_pattern: str
    modules: list[dict[str, Any]]  # MaxText module -> HF module, layers, the check
    tensors: int
    bytes: int
    source: str = "tunix-lora-adapter"
    tensor_list: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    files: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def __str__(self) -> str:
        lines = [
            f"{self.status}: {self.step} -> {self.out}",
            f"  PEFT LoRA adapter of {self.model_name} (scan_layers="
            f"{str(self.scan_layers).lower()}): rank {self.rank}, alpha {self.alpha:g}, "
            f"{self.tensors} tensors, {self.bytes:,} bytes of {self.dtype}",
            f"  base_model_name_or_path {self.base_model_name_or_path}; target_modules "
            + ", ".join(self.target_modules),
        ]
        for m in self.modules:
            check = "" if m.get("check") is None else f", checked to {m['check']:.2g}"
            experts = f" x {m['experts']} experts" if m.get("experts") else ""
            lines.append(
                f"  {m['module']} -> {m['hf_module']} ({m['layers']} layers{experts}{check})"
            )
        return "\n".join(lines)


@dataclasses.dataclass
class _Module:
    """One adapted weight: its merge move, its units (one per HF tensor: a layer, or an
    expert of a layer), where each unit's factors lie (``cuts``) and the factor map."""

    move: Move
    units: list[Unit]
    cuts: list[FactorCut]
    fmap: adapter_factors.FactorMap
    hook: Any
    delta: Any

    @property
    def factor(self) -> LoraFactor:
        return self.move.op.factors(self.move)[0]


@dataclasses.dataclass(frozen=True)
class FactorCut:
    """Where one unit's factors lie in its weight's stored ones: ``layer`` on the factors'
    layer axis, then ``(axis, index)`` takes of the layer's ``a`` and ``b`` (an expert's, in
    the factor that holds the experts' axis), highest axis first; what is left of each is
    flattened to ``a (in, r)`` and ``b (r, out)``. ``kernel``: the same unit's takes of the
    layer's kernel (for the check against the merge's delta)."""

    layer: int | None
    a: tuple[tuple[int, int], ...] = ()
    b: tuple[tuple[int, int], ...] = ()
    kernel: tuple[tuple[int, int], ...] = ()

    def take(self, a: np.ndarray, b: np.ndarray, axis: int | None):
        a, b = _layer(a, axis, self.layer), _layer(b, axis, self.layer)
        for ax, i in self.a:
            a = np.take(a, i, axis=ax)
        for ax, i in self.b:
            b = np.take(b, i, axis=ax)
        return a.reshape(-1, a.shape[-1]), b.reshape(b.shape[0], -1)


@dataclasses.dataclass
class AdapterPlan:
    model: HfModel
    params_dir: epath.Path  # the step's model_params: the factors
    modules: list[_Module]
    shard: Part  # the one file, laid out by ``sink``
    config: dict[str, Any]
    report: AdapterReport
    sink: Sink


def plan_adapter(
    step: epath.PathLike,
    out: epath.PathLike,
    *,
    maxtext_config: Sequence[str],
    alpha: float | None = None,
    base_model_name_or_path: str | None = None,
    override_model_architecture: bool = False,
) -> AdapterPlan:
    """The adapter export of ``step``, from metadata alone (see `export_adapter`)."""
    step = epath.Path(step)
    adapter_dir, params_dir, adapters = _adapters_of(step)
    recorded, renames = _recorded(adapter_dir, adapters)
    alpha = alpha if alpha is not None else adapters.alpha
    if alpha is None:
        raise UsageError(
            f"{adapter_dir}: LoRA alpha is needed (the step does not record it; Tunix saves "
            "neither rank nor alpha): pass --alpha, the run's lora.lora_alpha."
        )
    argv = hf_mapping.with_scan_layers(list(maxtext_config), adapters.scanned, adapter_dir)
    config = hf_mapping.load_config(argv)
    model = hf_mapping.load_model(config, override_model_architecture=override_model_architecture)
    target = Target.from_maxtext_config(argv)
    moves = adapter_moves(adapters, target, alpha=float(alpha))  # metadata read once, above
    keyed = {"params-" + "-".join(str(k) for k in m.dst[2:]): m for m in moves}
    units = hf_mapping.plan_units(model, {k: m.out_spec.shape for k, m in keyed.items()})
    modules, problems = _modules(model, keyed, units)
    for m in modules:  # named as the adapter the step was imported from names them
        m.units = [_renamed(u, renames) for u in m.units]
    if problems:
        raise LayoutMismatchError(
            f"{step}: cannot write the adapters of {len(problems)} modules of "
            f"{model.model_name} as PEFT's lora_A/lora_B:",
            problems,
            hint="Merge them instead: export-hf STEP --base BASE, or merge-lora.",
        )
    tensors = [t for mod in modules for t in _tensors(mod)]
    sink = SafetensorsSink(1 << 62, weights_file=ADAPTER_FILE)  # one file, however large
    (shard,) = sink.layout(tensors)
    hf_id = base_model_name_or_path or recorded or hf_mapping.hf_id(model.model_name)
    names = {_hf_module(u) for m in modules for u in m.units}
    targets = sorted({n.rsplit(".", 1)[-1] for n in names})
    report = AdapterReport(
        step=str(step),
        out=str(out),
        status="dry-run",
        model_name=model.model_name,
        scan_layers=bool(model.scan_layers),
        rank=adapters.rank,
        alpha=float(alpha),
        dtype=np.dtype(tensors[0].dtype).name if tensors else adapters.dtype,
        base_model_name_or_path=hf_id,
        target_modules=targets,
        target_pattern=target_pattern(names | transformers5_names(names)),
        modules=[_module_row(m) for m in modules],
        tensors=len(tensors),
        bytes=sum(t.nbytes for t in tensors),
        tensor_list=[
            {"name": t.name, "shape": list(t.shape), "dtype": np.dtype(t.dtype).name}
            for t in sorted(tensors, key=lambda t: t.name)
        ],
    )
    return AdapterPlan(model, params_dir, modules, shard, _peft_config(report), report, sink)


def _adapters_of(step: epath.Path) -> tuple[epath.Path, epath.Path, Any]:
    """The LoRA step's directory, its params item and its factors (`read_adapters`); a step
    without factors is a `UsageError` saying to export it without ``--adapter``."""
    try:
        adapter_dir, params_dir = adapter_item(step)
        return adapter_dir, params_dir, read_adapters(adapter_dir, params_dir)
    except (LayoutMismatchError, CheckpointReadError) as e:
        if not step.exists():
            raise
        raise UsageError(
            f"{step}: --adapter exports a LoRA adapter step, and this step holds no LoRA "
            f"adapters ({str(e).splitlines()[0]}); export it without --adapter."
        ) from e


def _recorded(adapter_dir: epath.Path, adapters: Any) -> tuple[str | None, dict[str, str]]:
    """What the step records of its LoRA (``custom_metadata["lora"]``: ``import-hf
    --as-lora`` writes rank, alpha, the adapted modules, the PEFT base's name and how its
    module names differ from MaxText's mapping; MaxText's own saves its lora config), its
    rank and modules checked against the factors'; the recorded ``base_model_name_or_path``
    (None: none) and name prefixes (`_renamed`)."""
    rec = stepmeta.custom(stepmeta.read(adapter_dir)).get("lora")
    if not isinstance(rec, dict):
        return None, {}
    problems = []
    rank = rec.get("lora_rank")
    if isinstance(rank, int) and not isinstance(rank, bool) and rank > 0 and rank != adapters.rank:
        problems.append(f"lora_rank {rank} recorded, the factors' rank is {adapters.rank}")
    modules = rec.get("target_modules")
    if isinstance(modules, list) and sorted(map(str, modules)) != adapters.modules:
        have = set(adapters.modules)
        problems += [f"{m}: recorded, no factors" for m in sorted(set(modules) - have)]
        problems += [f"{m}: factors, not recorded" for m in sorted(have - set(modules))]
    if problems:
        raise LayoutMismatchError(
            f"{adapter_dir}: its LoRA factors disagree with what the step records "
            "(custom_metadata['lora']):",
            problems,
            hint="The step was changed after it was written; write it again.",
        )
    name = rec.get("base_model_name_or_path")
    return (name if isinstance(name, str) and name else None), _prefixes(rec.get("hf_names"))


_PREFIX = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*\.")


def _prefixes(rec: Any) -> dict[str, str]:
    """The recorded ``hf_names`` (MaxText's name prefix -> the adapter's, e.g.
    ``model.language_model.`` -> ``model.`` for a ``Gemma3ForCausalLM`` adapter); only
    dotted module-name prefixes, else none (the step's metadata is untrusted input)."""
    if not isinstance(rec, dict):
        return {}
    return {
        k: v
        for k, v in rec.items()
        if isinstance(k, str)
        and isinstance(v, str)
        and _PREFIX.fullmatch(k)
        and _PREFIX.fullmatch(v)
    }


def _renamed(unit: Unit, renames: dict[str, str]) -> Unit:
    for theirs, ours in renames.items():
        if isinstance(unit.hf_path, str) and unit.hf_path.startswith(theirs):
            return dataclasses.replace(unit, hf_path=ours + unit.hf_path[len(theirs) :])
    return unit


def _module_row(m: _Module) -> dict[str, Any]:
    """A module's line of the report (its ``check`` is filled in by the export)."""
    path = m.move.dst[2:]
    if path and str(path[-1]) == "kernel":
        path = path[:-1]
    # The layer index of the first unit (layers.0, or layers.1 for a block's second
    # sub-layer) as {i}, an expert's as {e}: every module of the report is named alike.
    name = re.sub(r"\.\d+\.", ".{i}.", _hf_module(m.units[0]), count=1)
    name = re.sub(r"\.experts\.\d+\.", ".experts.{e}.", name)
    experts = {tuple(re.findall(r"\.experts\.(\d+)\.", _hf_module(u))) for u in m.units}
    row = {"module": keystr(path), "hf_module": name, "layers": len(m.units), "check": None}
    if experts != {()}:
        row["experts"] = len(experts)
        row["layers"] = len(m.units) // len(experts)
    return row


def target_pattern(names: Iterable[str]) -> str:
    """A regular expression that PEFT fullmatches (``target_modules`` given as a string)
    against exactly the module names ``names`` (``model.layers.3.self_attn.q_proj``, ...).

    Bare suffixes (``q_proj``) select every module of that name in the model PEFT loads:
    gemma3's Hugging Face class holds a vision tower whose q/k/v projections would get LoRA
    layers too (81 of them, and PEFT's "Found missing adapter keys" warning). The names are
    grouped by their first index (the layer), written as an alternation of the indices."""
    groups: dict[tuple[str, str], set[int]] = {}
    for name in names:
        m = re.search(r"\.(\d+)\.", name)
        key = (name, "") if m is None else (name[: m.start()], name[m.end() :])
        groups.setdefault(key, set()).update([] if m is None else [int(m.group(1))])
    alts = []
    for (head, tail), layers in sorted(groups.items()):
        if not layers:
            alts.append(re.escape(head))
            continue
        index = "|".join(str(i) for i in sorted(layers))
        alts.append(rf"{re.escape(head)}\.(?:{index})\.{re.escape(tail)}")
    return "^(?:" + "|".join(alts) + ")$"


# transformers 5 renames some of the modules MaxText's Hugging Face names use (its
# conversion_mapping.py: mixtral's ``block_sparse_moe`` is ``mlp``).
TRANSFORMERS5_RENAMES = ((".block_sparse_moe.", ".mlp."),)


def transformers5_names(names: Iterable[str]) -> set[str]:
    """What PEFT (0.21, with transformers 5) matches a string ``target_modules`` against in
    place of the MoE modules among ``names``, which transformers 5 no longer has: it fuses a
    layer's experts into one module (``model.layers.3.mlp.experts``, the 3-D parameters
    ``gate_up_proj`` and ``down_proj``) and renames mixtral's ``block_sparse_moe``. PEFT turns
    the adapter's per-expert factors into LoRA on those parameters, and finds which experts'
    projections the expression targets by matching the layer's name without the expert
    index (``model.layers.3.mlp.experts.w1``). Without these names the expression selects
    no expert in transformers 5, and PEFT leaves the experts' factors out without a warning.
    None of them is a module in transformers 4, where the expression selects as before."""
    out = set()
    for n in names:
        new = re.sub(r"\.experts\.\d+\.", ".experts.", n)
        for old, renamed in TRANSFORMERS5_RENAMES:
            new = new.replace(old, renamed)
        if new != n:
            out.add(new)
    return out


def _peft_config(r: AdapterReport) -> dict[str, Any]:
    """``adapter_config.json``: what PEFT's ``save_pretrained`` writes for a LoRA adapter
    of a causal LM, without dropout or biases (MaxText trains none)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": r.base_model_name_or_path,
        "r": r.rank,
        "lora_alpha": r.alpha,
        "target_modules": r.target_pattern,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def _modules(
    model: HfModel, keyed: dict[str, Move], units: list[Unit]
) -> tuple[list[_Module], list[str]]:
    """Each adapted weight's units and factor map; the modules that cannot be carried."""
    by_key: dict[str, list[Unit]] = {}
    for u in units:
        by_key.setdefault(u.keys[0], []).append(u)
    modules, problems = [], []
    for key, m in keyed.items():
        us, f = by_key.get(key, []), m.op.factors(m)[0]
        name = keystr(m.dst[2:])  # the adapted weight
        if not us or any(len(u.keys) != 1 or not isinstance(u.hf_path, str) for u in us):
            problems.append(f"{name}: MaxText's mapping writes it fused with other weights")
            continue
        cuts = [factor_cut(f, tuple(m.out_spec.shape), u) for u in us]
        why = next((c for c in cuts if isinstance(c, str)), None)
        if why is not None:
            problems.append(f"{name}: {why}")
            continue
        a, b = cuts[0].take(_shape_only(f.a_spec.shape), _shape_only(f.b_spec.shape), f.axis)
        delta = _delta(us[0].slice_shape(m.out_spec.shape))
        for group in _by_hooks(list(zip(us, cuts, strict=True))).values():  # layers may differ
            hook = _hook(model, group[0][0])
            fmap = adapter_factors.carry(hook, delta, a.shape[0], b.shape[1])
            if isinstance(fmap, str):
                problems.append(f"{name} -> {_hf_module(group[0][0])}: {fmap}")
                continue
            gu, gc = [u for u, _ in group], [c for _, c in group]
            modules.append(_Module(m, gu, gc, fmap, hook, delta))
    return modules, problems


def _shape_only(shape: Sequence[int]) -> np.ndarray:
    return np.broadcast_to(np.zeros((), np.int8), tuple(shape))


def factor_cut(f: LoraFactor, kernel: tuple[int, ...], unit: Unit) -> FactorCut | str:
    """Where ``unit``'s factors lie in the weight's (of shape ``kernel``), or why they lie
    in none. A dense weight's unit is a layer: its factors are the layer's. An expert
    weight's unit is an expert of a layer (MaxText writes each expert as its own HF tensor):
    qwix's einsum factors put each kernel dim in ``a`` or ``b`` (``f.layout``), so the
    expert is taken in the factor holding the experts' dim and the other factor, shared by
    all experts, is the same for each (PEFT holds one rank-r LoRA per expert)."""
    left = list(range(len(kernel)))
    cuts = {left.pop(ax): i for ax, i in unit.levels}  # a kernel axis -> the index taken
    layer = None
    if f.axis is not None:
        if f.axis not in cuts:
            return "one Hugging Face tensor holds several of its scanned layers"
        layer = cuts.pop(f.axis)
    per = [k for k in range(len(kernel)) if k != f.axis]  # the layer's kernel axes
    a_sh, b_sh = per_layer_shape(f.a_spec.shape, f.axis), per_layer_shape(f.b_spec.shape, f.axis)
    if not cuts:
        if len(a_sh) != 2 or len(b_sh) != 2:
            return "one Hugging Face tensor holds all its experts (qwix's einsum factors)"
        return FactorCut(layer)
    lay, n_a = f.layout or tuple(range(len(per))), len(a_sh) - 1
    if len(lay) != len(per) or n_a + len(b_sh) - 1 != len(per):
        return "its factors do not lay out on the weight dim by dim"
    take_a, take_b, kept, take_k = [], [], [], []
    for k, axis in enumerate(per):
        d = lay[k]  # the delta's dim of the layer's kernel axis k: a's dims, then b's
        if axis not in cuts:
            kept.append(d)
            continue
        take_k.append((k, cuts[axis]))
        (take_a if d < n_a else take_b).append((d if d < n_a else d - n_a + 1, cuts[axis]))
    if kept != sorted(kept):
        return "an expert's factors do not reshape onto its Hugging Face tensor"
    down = lambda t: tuple(sorted(t, reverse=True))  # noqa: E731
    return FactorCut(layer, down(take_a), down(take_b), down(take_k))


def _by_hooks(units: list[tuple[Unit, FactorCut]]) -> dict[Any, list[tuple[Unit, FactorCut]]]:
    """A weight's units grouped by their hooks (a layer of another type may have others)."""
    out: dict[Any, list[tuple[Unit, FactorCut]]] = {}
    for u, c in units:
        key = u.hooks if callable(u.hooks) else tuple(u.hooks or ())
        out.setdefault(key, []).append((u, c))
    return out


def _hook(model: HfModel, unit: Unit):
    import jax.numpy as jnp

    def hook(kernel: np.ndarray) -> np.ndarray:
        return np.asarray(hf_mapping.hooked(model, unit, [jnp.asarray(kernel, jnp.float32)]))

    return hook


def _delta(kernel: tuple[int, ...]):
    def delta(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # one kernel-size array
        return lora_delta_added(np.zeros(kernel, np.float32), a, b, 1.0, inplace=True)

    return delta


def _hf_module(unit: Unit) -> str:
    """The HF module a unit's tensor belongs to (its name without ``.weight``)."""
    return str(unit.hf_path).removesuffix(".weight")


def _names(unit: Unit) -> tuple[str, str]:
    base = PEFT_PREFIX + _hf_module(unit)
    return f"{base}.lora_A.weight", f"{base}.lora_B.weight"


def _tensors(mod: _Module) -> list[Tensor]:
    f, r = mod.factor, int(mod.factor.a_spec.shape[-1])
    dtype = np.dtype(f.a_spec.dtype)
    n_in, n_out = len(mod.fmap.in_index), len(mod.fmap.out_index)
    out = []
    for u in mod.units:
        a_name, b_name = _names(u)
        out += [
            Tensor(a_name, (r, n_in), dtype),
            Tensor(b_name, (n_out, r), dtype),
        ]
    return out


def export_adapter(
    step: epath.PathLike,
    out: epath.PathLike,
    *,
    maxtext_config: Sequence[str],
    alpha: float | None = None,
    base_model_name_or_path: str | None = None,
    override_model_architecture: bool = False,
    dry_run: bool = False,
) -> AdapterReport:
    """Writes the LoRA adapter step ``step`` as a PEFT adapter in ``out``: ``adapter_model.
    safetensors`` (``lora_A (r, in)``, ``lora_B (out, r)`` per adapted module and layer,
    in the adapters' dtype) and ``adapter_config.json``; returns the report.

    Raises:
      UsageError: the step holds no adapters; no alpha given or recorded.
      LayoutMismatchError: adapters that do not fit the config's model, or whose hooks
        cannot be carried onto PEFT's factors (every module named; nothing written).
      StepExistsError: ``out`` holds files already.
    """
    start = time.monotonic()
    out = epath.Path(out)
    store = store_for(out)
    if not dry_run and store.dir_taken(out, last=ADAPTER_CONFIG):
        raise StepExistsError(f"{out}: already holds files; remove it or pass another --out.")
    plan = plan_adapter(
        step,
        out,
        maxtext_config=maxtext_config,
        alpha=alpha,
        base_model_name_or_path=base_model_name_or_path,
        override_model_architecture=override_model_architecture,
    )
    if dry_run:
        return plan.report
    work = out.parent / f"{out.name}{EXPORT_WORK_SUFFIX}"
    store.discard(work)  # a killed export's files, if any: this one starts again
    if not store.builds_in_place:
        work.mkdir(parents=True, exist_ok=True)
    staging = store.staging_dir(work)
    try:
        _write(plan, staging / ADAPTER_FILE)
        store.put_file(staging / ADAPTER_FILE, work / ADAPTER_FILE)
        config = json.dumps(plan.config, indent=2)
        plan.sink.finish(store, work, [plan.shard], (ADAPTER_CONFIG, config))
    except BaseException:
        if str(staging) != str(work):
            shutil.rmtree(str(staging), ignore_errors=True)
        store.discard(work)
        raise
    if str(staging) != str(work):
        shutil.rmtree(str(staging), ignore_errors=True)
    store.publish_dir(work, out, last=ADAPTER_CONFIG)
    store.refresh(out)
    report = plan.report
    report.files = sorted(f.name for f in out.iterdir())
    report.status = "exported"
    report.seconds = round(time.monotonic() - start, 3)
    return report


def _write(plan: AdapterPlan, path: epath.Path) -> None:
    """Every module's PEFT factors, tensor by tensor, each module checked on its first and
    last tensor (first and last layer; an expert weight's first expert of the first layer and
    last of the last); a module that fails a check stops the export, naming every such one."""
    ctx = item_writer.ts_context()
    src = ItemReader.open(plan.params_dir, ctx)
    f = plan.sink.open(plan.shard, str(path))
    bad: list[str] = []
    try:
        for mod, row in zip(plan.modules, plan.report.modules, strict=True):
            fac = mod.factor
            a = src.read_whole(param_name(fac.a))
            b = src.read_whole(param_name(fac.b))
            last = len(mod.units) - 1
            for k, (u, cut) in enumerate(zip(mod.units, mod.cuts, strict=True)):
                la, lb = cut.take(a, b, fac.axis)
                if k in (0, last):
                    want = mod.hook(_merge_delta(mod, cut, a, b))
                    err = adapter_factors.check_hooked(want, mod.fmap, la, lb)
                    row["check"] = max(err, row["check"] or 0.0)
                    if not err <= adapter_factors.TOLERANCE:
                        bad.append(
                            f"{row['module']} -> {_hf_module(u)}: the carried factors "
                            f"miss MaxText's hooked delta by {err:.3g} (relative)"
                        )
                        break
                lora_a, lora_b = mod.fmap.peft(la, lb)
                a_name, b_name = _names(u)
                f.write(a_name, lora_a)
                f.write(b_name, lora_b)
        if bad:
            raise LayoutMismatchError(
                f"{plan.report.step}: the adapters of {len(bad)} modules cannot be carried "
                "onto PEFT's factors exactly:",
                bad,
                hint="Merge them instead: export-hf STEP --base BASE, or merge-lora.",
            )
        f.close()
    except BaseException:
        f.abandon()
        raise


def _merge_delta(mod: _Module, cut: FactorCut, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The delta the merge adds to one unit's kernel: the merge's own op on the whole layer
    (an expert weight's: every expert, laid out by the factors' layout), then the unit's
    slice of it, taken on the kernel as MaxText's mapping takes it."""
    fac = mod.factor
    kernel = per_layer_shape(tuple(mod.move.out_spec.shape), fac.axis)
    a_l, b_l = _layer(a, fac.axis, cut.layer), _layer(b, fac.axis, cut.layer)
    d = np.zeros(kernel, np.float32)
    d = lora_delta_added(d, a_l, b_l, 1.0, inplace=True, layout=fac.layout)
    for ax, i in cut.kernel:
        d = np.take(d, i, axis=ax)
    return d


def _layer(x: np.ndarray, axis: int | None, index: int | None) -> np.ndarray:
    if axis is None or index is None:
        return x
    return np.take(x, index, axis=axis)
