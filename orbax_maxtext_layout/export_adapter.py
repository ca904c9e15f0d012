"""``export-hf --adapter``: a LoRA adapter step written as a PEFT adapter.

The plan is the merge's (`merge.adapter_moves`: the ``merge_lora`` move of each adapted
weight, against the model the config builds, without a base), with a new sink: each
module's factors are carried through MaxText's Hugging Face hooks of its weight
(`adapter_factors`) and written, layer by layer, under PEFT's names into
``adapter_model.safetensors``, beside ``adapter_config.json``. Only the factors are read,
each decoded once (`chunks.read_whole`: adapters are small).

Each module is checked on its first layer before its tensors count: the carried
``lora_B @ lora_A`` against MaxText's hooks applied to ``reshape(a @ b)``, the delta a
merge adds, to float32 rounding. A module whose hooks cannot be carried is refused, with
every such module named, and nothing is published.
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

from . import adapter_factors, chunks, hf_mapping, safetensors_out, tskv
from .errors import CheckpointReadError, LayoutMismatchError, StepExistsError, UsageError
from .hf_mapping import HfModel, Unit
from .lora import per_layer_shape
from .merge import adapter_item, adapter_moves, read_adapters
from .moves import LoraFactor, Move, lora_delta_added
from .orbax_files import param_name
from .store import EXPORT_WORK_SUFFIX, store_for
from .target import Target
from .treepaths import keystr

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"  # published last on an object store
PEFT_PREFIX = "base_model.model."  # PEFT's names: the model wrapped once (``PeftModel``)


@dataclasses.dataclass
class AdapterReport:
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

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
            lines.append(f"  {m['module']} -> {m['hf_module']} ({m['layers']} layers{check})")
        return "\n".join(lines)


@dataclasses.dataclass
class _Module:
    """One adapted weight: its merge move, its units (one per layer) and the factor map."""

    move: Move
    units: list[Unit]
    fmap: adapter_factors.FactorMap
    hook: Any
    delta: Any

    @property
    def factor(self) -> LoraFactor:
        return self.move.lora[0]


@dataclasses.dataclass
class AdapterPlan:
    model: HfModel
    params_dir: epath.Path  # the step's model_params: the factors
    modules: list[_Module]
    shard: safetensors_out.Shard
    config: dict[str, Any]
    report: AdapterReport


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
    try:
        adapter_dir, params_dir = adapter_item(step)
        adapters = read_adapters(adapter_dir, params_dir)
    except (LayoutMismatchError, CheckpointReadError) as e:
        if not step.exists():
            raise
        raise UsageError(
            f"{step}: --adapter exports a LoRA adapter step, and this step holds no LoRA "
            f"adapters ({str(e).splitlines()[0]}); export it without --adapter."
        ) from e
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
    if problems:
        raise LayoutMismatchError(
            f"{step}: cannot write the adapters of {len(problems)} modules of "
            f"{model.model_name} as PEFT's lora_A/lora_B:",
            problems,
            hint="Merge them instead: export-hf STEP --base BASE, or merge-lora.",
        )
    tensors = [t for mod in modules for t in _tensors(mod)]
    shard = safetensors_out.layout_shards(tensors, 1 << 62)[0]
    shard = dataclasses.replace(shard, name=ADAPTER_FILE)
    hf_id = base_model_name_or_path or hf_mapping.hf_id(model.model_name)
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
        target_pattern=target_pattern(names),
        modules=[_module_row(m) for m in modules],
        tensors=len(tensors),
        bytes=sum(t.nbytes for t in tensors),
        tensor_list=[
            {"name": t.name, "shape": list(t.shape), "dtype": np.dtype(t.dtype).name}
            for t in sorted(tensors, key=lambda t: t.name)
        ],
    )
    return AdapterPlan(model, params_dir, modules, shard, _peft_config(report), report)


def _module_row(m: _Module) -> dict[str, Any]:
    """A module's line of the report (its ``check`` is filled in by the export)."""
    return {
        "module": keystr(m.move.dst[2:-1]),
        # The layer index of the first unit (layers.0, or layers.1 for a block's second
        # sub-layer) as {i}: every module of the report is named alike.
        "hf_module": re.sub(r"\.\d+\.", ".{i}.", _hf_module(m.units[0]), count=1),
        "layers": len(m.units),
        "check": None,
    }


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
        us, f = by_key.get(key, []), m.lora[0]
        name = keystr(m.dst[2:])  # the adapted weight
        if not us or any(len(u.keys) != 1 or not isinstance(u.hf_path, str) for u in us):
            problems.append(f"{name}: MaxText's mapping writes it fused with other weights")
            continue
        if f.layout or any(u.more for u in us):
            problems.append(
                f"{name}: qwix's einsum factors of a MoE layer's experts (one factor "
                "shared by all experts); a PEFT module per expert is not written"
            )
            continue
        a = per_layer_shape(f.a_spec.shape, f.axis)
        b = per_layer_shape(f.b_spec.shape, f.axis)
        delta = _delta(us[0].slice_shape(m.out_spec.shape))
        for group in _by_hooks(us).values():  # one map per hook: layers may differ
            hook = _hook(model, group[0])
            fmap = adapter_factors.carry(hook, delta, a[0], b[1])
            if isinstance(fmap, str):
                problems.append(f"{name} -> {_hf_module(group[0])}: {fmap}")
                continue
            modules.append(_Module(m, group, fmap, hook, delta))
    return modules, problems


def _by_hooks(units: list[Unit]) -> dict[Any, list[Unit]]:
    """A weight's units grouped by their hooks (a layer of another type may have others)."""
    out: dict[Any, list[Unit]] = {}
    for u in units:
        key = u.hooks if callable(u.hooks) else tuple(u.hooks or ())
        out.setdefault(key, []).append(u)
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


def _tensors(mod: _Module) -> list[safetensors_out.Tensor]:
    f, r = mod.factor, int(mod.factor.a_spec.shape[-1])
    dtype = np.dtype(f.a_spec.dtype)
    n_in, n_out = len(mod.fmap.in_index), len(mod.fmap.out_index)
    out = []
    for u in mod.units:
        a_name, b_name = _names(u)
        out += [
            safetensors_out.Tensor(a_name, (r, n_in), dtype),
            safetensors_out.Tensor(b_name, (n_out, r), dtype),
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
        store.replace_file(work / ADAPTER_CONFIG, json.dumps(plan.config, indent=2))
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
    """Every module's PEFT factors, layer by layer, each module checked on its first layer
    first; a module that fails its check stops the export, naming every such module."""
    ctx = tskv.ts_context()
    src = tskv.SourceItem.open(plan.params_dir, ctx)
    f = safetensors_out.ShardFile(str(path), plan.shard)
    bad: list[str] = []
    try:
        for mod, row in zip(plan.modules, plan.report.modules, strict=True):
            fac = mod.factor
            a = chunks.read_whole(src, param_name(fac.a), ctx)
            b = chunks.read_whole(src, param_name(fac.b), ctx)
            for k, u in enumerate(mod.units):
                la, lb = _layer(a, fac.axis, u.index), _layer(b, fac.axis, u.index)
                if k == 0:
                    err = adapter_factors.check(mod.hook, mod.delta, mod.fmap, la, lb)
                    row["check"] = err
                    if not err <= adapter_factors.TOLERANCE:
                        bad.append(
                            f"{row['module']} -> {row['hf_module']}: the carried factors "
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


def _layer(x: np.ndarray, axis: int | None, index: int | None) -> np.ndarray:
    if axis is None or index is None:
        return x
    return np.take(x, index, axis=axis)
