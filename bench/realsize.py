"""Benchmark (issue 30): every streaming operation of the CLI on real-size steps, against ``cp -r``.

    V=$(ls -d /root/.cache/orbax-maxtext-layout/interop-venv-*)
    # the real-size run: about 40 GiB of steps under --work (kept for the next run), and up
    # to 15 GiB of output at a time (deleted after each operation); steps built in ~15 min
    PYTHONPATH=$PWD $V/bin/python bench/realsize.py --work /tmp/omtl-realsize --json realsize.json
    # a quick run on cut models (about 2.5 GB per llama step)
    PYTHONPATH=$PWD $V/bin/python bench/realsize.py --layers 2 --moe-layers 1 --max-shard-size 1GiB
    # the builder against stock Orbax saves of the same values (small; exit 1 on any difference)
    PYTHONPATH=$PWD $V/bin/python bench/realsize.py prove --layers 2 --moe-layers 1

Run it with the interop venv's Python (MaxText 0.2.5, Python 3.12); every child runs with the
same interpreter, on JAX's CPU backend. The orchestrator and the measuring wrapper import the
standard library only.

**The steps** are built once in ``--work`` (default ``/tmp/omtl-realsize``), each by a child
process, and reused by later runs while ``<work>/<step>.step.json`` records the same
parameters (``--layers``, ``--moe-layers``, ``--seed``):

- ``llama-fsdp`` (``<work>/llama-fsdp/0``): MaxText's unmodified ``llama3.1-8b`` (8.03 B
  params, ``weight_dtype=bfloat16``, ``scan_layers=true``, ``param_scan_axis`` 1; with
  ``--layers N`` below 32, ``override_model_config=true base_num_decoder_layers=N``), a
  param-only MaxText step: ``items`` holds ``params/params/{decoder,token_embedder}/...``,
  Orbax OCDBT + zarr3, ``custom_metadata={"scan_layers": true}`` in ``_CHECKPOINT_METADATA``.
  The tree and shapes are MaxText's own abstract model
  (`_internal.abstract_model`). It is saved as from 8 devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=8``), each param sharded on its largest
  non-layer axis that divides by 8 (replicated if none), so each array is stored as 8
  per-device chunks, each spanning every layer (issue 30's step; MaxText's own fsdp rules
  would shard most kernels on their embed axis instead, e.g. ``wi_0`` on axis 0, not 2). Values: normal * 0.02 (norm scales 1 + normal * 0.1) in bf16, drawn per
  piece (the 8 fsdp slices of a param) from ``default_rng([seed, crc32(param path), piece])``
  as 16-bit indices into the normal quantiles (`Values`).
- ``llama-onechunk`` (``<work>/llama-onechunk/0``): the same values, saved as from one device
  (``SingleDeviceSharding``): one stored chunk per array, except that Orbax splits an array
  larger than its 2 GiB OCDBT target file size: at 32 layers each MLP kernel (3.76 GB) is
  stored as 2 chunks of (4096, 32, 7168) or (7168, 32, 4096), 1.88 GB decoded, one zstd frame
  each, both spanning all layers.
- ``tunix-fsdp`` (``<work>/tunix-fsdp/1``): the same model in Tunix's layout, as google-tunix
  0.1.7 saves ``nnx.state(model)`` (``model_params`` only, a ``value`` level on every leaf,
  zarr2, the RNG state of MaxText's model included), 8-way fsdp chunks, the same weights.
  ``convert`` skips steps that already hold MaxText ``items/``, so ``convert --unroll`` and
  ``verify`` need this step.
- ``lora16`` (``<work>/lora16/1``): a Tunix LoRA adapter step on ``llama-fsdp``'s model:
  rank 16, alpha 32, qwix factors of all 7 modules (query, key, value, out, wi_0, wi_1, wo),
  float32, written by `tests/lora_writers.write_adapters` (stock Orbax).
- ``moe-cut`` (``<work>/moe-cut/0``): MaxText's ``qwen3-30b-a3b`` (128 experts) cut to
  ``--moe-layers`` (default 4: 6.2 GB of bf16 weights) with ``override_model_config=true``,
  otherwise as ``llama-fsdp``.

How a step is built without holding the model: stock Orbax saves it (``CheckpointManager``,
``PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=...)``, as bench/export_hf.py saves its
step), so every file but the chunks' bytes is Orbax's own (``_METADATA``, ``_sharding``,
``array_metadatas``, the per-process OCDBT database and its merge, the commit files), and each
array's tensorstore spec (zarr metadata, chunk grid, codecs, kvstore) is the one Orbax builds.
Only the writing of each array's bytes is replaced: each leaf is a lazy array (shape, dtype,
sharding, no data) and its shards are generated and written one at a time with that spec, in
transactions of at most 1 GiB (a one-chunk array's shard in one transaction). ``prove``
checks it against stock Orbax saves of the same values from real ``jax.Array``s (every JSON
file, every key and every stored value byte for byte) and against MaxText 0.2.5's own
``save_checkpoint``; after each build a child restores the step's metadata and several
arrays with stock Orbax and compares them with the values drawn again from the seed.

**The operations**, each in a fresh child process, with a fresh output directory deleted
right after (then ``sync``); the step's files are read once, untimed, before each:

- ``cp``: ``cp -r STEP OUT`` of every step measured (once untimed first; the floor);
- ``export-hf`` (llama-fsdp, llama-onechunk, moe-cut): ``python -m orbax_maxtext_layout
  export-hf STEP --out OUT --memory-budget BUDGET --hf-model-path tests/fixtures/hf_tokenizer
  [--override-model-architecture] [--max-shard-size S] --maxtext-config <base.yml> <keys>``;
- ``export-hf-2p`` (the llama steps): the same with ``--process-index i --process-count 2``,
  both processes started together: wall until both exit, bytes summed, each one's peak RSS;
- ``merge-lora`` (lora16): ``merge-lora LORA --base LLAMA_FSDP --alpha 32 --out OUT
  --memory-budget BUDGET``;
- ``export-adapter`` (lora16): ``export-hf LORA --adapter --alpha 32 --out OUT
  --maxtext-config <base.yml> <keys>``, the adapters as a PEFT adapter (issue 31);
- ``convert-unroll`` (tunix-fsdp): ``convert ROOT --unroll --out OUT --optimizer drop
  --memory-budget BUDGET -q --maxtext-config <base.yml> <keys>``, then ``verify`` of that
  output (its ``model_params`` hard-linked beside ``items/``), timed alone;
- ``floor-decode`` (the llama steps, tunix-fsdp, moe-cut) and ``floor-codec`` (tunix-fsdp):
  ``bench/floor.py STEP [--encode 1]``, every stored chunk of the step decoded once on both
  cores with the package's reader (and re-encoded at zstd level 1), nothing written: what
  this machine spends at least. Each row of ``export-hf`` and ``convert-unroll`` gets its
  floor (``FLOOR_OF``; ``verify``'s is two decode passes, both sides) as ``floor_s``,
  ``x_floor`` and ``floor_x_cp`` (a ``cp -r`` goal below ``floor_x_cp`` is out of this
  machine's reach); ``export-hf-2p`` gets ``x_one_process_floor``, one process's CPU seconds
  spread over 2 cores, as a share of its wall time;
- ``baseline``: a child that imports what the operations import (jax with its CPU backend up,
  MaxText's exporter module, Orbax, safetensors, the package) and exits.

Each command runs under a standard-library wrapper: wall time from start to exit; peak RSS
from ``wait4``'s rusage (the VmHWM of the process and of any process it reaped); the
``rchar``/``read_bytes``/``wchar``/``write_bytes`` of ``/proc/<pid>/io``, read after the
process exited and before it is reaped (``waitid(..., WNOWAIT)``), which includes the
processes it reaped. ``rchar`` counts bytes through ``read(2)``-family calls (from the page
cache too); bytes read through ``mmap`` are not in it (the minor faults are in the JSON).
A step's stored chunks and safetensors tensors are read with ``preadv`` (issue 58; from
2026-12-06 to issue 58 they were mapped where the kernel populates a mapped range in one
call, and not in ``rchar`` there). Each chunk is decoded once: the tests check that through
``io_counts``'s "chunk decoded".
"over baseline" subtracts the baseline's peak RSS and its ``rchar`` (the imports).
Medians of ``--repeats`` (peak RSS: the largest). ``--before DIR`` also runs every operation
with another checkout's package first on ``PYTHONPATH``, side by side.

**The goals** of issue 30, held or not held per row: ``export-hf`` of the llama steps ≤ 5x
``cp -r`` of the step, ``rchar`` over imports ≤ 1.25x the step on disk, RSS over baseline ≤
budget + 512 MiB; ``merge-lora`` ≤ 5x ``cp -r`` of the base, same RSS bound; ``convert
--unroll`` ≤ 3x ``cp -r``, ``verify`` ≤ 2x; ``export-hf`` with 2 processes ≤ 0.6x one
process. The outputs of ``export-hf`` are hashed before deletion: the two llama chunkings,
and 1 and 2 processes, must write identical files.

Exit status 1 if a build or an operation fails or the export outputs differ (goals not held
do not fail the run).
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

from export_hf import parse_size  # bench/export_hf.py's (standard library only at its top)
from realsize_build import build, check_step
from realsize_ops import Runner, baseline, ensure_step, settle
from realsize_prove import prove, stock_save
from realsize_report import report, summarize
from realsize_steps import (
    APPLICABLE,
    LLAMA_LAYERS,
    OPS,
    PKG,
    REPO,
    STEPS,
    TOKENIZER,
    package_of,
    step_params,
)
from realsize_wrap import wrap

# Standard library only at the top, here and in every realsize_* module but realsize_build:
# the orchestrator and the wrapper must stay small (a child's ru_maxrss starts from its
# parent's high-water mark).


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/omtl-realsize"),
        help="where the steps are built and kept (default /tmp/omtl-realsize)",
    )
    ap.add_argument("--only", nargs="+", choices=list(STEPS), help="these steps only")
    ap.add_argument(
        "--ops", nargs="+", choices=list(OPS), help="these operations only (cp always runs)"
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget", default="2GiB", help="--memory-budget of every operation")
    ap.add_argument("--layers", type=int, default=LLAMA_LAYERS, help="llama layers (default 32)")
    ap.add_argument("--moe-layers", type=int, default=4, help="qwen3-30b-a3b layers (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="models cut to a few MiB (realsize_steps.TINY): a smoke run, not a measure",
    )
    ap.add_argument(
        "--max-shard-size", help="export-hf's --max-shard-size (default: its own, 3GiB)"
    )
    ap.add_argument(
        "--before",
        type=Path,
        metavar="DIR",
        help="also run every operation with DIR's package (another checkout), side by side",
    )
    ap.add_argument(
        "--package",
        type=Path,
        default=REPO,
        metavar="DIR",
        help="the checkout whose package the operations run (default: this one)",
    )
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per operation")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write every figure here")
    ap.add_argument("--remove-steps", action="store_true", help="delete the built steps at the end")
    return ap


def plan(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    """``(steps asked for, operations, steps needed)``: verify needs convert-unroll's output,
    merge-lora the llama-fsdp base (and its cp -r, the floor of merge-lora)."""
    steps = [n for n in STEPS if not args.only or n in args.only]
    ops = list(args.ops or OPS)
    if "verify" in ops and "convert-unroll" not in ops:
        ops.append("convert-unroll")  # verify reads convert's output
    needed = list(steps)
    if "lora16" in steps and "merge-lora" in ops and "llama-fsdp" not in needed:
        needed.insert(0, "llama-fsdp")
    return steps, ops, needed


def run(runner: Runner, steps: list[str], ops: list[str], needed: list[str]) -> None:
    """Every operation asked for, step by step, each after its step's ``cp -r``."""
    runner.scratch.mkdir(parents=True, exist_ok=True)
    try:
        if "baseline" in ops:
            runner.baselines()
        for name in needed:
            step_ops = [op for op in APPLICABLE[name] if op in ops]
            if name not in steps and name == "llama-fsdp":
                step_ops = []  # only its cp -r, the floor of merge-lora
            runner.cp(name)
            if step_ops:
                runner.step_ops(name, step_ops)
        runner.check_digests()
    finally:
        settle(runner.scratch)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    parse_size(args.budget)
    if not TOKENIZER.is_dir():
        raise SystemExit(f"no tokenizer at {TOKENIZER}")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    steps, ops, needed = plan(args)
    infos = {}
    for name in needed:
        params = step_params(name, args.layers, args.moe_layers, args.seed, args.tiny)
        infos[name] = ensure_step(work, name, params, args.timeout)
    packages = {"": args.package.resolve()}
    if args.before:
        packages["before"] = args.before.resolve()
    for package in packages.values():
        got = package_of(package)
        if got != package / PKG:
            raise SystemExit(f"{package}: the children import {got}")
    runner = Runner(args, work, infos, packages)
    run(runner, steps, ops, needed)
    summary = summarize(args, infos, runner)
    report(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if args.remove_steps:
        for name in needed:
            shutil.rmtree(work / name, ignore_errors=True)
            (work / f"{name}.step.json").unlink(missing_ok=True)
    return 0 if summary["ok"] else 1


def child(argv: list[str]) -> int | None:
    """The verbs a child process runs (``build``, ``check-step``, ``stock``, ``baseline``,
    ``wrap``) and ``prove``; None if ``argv`` names none of them."""
    verb, rest = argv[:1], argv[1:]
    if verb == ["build"]:
        build(Path(rest[0]), rest[1], json.loads(rest[2]), Path(rest[3]))
    elif verb == ["check-step"]:
        check_step(Path(rest[0]), rest[1], json.loads(rest[2]), Path(rest[3]))
    elif verb == ["stock"]:
        stock_save(Path(rest[0]), rest[1], json.loads(rest[3]), rest[2], Path(rest[4]))
    elif verb == ["prove"]:
        return prove(rest)
    elif verb == ["baseline"]:
        baseline()
    elif verb == ["wrap"]:
        wrap(Path(rest[0]))
    else:
        return None
    return 0


if __name__ == "__main__":
    code = child(sys.argv[1:])
    sys.exit(main() if code is None else code)
