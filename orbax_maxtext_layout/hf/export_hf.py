"""Export any step to Hugging Face safetensors, streaming, on one or many processes.

The export is the plan of the step's MaxText params (`merge.params_plan`: a MaxText step's
params copied, a Tunix step's weights told from its RNG state by the model, a LoRA step
merged into ``base`` by the ``merge_lora`` op) with a new sink: each param's layers go
through MaxText's own Hugging Face mapping (`hf_mapping`) into safetensors shards whose
layout is fixed from metadata before a byte is read (`safetensors_out`). What it writes
equals MaxText 0.2.5's ``to_huggingface`` in Base mode for the same weights.

Memory: a param is decoded whole once (Orbax stores an array from one host as one chunk,
and reading one layer decodes the chunk) when it fits the budget, else layer by layer;
each layer is transformed and written at its place in its shard, then dropped. Two
params are in flight at once where the budget holds both.

Publication: the files are built in ``<out>.export-hf-tmp`` beside ``out`` and renamed to
``out`` last, so a kill leaves nothing under ``out`` and a rerun completes. With several
processes, process ``p`` writes shards ``p, p + n, ...`` and a marker; process 0 waits for
every marker of the same export (`fingerprint`), writes the index, ``config.json`` and the
tokenizer, and publishes. A process whose marker of the same export is already there (a
rerun after a kill) skips its shards.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from etils import epath
from threadpoolctl import threadpool_limits

from ..base.names import Dest
from ..base.treepaths import keystr
from ..errors import LayoutMismatchError, StepExistsError, UsageError
from ..execute.write import DEFAULT_BUDGET
from ..model.layermap import scanned_form
from ..model.target import Target
from ..orbax_io import chunks, stepmeta, tskv
from ..orbax_io.layout import TUNIX_PARAMS_ITEM
from ..orbax_io.orbax_files import param_name
from ..orbax_io.spec import read_specs
from ..plan.merge import (
    NOT_PARAMS,
    adapter_item,
    base_source,
    merge_sources,
    params_plan,
    plan_merge,
    read_adapters,
)
from ..plan.moves import Move, Op, apply_op, merge_layer, merge_part
from ..plan.provenance import SCAN_LAYERS_KEY
from ..storage.store import EXPORT_WORK_SUFFIX, store_for
from . import hf_mapping, piecewise, safetensors_out
from .export_adapter import AdapterReport, export_adapter
from .hf_mapping import HfModel, Unit
from .safetensors_out import Shard, ShardFile, Tensor

CONFIG_FILE = "config.json"  # published last on an object store
DONE_PREFIX = ".done-"
PART = ".part."
WORKERS = 2
NOT_WEIGHT = "not a weight: a Hugging Face model holds the weights only"
WAIT_S = 24 * 3600  # process 0 waits this long for the others' shards


# -- the report -----------------------------------------------------------------------------
@dataclasses.dataclass
class ExportReport:
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

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
    """Everything an export does, from metadata: the source plan, the HF units, the files."""

    model: HfModel
    moves: dict[str, Move]  # MaxText param key -> the move that makes it
    sources: dict[str, epath.Path]  # item name -> directory
    units: list[Unit]
    shards: list[Shard]
    report: ExportReport
    fingerprint: str


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
) -> ExportPlan:
    """The export of ``step`` as an `ExportPlan`, from metadata alone (see `export_hf`)."""
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
    shards = safetensors_out.layout_shards(
        tensors,
        safetensors_out.DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size,
    )
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
    if _shares_files(store_for(epath.Path(out)), process_count):
        for sh in report.shards:  # every process writes its params' tensors into every file
            sh["process"] = None
    report.memory = _memory(model, units, moves, budget)
    fp = _fingerprint(shards, sources, merged, process_count)
    return ExportPlan(model, moves, sources, units, shards, report, fp)


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


def _memory(
    model: HfModel, units: list[Unit], moves: dict[str, Move], budget: int
) -> dict[str, int]:
    """What the export holds at once: at most ``WORKERS`` params in flight within the
    budget (a param over it runs alone), plus the slices being transformed."""
    groups: dict[tuple[str, ...], list[Unit]] = {}
    for u in units:
        groups.setdefault(u.keys, []).append(u)
    costs = sorted(
        (_group_cost(model, [moves[k] for k in ks], us, budget) for ks, us in groups.items()),
        reverse=True,
    )
    largest_slice = max((_slice_bytes(model, moves[u.keys[0]], u) for u in units), default=0)
    fitting = [c for c in costs if c <= budget]
    held = max(min(budget, sum(fitting[:WORKERS])), costs[0] if costs else 0)
    return {
        "budget": budget,
        "largest_param": max((m.out_spec.nbytes for m in moves.values()), default=0),
        "largest_slice": largest_slice,
        "expected_peak": held + 3 * largest_slice,
    }


def _group_cost(model: HfModel, moves: list[Move], units: list[Unit], budget: int) -> int:
    """Bytes a param's job holds: the param decoded whole (`chunks.read_whole`: the array
    and the piece being decoded, `tskv.FAST_DECODING`), a
    merge's factors, and its largest slice three times over (cast to ``weight_dtype``,
    handed to the hooks, and their output)."""
    stored = int(tskv.FAST_DECODING * sum(m.out_spec.nbytes for m in moves))
    factors = sum(f.a_spec.nbytes + f.b_spec.nbytes for m in moves for f in dict.fromkeys(m.lora))
    biggest = max((_slice_bytes(model, moves[0], u) for u in units), default=0)
    return stored + factors + 3 * biggest


def _slice_bytes(model: HfModel, m: Move, u: Unit) -> int:
    n = int(np.prod(m.out_spec.shape, dtype=np.int64))
    n = int(np.prod(u.slice_shape(m.out_spec.shape), dtype=np.int64))
    return n * max(model.weight_dtype.itemsize, np.dtype(m.out_spec.dtype).itemsize) * len(u.keys)


def _fingerprint(
    shards: list[Shard], sources: dict[str, epath.Path], merged: Any, process_count: int
) -> str:
    """Names one export: its files' layouts, its sources (paths and metadata versions) and
    how many processes share the shards (``.done-<p>`` stands for shards ``p, p + n, ...``)."""
    h = hashlib.sha256()
    h.update(f"processes={process_count};".encode())
    for s in shards:
        h.update(s.header)
    for name, d in sorted(sources.items()):
        meta = d / "_METADATA"
        h.update(f"{name}={store_for(d).absolute(d)}:{store_for(d).version(meta)}".encode())
    h.update(json.dumps(merged, sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


# -- the export --------------------------------------------------------------------------
def export_hf(
    step: epath.PathLike,
    out: epath.PathLike,
    *,
    maxtext_config: Sequence[str],
    base: epath.PathLike | None = None,
    alpha: float | None = None,
    hf_model_path: str | None = None,
    override_model_architecture: bool = False,
    memory_budget: int | None = None,
    max_shard_size: int | None = None,
    dry_run: bool = False,
    process_index: int | None = None,
    process_count: int | None = None,
    adapter: bool = False,
    base_model_name_or_path: str | None = None,
) -> ExportReport | AdapterReport:
    """Exports ``step`` to Hugging Face safetensors in ``out``; returns the report.

    ``step``: a MaxText step (full state or param-only, scanned or not) or its ``items``;
    a Tunix step (``<n>``, RL ``actor/<n>``) or its ``model_params``; a ``merge-lora``
    output; or a LoRA adapter step with ``base`` (and ``alpha`` unless recorded), merged
    on the fly. ``maxtext_config``: the config file, then KEY=VALUE overrides, of the
    model (``scan_layers`` is read from the step). What is written equals MaxText 0.2.5's
    ``to_huggingface`` in Base mode (see docs/export-hf.md). ``process_index`` /
    ``process_count`` default to JAX's where ``jax.distributed`` is initialized.
    ``adapter``: write a LoRA adapter step as a PEFT adapter instead (`export_adapter`;
    ``base_model_name_or_path`` for its config, by default MaxText's HF id of the model).

    Raises:
      LayoutMismatchError: an adapter step without ``base``; a config of another model
        (every mismatch named); a model MaxText cannot export; sizes that differ from
        MaxText's HF config without ``override_model_architecture``.
      UsageError: no alpha; MaxText not installed (`hf_mapping.MaxTextMissing`).
      StepExistsError: ``out`` holds files already.
    """
    if adapter:
        if base is not None:
            raise UsageError(
                "--adapter writes the adapters alone, to be served on the base model; --base "
                "merges them into the base: pass one of them."
            )
        if (process_count or 1) > 1:
            raise UsageError("--adapter writes one small file: run it as one process.")
        return export_adapter(
            step,
            out,
            maxtext_config=maxtext_config,
            alpha=alpha,
            base_model_name_or_path=base_model_name_or_path,
            override_model_architecture=override_model_architecture,
            dry_run=dry_run,
        )
    start = time.monotonic()
    pi, pc = _processes(process_index, process_count)
    out = epath.Path(out)
    store = store_for(out)
    if not dry_run and store.dir_taken(out, last=CONFIG_FILE):
        raise StepExistsError(f"{out}: already holds files; remove it or pass another --out.")
    ep = plan_export(
        step,
        out,
        maxtext_config=maxtext_config,
        base=base,
        alpha=alpha,
        override_model_architecture=override_model_architecture,
        memory_budget=memory_budget,
        max_shard_size=max_shard_size,
        process_index=pi,
        process_count=pc,
    )
    if dry_run:
        return ep.report
    work = out.parent / f"{out.name}{EXPORT_WORK_SUFFIX}"
    if not store.builds_in_place:
        work.mkdir(parents=True, exist_ok=True)
    done = work / f"{DONE_PREFIX}{pi}"
    budget = ep.report.memory["budget"]
    if _marker(store, done) != ep.fingerprint:
        done.unlink(missing_ok=True)
        if _shares_files(store, pc):
            _write_shared(ep, work, pi, pc, budget=budget)
        else:
            mine = [s for k, s in enumerate(ep.shards) if k % pc == pi]
            _write_shards(ep, work, mine, budget=budget)
        store.replace_file(done, ep.fingerprint)
    report = ep.report
    if pi != 0:
        report.status = "shards written"
    else:
        _wait_for_all(work, ep.fingerprint, pc)
        if _shares_files(store, pc):
            _place_shared(ep, work)
        report.files = _finish(ep, work, out, hf_model_path)
        report.status = "exported"
    report.seconds = round(time.monotonic() - start, 3)
    return report


def _processes(index: int | None, count: int | None) -> tuple[int, int]:
    if index is None and count is None:
        try:
            import jax

            if jax.process_count() > 1:
                return jax.process_index(), jax.process_count()
        except Exception:
            pass
        return 0, 1
    if index is None or count is None or not 0 <= index < count:
        raise UsageError("--process-index and --process-count go together, 0 <= index < count.")
    return index, count


def _marker(store: Any, path: epath.Path) -> str | None:
    """The fingerprint a process's marker holds (None: no marker)."""
    store.refresh(path)
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _wait_for_all(work: epath.Path, fingerprint: str, count: int) -> None:
    store = store_for(work)
    deadline = time.monotonic() + WAIT_S
    while True:
        missing = [
            p for p in range(count) if _marker(store, work / f"{DONE_PREFIX}{p}") != fingerprint
        ]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{work}: processes {missing} did not write their shards.")
        time.sleep(0.2)


def _finish(
    ep: ExportPlan, work: epath.Path, out: epath.Path, hf_model_path: str | None
) -> list[str]:
    """Process 0, once every shard is there: what is not this export's goes (another
    export's shards, parts of killed writers, a killed ``_finish``'s files), then the index,
    the tokenizer, config.json; then the markers go, and ``work`` becomes ``out``
    (config.json last on an object store)."""
    store = store_for(work)
    ours = {s.name for s in ep.shards}
    store.refresh(work)
    for f in work.iterdir():
        if f.name not in ours and not f.name.startswith(DONE_PREFIX):
            if f.is_dir():
                f.rmtree()
            else:
                f.unlink(missing_ok=True)
    idx = safetensors_out.index(ep.shards)
    if idx is not None:
        store.replace_file(work / safetensors_out.INDEX_FILE, json.dumps(idx, indent=2))
    if hf_model_path:
        staging = epath.Path(tempfile.mkdtemp(prefix="orbax-maxtext-layout-tokenizer-"))
        try:
            for name in hf_mapping.save_tokenizer(hf_model_path, str(staging)):
                store.put_file(staging / name, work / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    store.replace_file(work / CONFIG_FILE, hf_mapping.config_json(ep.model))
    for p in range(ep.report.process["count"]):
        (work / f"{DONE_PREFIX}{p}").unlink(missing_ok=True)
    store.publish_dir(work, out, last=CONFIG_FILE)
    store.refresh(out)
    return sorted(f.name for f in out.iterdir())


# -- writing ----------------------------------------------------------------------------------
def _write_shards(ep: ExportPlan, work: epath.Path, shards: list[Shard], *, budget: int) -> None:
    """Writes ``shards`` (each to a part file renamed into place when complete)."""
    if not shards:
        return
    wanted = {t.name for s in shards for t in s.tensors}
    files: dict[str, ShardFile] = {}
    where: dict[str, ShardFile] = {}
    who = f"{PART}{socket.gethostname()}.{os.getpid()}"
    store = store_for(work)
    staging = store.staging_dir(work)
    try:
        for s in shards:
            f = files[s.name] = ShardFile(str(staging / f"{s.name}{who}"), s)
            where.update({t.name: f for t in s.tensors})
        groups: dict[tuple[str, ...], list[Unit]] = {}
        for u in ep.units:
            if any(n in wanted for n in u.names):
                groups.setdefault(u.keys, []).append(u)
        _run_groups(ep, groups, where, budget)
        for s in shards:
            files[s.name].close()
            store.put_file(epath.Path(files[s.name].path), work / s.name)
    except BaseException:
        for f in files.values():
            with contextlib.suppress(OSError):
                f.abandon()
        raise
    finally:
        if str(staging) != str(work):
            shutil.rmtree(staging, ignore_errors=True)


def _shares_files(store: Any, count: int) -> bool:
    """Whether the processes of an export share its files (`_write_shared`): several of
    them, on a file system where each can write its ranges of a common file."""
    return count > 1 and store.writes_ranges


def _shared_part(shard: Shard, fingerprint: str) -> str:
    """The part file every process of a shared export writes ``shard`` into."""
    return f"{shard.name}{PART}shared.{fingerprint[:16]}"


def _write_shared(ep: ExportPlan, work: epath.Path, index: int, count: int, *, budget: int):
    """Process ``index`` of ``count`` sharing the export's files: it decodes only the
    params it owns (`_owned`: whole params, balanced by bytes) and writes each of their
    tensors into the part file of its shard, which every process opens (`ShardFile` with
    ``shared``). Each stored chunk is decoded by one process only, where a split by shards
    would have every process decode every stacked param for its own layers."""
    files = {
        s.name: ShardFile(str(work / _shared_part(s, ep.fingerprint)), s, shared=True)
        for s in ep.shards
    }
    where = {t.name: files[s.name] for s in ep.shards for t in s.tensors}
    try:
        _run_groups(ep, _owned(ep, index, count), where, budget)
        for f in files.values():
            f.close()  # fsync: this process's writes are on the disk before its marker
    except BaseException:
        for f in files.values():
            with contextlib.suppress(OSError):
                f.abandon()
        raise


def _owned(ep: ExportPlan, index: int, count: int) -> dict[tuple[str, ...], list[Unit]]:
    """The params (with their units) process ``index`` of ``count`` exports: every param
    goes to the process with the fewest bytes so far, largest first (the same split on
    every process: it depends on the plan only)."""
    groups: dict[tuple[str, ...], list[Unit]] = {}
    for u in ep.units:
        groups.setdefault(u.keys, []).append(u)
    load = [0] * count
    mine: dict[tuple[str, ...], list[Unit]] = {}
    for ks in _largest_first(ep, groups):
        p = load.index(min(load))
        load[p] += _group_bytes(ep, ks)
        if p == index:
            mine[ks] = groups[ks]
    return mine


def _group_bytes(ep: ExportPlan, keys: tuple[str, ...]) -> int:
    return sum(ep.moves[k].out_spec.nbytes for k in keys)


def _largest_first(ep: ExportPlan, groups: dict) -> list[tuple[str, ...]]:
    """The params of ``groups`` by output bytes, largest first (then by name): the order
    that leaves the least for one worker alone at the end (at 8B, the plan's order left a
    3.8 GB MLP kernel last: 14 s on one core of two)."""
    return sorted(groups, key=lambda ks: (-_group_bytes(ep, ks), ks))


def _place_shared(ep: ExportPlan, work: epath.Path) -> None:
    """Process 0, once every process's marker is there: each shared part file renamed to
    its shard's name (a rerun finds some already renamed)."""
    store = store_for(work)
    for s in ep.shards:
        part = work / _shared_part(s, ep.fingerprint)
        if part.exists():
            store.put_file(part, work / s.name)
        elif not (work / s.name).exists():
            raise FileNotFoundError(f"{work}: {s.name} was written by no process.")


class _Budget:
    """Bytes in flight, at most ``limit`` (one claim larger than it runs alone)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._cv = threading.Condition()

    def take(self, n: int) -> int:
        n = min(n, self.limit)
        with self._cv:
            self._cv.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
        return n

    def give(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()


def _run_groups(ep: ExportPlan, groups: dict, where: dict[str, ShardFile], budget: int) -> None:
    tskv.release_large_buffers()  # freed slices go back to the OS, not to a grown heap
    ctx = tskv.ts_context()
    sources = {n: tskv.SourceItem.open(d, ctx) for n, d in ep.sources.items()}
    gate = _Budget(budget)

    def job(keys: tuple[str, ...], units: list[Unit]) -> None:
        moves = [ep.moves[k] for k in keys]
        fns = _piece_fns(ep.model, moves, units)
        if fns is not None:
            per = _piece_held(moves[0], fns)
            size = _piece_bytes(budget, moves[0], per)
            factors = sum(f.a_spec.nbytes + f.b_spec.nbytes for f in set(moves[0].lora))
            held = gate.take(int(size * per) + factors)
            try:
                run = _Run(ep.model, sources, ctx, where)
                _write_pieces(run, moves[0], units, fns, size)
            finally:
                gate.give(held)
            return
        cost = _group_cost(ep.model, moves, units, budget)
        whole = cost <= budget
        held = gate.take(
            cost if whole else 3 * max(_slice_bytes(ep.model, moves[0], u) for u in units)
        )
        try:
            reader = _Reader(sources, ctx, whole=whole)
            for u in units:
                layers = [u.take_more(reader.layer(m, u.axis, u.index)) for m in moves]
                _write_unit(ep.model, u, layers, where)
                if u.index is None:
                    reader.cache.clear()  # the param's only unit: hold the slice only
        finally:
            gate.give(held)

    # One BLAS thread per worker, as in merge-lora (`merge_writer`): its own would spin.
    with (
        threadpool_limits(1, user_api="blas"),
        concurrent.futures.ThreadPoolExecutor(WORKERS) as pool,
    ):
        futures = [pool.submit(job, k, groups[k]) for k in _largest_first(ep, groups)]
        for f in concurrent.futures.as_completed(futures):
            f.result()


def _write_unit(model: HfModel, u: Unit, layers: list[np.ndarray], where: dict) -> None:
    """One unit's slices through MaxText's hooks, each HF tensor written whole."""
    arrays = [hf_mapping.restored(x, model.weight_dtype) for x in layers]
    del layers
    for name, arr in hf_mapping.transform(model, u, arrays):
        if name in where:
            where[name].write(name, arr)
        del arr


# -- a param piece by piece: its stored chunks decoded once --------------------------------
def _piece_held(m: Move, fns: dict) -> float:
    """What a piece's job holds, in times the piece: the hooks' intermediates
    (`piecewise.PieceFn.held`), and a merge's delta (float32) and its sum."""
    held = max((f.held for f in fns.values()), default=1.0)
    if m.op is Op.MERGE_LORA:
        held += 1 + 4 / max(1, np.dtype(m.spec.dtype).itemsize)
    return held


def _piece_bytes(budget: int, m: Move, held: float) -> int:
    """The size of the pieces a param is decoded in: a worker's share of the budget over
    what a piece's job holds (`_piece_held`), at least 256 KiB, at most the param."""
    return min(m.out_spec.nbytes, max(256 << 10, int(budget / (WORKERS * held))))


def _piece_fns(model: HfModel, moves: list[Move], units: list[Unit]) -> dict | None:
    """Each unit's hooks as a `piecewise.PieceFn` (one per distinct shape), or None where a
    param cannot go piece by piece: a fused or merged param, or a hook a box cannot
    go through (`piecewise`)."""
    m = moves[0]
    merged = m.op is Op.MERGE_LORA and not m.layers and m.index is None
    if merged and any(u.more for u in units):  # a merge's layer is the first stacked axis
        return None
    if len(moves) != 1 or not (m.op is Op.COPY or merged):
        return None
    shape = tuple(moves[0].out_spec.shape)
    fns: dict[int, piecewise.PieceFn] = {}
    traced: dict[tuple, piecewise.PieceFn | None] = {}
    for u in units:
        outs = tuple(hf_mapping.out_shapes(model, u).values())
        key = (u.hooks if callable(u.hooks) else tuple(u.hooks or ()), len(u.levels), outs)
        if key not in traced:
            traced[key] = piecewise.PieceFn.trace(
                lambda x, u=u: hf_mapping.hooked(model, u, [x]),
                u.slice_shape(shape),
                model.weight_dtype,
                outs,
            )
        if traced[key] is None:
            return None
        fns[id(u)] = traced[key]
    return fns


class _Run(NamedTuple):
    """What every job of an export shares: the model, the opened sources, the files."""

    model: HfModel
    sources: dict
    ctx: Any
    where: dict


def _write_pieces(run: _Run, m: Move, units: list[Unit], fns: dict, size: int) -> None:
    """Param ``m`` over the budget: each stored chunk decoded once (`chunks.pieces`), and
    each piece's part of each layer put through the hooks (`piecewise`) and written at its
    place in its HF tensors (`ShardFile.write_box`). A part the hooks cannot take alone
    leaves its unit to be read whole at the end (counted as ``layer decoded``)."""
    model, sources, ctx, where = run
    src = sources[m.item]
    wd = model.weight_dtype
    by_layer = {tuple(i for _, i in u.levels) or None: u for u in units}
    redo: dict[int, Unit] = {}
    factors = _Reader(sources, ctx, whole=True)  # a merge's factors, read whole once
    for piece in chunks.pieces(src, param_name(m.src), ctx, max_bytes=size, reuse=True):
        for index, start, part in _layer_parts(piece, units[0].levels, by_layer):
            u = by_layer[index]
            if id(u) in redo:
                continue
            if m.op is Op.MERGE_LORA:
                part = merge_part(m, index[0] if index else 0, start, part, factors.read_layer)
                if part is None:
                    redo[id(u)] = u
                    continue
            got = fns[id(u)].apply(start, hf_mapping.restored(part, wd))
            if got is None:
                redo[id(u)] = u
                continue
            for name, (at, data) in zip(hf_mapping.out_shapes(model, u), got, strict=True):
                if name in where:
                    where[name].write_box(name, at, data.astype(wd, copy=False))
        del piece
    factors.cache.clear()
    reader = _Reader(sources, ctx, whole=False)
    for u in redo.values():
        _write_unit(model, u, [u.take_more(reader.layer(m, u.axis, u.index))], where)


def _layer_parts(piece: chunks.Piece, levels: tuple, by_index: dict):
    """``(indices, start, values)`` of each unit slice a piece holds part of: the piece
    cut on each stacked axis in turn (``levels``: a unit's ``(axis, index)`` slices; none:
    the param is one unit, and the piece is its part)."""
    if not levels:
        yield None, piece.start, piece.data
        return
    parts = [((), piece.start, piece.data)]
    for a, _ in levels:
        parts = [
            ((*idx, start[a] + i), start[:a] + start[a + 1 :], data[(slice(None),) * a + (i,)])
            for idx, start, data in parts
            for i in range(data.shape[a])
        ]
    for idx, start, data in parts:
        if idx in by_index:
            yield idx, start, data


class _Reader:
    """Layers of a param's move, in stored form: decoded whole once (``whole``: each
    stored chunk once, `chunks.read_whole`) and sliced, or read layer by layer from
    storage (a merge over the budget; a layer `piecewise` cannot take)."""

    def __init__(self, sources: dict, ctx: Any, *, whole: bool) -> None:
        self.sources, self.ctx, self.whole = sources, ctx, whole
        self.cache: dict[tuple[str, Any], np.ndarray] = {}

    def read_layer(self, item: str, path: Any, axis: int | None, index: int | None) -> np.ndarray:
        if self.whole:
            if (item, path) not in self.cache:
                self.cache[item, path] = chunks.read_whole(
                    self.sources[item], param_name(path), self.ctx
                )
            x = self.cache[item, path]
            return x if axis is None or index is None else x[(slice(None),) * axis + (index,)]
        layer = None if axis is None or index is None else (axis, index)
        return tskv.read_array(self.sources[item], path, self.ctx, layer)

    def layer(self, m: Move, axis: int | None, index: int | None) -> np.ndarray:
        if m.op is Op.MERGE_LORA:
            if index is None:  # the whole merged param: what the op computes
                return apply_op(m, lambda item, p: self.read_layer(item, p, None, None))
            if m.axis != axis:  # cut on another axis first (MoE experts): merged whole, once
                if ("merged", m.dst) not in self.cache:
                    whole = apply_op(m, lambda item, p: self.read_layer(item, p, None, None))
                    self.cache["merged", m.dst] = whole
                return self.cache["merged", m.dst][(slice(None),) * axis + (index,)]
            return merge_layer(m, index, self.read_layer)
        if m.op is not Op.COPY:
            raise LayoutMismatchError(f"{keystr(m.dst)}: cannot export a {m.op.value} move.")
        return self.read_layer(m.item, m.src, axis, index)
