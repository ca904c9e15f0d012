"""``import-hf``: a Hugging Face directory written as a MaxText step (`hf.import_hf`)."""

from __future__ import annotations

import argparse
import sys

from .common import Subparsers, add_model_config, parse_size


def cmd_import_hf(args: argparse.Namespace) -> int:
    from ..hf.import_hf import ImportOptions, import_hf

    def progress(done: int, total: int) -> None:
        if not args.json and sys.stderr.isatty():
            print(f"\rimport-hf: {done}/{total} slices", end="", file=sys.stderr, flush=True)

    options = ImportOptions(
        save_dtype=args.save_dtype,
        memory_budget=args.memory_budget,
        dry_run=args.dry_run,
        progress=progress,
        adapter=args.adapter,
        base=args.base,
        as_lora=args.as_lora,
    )
    report = import_hf(args.hf_dir, args.out, options, maxtext_config=args.maxtext_config)
    if sys.stderr.isatty() and not args.json and not args.dry_run:
        print(file=sys.stderr)
    print(report.to_json() if args.json else report)
    return 0


def add_import_hf(sub: Subparsers) -> None:
    from ..hf.import_hf import DEFAULT_SAVE_DTYPE, SAVE_DTYPES

    i = sub.add_parser(
        "import-hf",
        help="write a Hugging Face directory as a MaxText step, as MaxText's to_maxtext does "
        "(streaming, in bounded memory)",
    )
    i.add_argument(
        "hf_dir",
        metavar="HF_DIR",
        nargs="?",
        help="a Hugging Face directory (config.json and model.safetensors or its index), "
        "local, gs://, or a Hub cache snapshot (none with --base)",
    )
    i.add_argument("--out", required=True, metavar="DIR", help="where the step goes (DIR/0)")
    i.add_argument(
        "--save-dtype",
        choices=sorted(SAVE_DTYPES),
        help=f"the params' dtype (default {DEFAULT_SAVE_DTYPE}, as to_maxtext's --save_dtype; "
        "with --base, the base step's)",
    )
    i.add_argument(
        "--memory-budget",
        type=parse_size,
        metavar="SIZE",
        help="bytes of slices held at once, e.g. 2GiB (default 1GiB)",
    )
    i.add_argument(
        "--adapter",
        metavar="ADAPTER_DIR",
        help="a PEFT LoRA adapter of this model (adapter_config.json and "
        "adapter_model.safetensors), merged in: W + s·B@A per adapted tensor in float32, with "
        "PEFT's scale for its module (rsLoRA, rank and alpha patterns), before MaxText's hooks",
    )
    i.add_argument(
        "--base",
        metavar="STEP",
        help="a MaxText step of the model (or its items) as the base, in place of HF_DIR: "
        "the --adapter merged into it (MaxText's hooks of each delta added in float32)",
    )
    i.add_argument(
        "--as-lora",
        action="store_true",
        help="with --adapter (no HF_DIR needed): write the adapter as the Tunix LoRA step "
        "MaxText's train_sft writes and resumes from (DIR/0/model_params, qwix's factors; "
        "lora.* keys of the config used where set), not merged",
    )
    add_model_config(i, " (scan_layers picks the form written)")
    i.set_defaults(fn=cmd_import_hf)
