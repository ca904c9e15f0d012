"""``merge-lora``: a Tunix LoRA adapter step merged into its base, written as a MaxText
param-only step (`merge_lora`)."""

from __future__ import annotations

import argparse

from ..errors import OrbaxMaxTextLayoutError, UsageError, print_error
from ..lora.merge import merge_lora
from .common import (
    Subparsers,
    add_json,
    add_memory_budget,
    add_scan_form,
    add_target,
    target_for,
)


def cmd_merge_lora(args: argparse.Namespace) -> int:
    target = target_for(args)
    try:
        report = merge_lora(
            args.adapter_step,
            args.base,
            alpha=args.alpha,
            out=args.out,
            target=target,
            scan=args.rescan,
            scan_axis=args.scan_axis,
            plain_scan=args.plain_scan,
            memory_budget=args.memory_budget,
            dry_run=args.dry_run,
        )
    except UsageError:
        raise
    except (OrbaxMaxTextLayoutError, OSError) as e:
        print_error(e)
        return 1
    print(report.to_json() if args.json else report)
    return 0


def add_merge_lora(sub: Subparsers) -> None:
    m = sub.add_parser(
        "merge-lora",
        help="merge a Tunix LoRA adapter step into its base: a MaxText param-only step "
        "at OUT/0/items",
    )
    m.add_argument(
        "adapter_step", metavar="ADAPTER_STEP", help="the LoRA step, or its model_params"
    )
    m.add_argument(
        "--base",
        required=True,
        help="the MaxText step the LoRA run started from (or its items/), or a full Tunix "
        "step of the same model (then also --target-from/--target/--maxtext-config)",
    )
    m.add_argument(
        "--alpha",
        type=float,
        help="the run's lora.lora_alpha (required unless the step records it)",
    )
    m.add_argument("--out", required=True, metavar="DIR", help="writes DIR/0/items")
    add_target(m)
    add_scan_form(m, target_note=False)
    m.add_argument(
        "--scan-axis",
        type=int,
        choices=[0, 1],
        help="the model's param_scan_axis, only where the shapes fit both",
    )
    add_memory_budget(m)
    m.add_argument("--dry-run", action="store_true", help="report only; reads metadata")
    add_json(m)
    m.set_defaults(fn=cmd_merge_lora)
