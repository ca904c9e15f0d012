"""``export-hf``: a step exported to Hugging Face safetensors, as MaxText's to_huggingface
does, or a LoRA step's adapters as a PEFT adapter (`export_hf`, imported when the command
runs)."""

from __future__ import annotations

import argparse

from .common import Subparsers, add_memory_budget, add_model_config, parse_size


def cmd_export_hf(args: argparse.Namespace) -> int:
    from ..hf.export_hf import ExportOptions, export_hf

    options = ExportOptions(
        base=args.base,
        alpha=args.alpha,
        hf_model_path=args.hf_model_path,
        override_model_architecture=args.override_model_architecture,
        memory_budget=args.memory_budget,
        max_shard_size=args.max_shard_size,
        dry_run=args.dry_run,
        process_index=args.process_index,
        process_count=args.process_count,
        adapter=args.adapter,
        base_model_name_or_path=args.base_model_name_or_path,
    )
    report = export_hf(args.step, args.out, options, maxtext_config=args.maxtext_config)
    print(report.to_json() if args.json else report)
    return 0


def add_export_hf(sub: Subparsers) -> None:
    e = sub.add_parser(
        "export-hf",
        help="export a step to Hugging Face safetensors, as MaxText's to_huggingface does "
        "(streaming; LoRA steps merged with --base)",
    )
    e.add_argument(
        "step",
        metavar="STEP",
        help="a MaxText or Tunix step (or its items/ or model_params/), a merge-lora output, "
        "or a LoRA adapter step (with --base, or --adapter)",
    )
    e.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face directory")
    e.add_argument("--base", help="a LoRA step's base: the step its run started from")
    e.add_argument(
        "--adapter",
        action="store_true",
        help="write a LoRA step's adapters as a PEFT adapter (adapter_model.safetensors, "
        "adapter_config.json), to serve on the base model",
    )
    e.add_argument(
        "--base-model-name-or-path",
        metavar="NAME",
        help="--adapter: the adapter config's base model (default: MaxText's HF id of it)",
    )
    e.add_argument("--alpha", type=float, help="a LoRA run's lora.lora_alpha (unless recorded)")
    e.add_argument(
        "--hf-model-path", metavar="PATH", help="a local tokenizer directory to write beside"
    )
    e.add_argument(
        "--override-model-architecture",
        action="store_true",
        help="write the MaxText config's sizes where they differ from MaxText's HF config",
    )
    add_memory_budget(e)
    e.add_argument(
        "--max-shard-size",
        type=parse_size,
        metavar="SIZE",
        help="split the weights into files of at most SIZE (default 3GiB, as MaxText)",
    )
    e.add_argument("--process-index", type=int, help="this process (several-process export)")
    e.add_argument("--process-count", type=int, help="how many processes share the export")
    add_model_config(e)
    e.set_defaults(fn=cmd_export_hf)
