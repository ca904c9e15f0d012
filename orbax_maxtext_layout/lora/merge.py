"""`merge_lora`: a Tunix LoRA adapter step merged into its base, written as a MaxText step
by the one writer (`execute.write`), under the same lock and publication as a conversion;
its report (`MergeReport`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Unpack

from etils import epath

from ..base.reports import Report
from ..base.treepaths import keystr
from ..execute.options import MergeKeywords, MergeOptions, resolve
from ..execute.write import write_items
from ..orbax_io import stepdir
from ..orbax_io.orbax_files import reads_each_item_once
from ..storage.store import store_for
from .merge_plan import NOT_PARAMS, adapter_item, merge_provenance, merge_sources, plan_merge


@dataclasses.dataclass
class MergeReport(Report):
    """What a merge did (or, for a dry run, would do)."""

    out: str
    status: str  # "merged" | "dry-run"
    adapter_step: str
    base: str
    alpha: float
    rank: int
    scale: float
    layer_axis: int | None
    scan: str | None
    modules: list[str]
    merged: list[str]
    destinations: dict[str, dict[str, int]]
    dropped: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    bytes_written: int = 0

    def __str__(self) -> str:
        params = self.destinations.get("params", {})
        axis = "unscanned" if self.layer_axis is None else f"layer axis {self.layer_axis}"
        lines = [
            f"{self.out}: {self.status} (LoRA merge)",
            f"  adapters {self.adapter_step}: rank {self.rank}, alpha {self.alpha:g}, "
            f"scale {self.scale:g}, {axis}",
            f"  base {self.base}",
            f"  params: {params.get('leaves', 0)} leaves, {params.get('bytes', 0):,} bytes; "
            f"{len(self.merged)} merged: "
            + ", ".join(self.merged[:4])
            + (f", ... ({len(self.merged) - 4} more)" if len(self.merged) > 4 else ""),
        ]
        if self.scan:
            lines.append(f"  written {'unrolled' if self.scan == 'unroll' else 'stacked'}")
        if self.dropped:
            lines.append(f"  dropped {len(self.dropped)} base leaves ({NOT_PARAMS})")
        lines += [f"  note: {n}" for n in self.notes]
        if self.status == "merged":
            lines.append(f"  bytes written: {self.bytes_written:,}")
        return "\n".join(lines)


# -- merge-lora: the same writer, lock and publication ----------------------------------------
@reads_each_item_once
def merge_lora(
    adapter_step: epath.PathLike,
    base: epath.PathLike,
    options: MergeOptions | None = None,
    *,
    out: epath.PathLike,
    **keywords: Unpack[MergeKeywords],
) -> MergeReport:
    """Merges a Tunix LoRA adapter step into ``base``; writes ``<out>/0/items``.

    ``adapter_step`` is the LoRA step (or its ``model_params``); ``base`` the MaxText
    step the LoRA run started from (or its ``items``), or a full Tunix step of the same
    model (then pass ``target``). Either may be on ``gs://``. The result holds the base's
    ``params`` with each adapted weight merged; every other param is the base's stored
    bytes (hard links or server-side copies, never decoded). Provenance (base, adapter
    step, alpha, rank, modules, layer axis) goes in the step's custom metadata. The
    step appears under ``out`` only once complete; nothing is written on a refusal.
    ``scan="unroll"``/``"stack"`` writes the other scan form (``target``, built from
    MaxText's config, names the model in either form); ``plain_scan`` stacks an unscanned
    base with no scanned form at hand as a plain scan (`rescan.check_plain_stack`).
    The options (`MergeOptions`) come as one object or as keyword arguments, not both.
    """
    o = resolve(MergeOptions, options, keywords, "merge_lora")
    adapter_dir, _ = adapter_item(adapter_step)
    plan, adapters, alpha = plan_merge(
        adapter_step,
        base,
        alpha=o.alpha,
        target=o.target,
        scan=o.scan,
        scan_axis=o.scan_axis,
        plain_scan=o.plain_scan,
    )
    dest = epath.Path(out) / "0"
    axis = next((m.args.axis for m in plan.moves if m.op.factors(m)), None)  # a merge's
    report = MergeReport(
        out=str(dest),
        status="dry-run" if o.dry_run else "merged",
        adapter_step=str(adapter_dir),
        base=str(base),
        alpha=alpha,
        rank=adapters.rank,
        scale=alpha / adapters.rank,
        layer_axis=axis if adapters.scanned else None,
        scan=o.scan,
        modules=adapters.modules,
        merged=[keystr(m.dst) for m in plan.moves if m.op.factors(m)],
        destinations={k: v for k, v in plan.summary().items() if k in ("params", "dropped")},
        dropped=[
            {"item": d.item, "path": keystr(d.src), "bytes": d.spec.nbytes, "reason": d.reason}
            for d in plan.drops
        ],
        notes=list(plan.notes),
    )
    if o.dry_run:
        return report
    prov = merge_provenance(
        plan,
        adapters,
        alpha=alpha,
        adapter_dir=adapter_dir,
        base=base,
        scan=o.scan,
        scan_axis=o.scan_axis,
        target=o.target,
    )
    sources = merge_sources(adapter_step, base)
    store = store_for(dest)
    with stepdir.building_step(
        dest, store=store, taken="remove it or choose another --out"
    ) as work:
        report.bytes_written = write_items(
            work, plan, sources, provenance=prov, budget=o.memory_budget, store=store
        ).bytes_written
    return report
