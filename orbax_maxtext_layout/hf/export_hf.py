"""Export any step to Hugging Face safetensors, streaming, on one or many processes.

The export is the plan of the step's MaxText params (`merge.params_plan`: a MaxText step's
params copied, a Tunix step's weights told from its RNG state by the model, a LoRA step
merged into ``base`` by the ``merge_lora`` op) with a new sink: each param's layers go
through MaxText's own Hugging Face mapping (`hf_mapping`) into safetensors shards whose
layout is fixed from metadata before a byte is read (the `formats.sink.Sink` of the plan,
`formats.safetensors_writer.SafetensorsSink`). What it writes
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

This module is the front: `export_hf` and its options (`ExportOptions`). The plan and its
report are `export_plan` (`plan_export`, `ExportReport`), the memory budget `budget`, the
streaming of params into the shards `export_stream`, and the processes' parts, markers and
the finish `export_processes`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TypedDict, Unpack

from etils import epath

from ..errors import StepExistsError, UsageError
from ..execute.options import resolve
from ..lora.export_adapter import AdapterReport, export_adapter
from ..storage.store import EXPORT_WORK_SUFFIX, store_for
from .export_plan import ExportReport, plan_export
from .export_processes import CONFIG_FILE, finish, processes, write_part


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportOptions:
    """How `export_hf` exports a step: its keyword arguments of the same names, as one
    object (``export_hf(step, out, ExportOptions(dry_run=True), maxtext_config=[...])``).

    ``base``/``alpha``: a LoRA step's base step and ``lora_alpha`` (merged on the fly).
    ``hf_model_path``: a local tokenizer directory written beside.
    ``override_model_architecture``: the MaxText config's sizes where they differ from
    MaxText's HF config. ``memory_budget``:
    bytes held at once. ``max_shard_size``: the largest safetensors file (default 3 GiB).
    ``dry_run``: report only. ``process_index``/``process_count``: this process and how many
    share the export (default: JAX's). ``adapter``: write a LoRA step's adapters as a PEFT
    adapter, with ``base_model_name_or_path`` for its config.
    """

    base: epath.PathLike | None = None
    alpha: float | None = None
    hf_model_path: str | None = None
    override_model_architecture: bool = False
    memory_budget: int | None = None
    max_shard_size: int | None = None
    dry_run: bool = False
    process_index: int | None = None
    process_count: int | None = None
    adapter: bool = False
    base_model_name_or_path: str | None = None


class ExportKeywords(TypedDict, total=False):
    """`ExportOptions` as `export_hf`'s keyword arguments (for type checkers)."""

    base: epath.PathLike | None
    alpha: float | None
    hf_model_path: str | None
    override_model_architecture: bool
    memory_budget: int | None
    max_shard_size: int | None
    dry_run: bool
    process_index: int | None
    process_count: int | None
    adapter: bool
    base_model_name_or_path: str | None


def export_hf(
    step: epath.PathLike,
    out: epath.PathLike,
    options: ExportOptions | None = None,
    *,
    maxtext_config: Sequence[str],
    **keywords: Unpack[ExportKeywords],
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
    The options (`ExportOptions`) come as one object or as keyword arguments, not both.

    Raises:
      LayoutMismatchError: an adapter step without ``base``; a config of another model
        (every mismatch named); a model MaxText cannot export; sizes that differ from
        MaxText's HF config without ``override_model_architecture``.
      UsageError: no alpha; MaxText not installed (`hf_mapping.MaxTextMissing`);
        ``options`` together with option keywords.
      StepExistsError: ``out`` holds files already.
    """
    o = resolve(ExportOptions, options, keywords, "export_hf")
    if o.adapter:
        return _export_adapter(step, out, o, maxtext_config=maxtext_config)
    start = time.monotonic()
    pi, pc = processes(o.process_index, o.process_count)
    out = epath.Path(out)
    store = store_for(out)
    if not o.dry_run and store.dir_taken(out, last=CONFIG_FILE):
        raise StepExistsError(f"{out}: already holds files; remove it or pass another --out.")
    ep = plan_export(
        step,
        out,
        maxtext_config=maxtext_config,
        base=o.base,
        alpha=o.alpha,
        override_model_architecture=o.override_model_architecture,
        memory_budget=o.memory_budget,
        max_shard_size=o.max_shard_size,
        process_index=pi,
        process_count=pc,
        store=store,
    )
    if o.dry_run:
        return ep.report
    work = out.parent / f"{out.name}{EXPORT_WORK_SUFFIX}"
    if not store.builds_in_place:
        work.mkdir(parents=True, exist_ok=True)
    try:
        write_part(ep, work, pi, pc)
    except Exception:
        # A one-process export that failed (a source cut short, a full disk) leaves nothing
        # beside --out; a kill still leaves the work directory for a rerun to complete, and
        # so does a failure with other processes' shards in it (theirs are not ours to drop).
        if pc == 1:
            store.discard(work)
        raise
    report = ep.report
    if pi != 0:
        report.status = "shards written"
    else:
        report.files = finish(ep, work, out, o.hf_model_path)
        report.status = "exported"
    report.seconds = round(time.monotonic() - start, 3)
    return report


def _export_adapter(
    step: epath.PathLike, out: epath.PathLike, o: ExportOptions, *, maxtext_config: Sequence[str]
) -> AdapterReport:
    """``adapter``: the LoRA step's adapters alone, as a PEFT adapter (`export_adapter`)."""
    if o.base is not None:
        raise UsageError(
            "--adapter writes the adapters alone, to be served on the base model; --base "
            "merges them into the base: pass one of them."
        )
    if (o.process_count or 1) > 1:
        raise UsageError("--adapter writes one small file: run it as one process.")
    return export_adapter(
        step,
        out,
        maxtext_config=maxtext_config,
        alpha=o.alpha,
        base_model_name_or_path=o.base_model_name_or_path,
        override_model_architecture=o.override_model_architecture,
        dry_run=o.dry_run,
    )
