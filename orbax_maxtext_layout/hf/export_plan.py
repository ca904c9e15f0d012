"""The plan of an export, from metadata alone: what the step is (a MaxText step, a Tunix
step, or a LoRA adapter step merged into its base), the moves that make its MaxText params,
the model's check against them, MaxText's Hugging Face units, the files they fill (laid
out by the export's `formats.sink.Sink`, safetensors), the export's fingerprint, and its
report (`ExportReport`, what a dry run prints).

Nothing here reads an array's bytes. `export_hf` carries the plan out (`export_stream`,
`export_processes`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from ..base.reports import Report
from ..base.step_entries import Dest
from ..base.treepaths import keystr
from ..errors import LayoutMismatchError, UsageError
from ..formats.safetensors_writer import SafetensorsSink
from ..formats.sink import Part, Sink, Tensor
from ..lora.merge_plan import (
    NOT_PARAMS,
    adapter_item,
    base_source,
    merge_sources,
    params_plan,
    plan_merge,
    read_adapters,
)
from ..model import hf_mapping
from ..model.hf_mapping import HfModel, Unit
from ..model.layermap import scanned_form
from ..model.target import Target
from ..orbax_io import stepmeta
from ..orbax_io.layout import TUNIX_PARAMS_ITEM
from ..orbax_io.spec import read_specs
from ..plan.moves import Move
from ..plan.provenance import SCAN_LAYERS_KEY
from ..storage.memory import DEFAULT_BUDGET
from ..storage.store import StepStore, store_for
from .budget import expected_memory

NOT_WEIGHT = "not a weight: a Hugging Face model holds the weights only"


# -- the report -----------------------------------------------------------------------------
@dataclasses.dataclass
class ExportReport(Report):
    """What an export wrote (or, with ``dry_run``, would write), from metadata."""

    step: str
    out: str
    status: str  # "dry-run" | "exported" | "shards written" (a process other than 0)
    model_name: str
    scan_layers: bool
    weight_dtype: str
    source: str  # what was read: "maxtext" | "tunix" | "tunix-lora-merge"
    tensors: int
    bytes: int
    shards: list[dict[str, Any]]
    memory: dict[str, int]
    dropped: list[dict[str, Any]]
    merged: dict[str, Any] | None = None
    process: dict[str, int] = dataclasses.field(default_factory=dict)
    tensor_list: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    files: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def __str__(self) -> str:
        lines = [
            f"{self.status}: {self.step} -> {self.out}",
            f"  model {self.model_name} (scan_layers={str(self.scan_layers).lower()}), "
            f"{self.tensors} tensors, {self.bytes:,} bytes of {self.weight_dtype}, from "
            f"{self.source}",
        ]
        if self.merged:
            lines.append(
                f"  merged LoRA: rank {self.merged['rank']}, alpha {self.merged['alpha']:g}, "
                f"{len(self.merged['modules'])} modules, base {self.merged['base']}"
            )
        for s in self.shards:
            who = s.get("process", 0)
            mine = "" if who is None or who == self.process.get("index", 0) else " (other)"
            lines.append(f"  {s['name']}: {s['tensors']} tensors, {s['bytes']:,} bytes{mine}")
        m = self.memory
        lines.append(
            f"  memory: budget {m['budget']:,}, expected peak {m['expected_peak']:,} "
            f"(largest param {m['largest_param']:,}, largest slice {m['largest_slice']:,})"
        )
        if self.status == "dry-run":
            for t in self.tensor_list:
                lines.append(f"  tensor {t['name']} {t['dtype']}{t['shape']} -> {t['file']}")
        for d in self.dropped[:20]:
            lines.append(f"  not exported: {d['leaf']} ({d['reason']})")
        if len(self.dropped) > 20:
            lines.append(f"  ... and {len(self.dropped) - 20} more not exported")
        if self.files:
            lines.append(f"  files: {', '.join(self.files)}")
        return "\n".join(lines)


# -- planning ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """Everything an export does, from metadata: the source plan, the HF units, the files
    (``shards``, laid out by ``sink``, which writes them)."""

    model: HfModel
    moves: dict[str, Move]  # MaxText param key -> the move that makes it
    sources: dict[str, epath.Path]  # item name -> directory
    units: list[Unit]
    shards: list[Part]
    report: ExportReport
    fingerprint: str
    sink: Sink
    store: StepStore  # the output's, decided once here and handed down to every process step


def plan_export(
    step: epath.PathLike,
    out: epath.PathLike,
    *,
    maxtext_config: Sequence[str],
    base: epath.PathLike | None = None,
    alpha: float | None = None,
    override_model_architecture: bool = False,
    memory_budget: int | None = None,
    max_shard_size: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
    store: StepStore | None = None,
) -> ExportPlan:
    """The export of ``step`` as an `ExportPlan`, from metadata alone (see `export_hf`).
    ``store``: ``out``'s, as the caller decided it (else decided here)."""
    step = epath.Path(step)
    budget = DEFAULT_BUDGET if memory_budget is None else int(memory_budget)
    src = _Source.of(step, base)
    argv = src.argv(list(maxtext_config))
    config = hf_mapping.load_config(argv)
    model = hf_mapping.load_model(config, override_model_architecture=override_model_architecture)
    target = Target.from_maxtext_config(argv)
    plan, sources, merged = src.plan(target, alpha)
    moves = {
        "params-" + "-".join(str(k) for k in m.dst[2:]): m
        for m in plan.moves
        if m.dest is Dest.PARAMS
    }
    _check_model(step if base is None else epath.Path(base), moves, target)
    units = hf_mapping.plan_units(model, {k: m.out_spec.shape for k, m in moves.items()})
    problems = hf_mapping.check_units(model, units, {k: m.out_spec for k, m in moves.items()})
    if problems:
        raise LayoutMismatchError(
            f"{step}: MaxText's Hugging Face mapping of {model.model_name} does not fit the "
            f"step's params ({len(problems)} tensors):",
            problems,
            hint="Pass the --maxtext-config of the model that wrote the step.",
        )
    tensors = [
        Tensor(n, s, model.weight_dtype)
        for u in units
        for n, s in hf_mapping.out_shapes(model, u).items()
    ]
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise LayoutMismatchError(f"{step}: MaxText's mapping writes a tensor twice.")
    sink = SafetensorsSink(max_shard_size)
    shards = sink.layout(tensors)
    report = _report(
        step,
        out,
        model=model,
        kind=src.kind,
        shards=shards,
        drops=plan.drops,
        merged=merged,
        process=(process_index, process_count),
    )
    store = store or store_for(epath.Path(out))
    if shares_files(store, process_count):
        for sh in report.shards:  # every process writes its params' tensors into every file
            sh["process"] = None
    report.memory = expected_memory(model, units, moves, budget)
    fp = _fingerprint(shards, sources, merged, process_count)
    return ExportPlan(model, moves, sources, units, shards, report, fp, sink, store)


def _report(step, out, *, model, kind, shards, drops, merged, process) -> ExportReport:
    """The dry-run report of an export (`export_hf` fills in what it did)."""
    tensors = [(sh, t) for sh in shards for t in sorted(sh.tensors, key=lambda t: t.name)]
    index, count = process
    return ExportReport(
        step=str(step),
        out=str(out),
        status="dry-run",
        model_name=model.model_name,
        scan_layers=model.scan_layers,
        weight_dtype=model.weight_dtype.name,
        source=kind,
        tensors=len(tensors),
        bytes=sum(t.nbytes for _, t in tensors),
        shards=[
            {"name": sh.name, "tensors": len(sh.tensors), "bytes": sh.size, "process": k % count}
            for k, sh in enumerate(shards)
        ],
        memory={},
        dropped=[
            {
                "leaf": f"{d.item}/{keystr(d.src)}",
                "reason": NOT_WEIGHT if d.reason == NOT_PARAMS else d.reason,
            }
            for d in drops
        ],
        merged=merged,
        process={"index": index, "count": count},
        tensor_list=[
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": np.dtype(t.dtype).name,
                "file": sh.name,
            }
            for sh, t in tensors
        ],
    )


@dataclasses.dataclass(frozen=True)
class _Source:
    """What ``step`` is: a MaxText step, a Tunix step, or a LoRA adapter step (with base)."""

    step: epath.Path
    base: epath.Path | None
    kind: str
    scan_layers: bool | None  # the form the params are stored in, where it can be told

    @classmethod
    def of(cls, step: epath.Path, base: epath.PathLike | None) -> _Source:
        lora = _is_lora(step)
        if lora and base is None:
            raise LayoutMismatchError(
                f"{step}: a LoRA adapter step holds only the adapters, not the model: pass "
                "--base BASE (the step the LoRA run started from) to merge them on the fly, "
                "or merge first with `orbax-maxtext-layout merge-lora` and export its output."
            )
        if base is not None and not lora:
            raise UsageError(
                f"{step}: not a LoRA adapter step; --base (and --alpha) are for LoRA steps only."
            )
        if lora:
            assert base is not None
            b = epath.Path(base)
            return cls(step, b, "tunix-lora-merge", _scan_form(b))
        kind = "tunix" if _item(step)[1] == TUNIX_PARAMS_ITEM else "maxtext"
        return cls(step, None, kind, _scan_form(step))

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` with the ``scan_layers`` of the stored form (`hf_mapping.with_scan_layers`)."""
        return hf_mapping.with_scan_layers(argv, self.scan_layers, self.base or self.step)

    def plan(self, target: Target, alpha: float | None):
        if self.base is not None:
            plan, adapters, a = plan_merge(self.step, self.base, alpha=alpha, target=target)
            merged = {
                "base": str(self.base),
                "alpha": a,
                "rank": adapters.rank,
                "modules": adapters.modules,
            }
            return plan, merge_sources(self.step, self.base), merged
        base_dir, item, item_dir = base_source(self.step)
        plan, _ = params_plan(base_dir, item, item_dir, target)
        return plan, {item: item_dir}, None


def _item(step: epath.Path) -> tuple[epath.Path, str]:
    _, item, item_dir = base_source(step)
    return item_dir, item


def _is_lora(step: epath.Path) -> bool:
    try:
        adapter_dir, params_dir = adapter_item(step)
    except Exception:
        return False
    try:
        read_adapters(adapter_dir, params_dir)
    except LayoutMismatchError:
        return False
    return True


def _scan_form(step: epath.Path) -> bool | None:
    """Whether the params of ``step`` are stored scanned: as recorded (``scan_layers``
    custom metadata), else from the tree (`layermap.scanned_form`: a scan group, gemma3's
    block scan ``layers/layers_<k>`` too, is scanned; only ``layers_<i>`` keys, unscanned)."""
    item_dir, _ = _item(step)
    recorded = stepmeta.custom(stepmeta.read(item_dir.parent)).get(SCAN_LAYERS_KEY)
    if isinstance(recorded, bool):
        return recorded
    return scanned_form(read_specs(item_dir))


def _check_model(step: epath.Path, moves: dict[str, Move], target: Target) -> None:
    """The step's params against the config's model: every path and shape, both ways."""
    have = {m.dst[2:]: m.out_spec for m in moves.values()}
    want = dict(target.params)
    problems = [
        f"{keystr(p)}: the step has {have[p]}, the model {want[p]}"
        for p in sorted(set(have) & set(want), key=keystr)
        if tuple(have[p].shape) != tuple(want[p].shape)
    ]
    problems += [
        f"{keystr(p)}: in the model, not in the step"
        for p in sorted(set(want) - set(have), key=keystr)
    ]
    problems += [
        f"{keystr(p)}: in the step, not in the model"
        for p in sorted(set(have) - set(want), key=keystr)
    ]
    if problems:
        raise LayoutMismatchError(
            f"{step}: its params are not those of the --maxtext-config model "
            f"({len(problems)} mismatches):",
            problems,
            hint="Pass the config (model_name and size overrides) of the model that wrote the step.",
        )


def _fingerprint(
    shards: list[Part], sources: dict[str, epath.Path], merged: Any, process_count: int
) -> str:
    """Names one export: its files' layouts (`Part.signature`), its sources (paths and
    metadata versions) and how many processes share the shards (``.done-<p>`` stands for
    shards ``p, p + n, ...``)."""
    h = hashlib.sha256()
    h.update(f"processes={process_count};".encode())
    for s in shards:
        h.update(s.signature)
    for name, d in sorted(sources.items()):
        meta, store = d / "_METADATA", store_for(d)  # each source's root, once
        h.update(f"{name}={store.absolute(d)}:{store.version(meta)}".encode())
    h.update(json.dumps(merged, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


def shares_files(store: Any, count: int) -> bool:
    """Whether the processes of an export share its files (`export_processes.write_shared`):
    several of them, on a file system where each can write its ranges of a common file."""
    return count > 1 and store.writes_ranges
