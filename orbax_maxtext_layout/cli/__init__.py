"""Command line: ``orbax-maxtext-layout {demo,inspect,convert,verify,merge-lora,export-hf}``.

A thin layer over `find_steps`, `plan_step`, `convert_step`, `merge_lora` and `export_hf`.
Exit codes: 0 all steps converted or skipped, 1 a step failed, 2 usage error (`verify`: 3
when nothing was verified).

Imports: every folder below it (the top of the house, docs/design.md); nothing imports it
but `__main__`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from etils import epath

from .._version import EXAMPLES_DIR as EXAMPLES
from ..errors import (
    CheckpointReadError,
    LayoutMismatchError,
    OrbaxMaxTextLayoutError,
    ReadOnlyStepError,
    UsageError,
    print_error,
)
from ..execute.convert import (
    StepReport,
    check_rescan_destination,
    convert_placed,
    convert_step,
    converted_provenance,
    merge_lora,
)
from ..execute.options import FLAGS, ConvertOptions
from ..execute.options import check as check_options
from ..execute.verify import RESCANNED, verify_step
from ..execute.write import DEFAULT_BUDGET
from ..model.layermap import scanned_form
from ..model.lora import LoraAdapterStepError, adapters_of, model_paths
from ..model.target import Target
from ..orbax_io import stepmeta
from ..orbax_io.layout import (
    TUNIX_PARAMS_ITEM,
    Layout,
    maxtext_number,
    tunix_step_number,
)
from ..orbax_io.spec import read_specs
from ..plan import renumbering, rescan
from ..plan.merge import SOURCE_LAYOUT
from ..plan.step_plan import Plan, plan_step
from ..plan.steps import StepInfo, find_step_roots, find_steps
from ..storage.store import store_for

# `verify`'s exit code when it found nothing to verify (0: all verified, 1: a mismatch or an
# error, 2: a usage error).
NOTHING_VERIFIED = 3


def _parse_steps(text: str | None) -> set[int] | None:
    if not text:
        return None
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _load_target(args: argparse.Namespace) -> Target | None:
    if args.target_from:
        return Target.from_checkpoint(args.target_from)
    if args.maxtext_config:
        both = getattr(args, "rescan", None) is not None  # convert/merge-lora --unroll/--stack
        return _target_from_maxtext_config(args.maxtext_config, both_forms=both)
    if args.target:
        module, _, fn = args.target.partition(":")
        made = getattr(importlib.import_module(module), fn)()
        if isinstance(made, Target):
            return made
        if isinstance(made, dict) and {"params", "nnx_aux", "opt_state", "step"} & set(made):
            return Target.from_items(made)  # MaxText's own abstract items
        return Target.from_nnx(made)
    return None


def _target_from_maxtext_config(argv: list[str], both_forms: bool = False) -> Target:
    """Built by MaxText (metadata only), on CPU (`main`). ``both_forms``: with
    MaxText's model in the other scan form too (`rescan.maxtext_forms`), for a scan change."""
    try:
        if both_forms:
            return rescan.maxtext_forms(argv)
        return Target.from_maxtext_config(argv)
    except ImportError as e:  # MaxText is not a dependency: a usage error (exit 2)
        raise UsageError(f"cannot build the target: {e}") from e


class _MaxTextConfigValues(argparse.Action):
    """``--maxtext-config CONFIG [KEY=VALUE ...]``: refuses a value that is neither (positional
    arguments after its values are moved in front of it first, by `_positionals_first`)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Sequence[str],
        option_string: str | None = None,
    ) -> None:
        for i, v in enumerate(values):
            if "=" in v or (i == 0 and v.endswith(".yml")):
                continue
            what = "a MaxText config file (.yml)" if i == 0 else "a KEY=VALUE override"
            parser.error(
                f"{option_string} takes the config file (.yml), then KEY=VALUE overrides, as "
                f"MaxText's commands do; {v!r} is not {what}."
            )
        setattr(namespace, self.dest, list(values))


def parse_size(text: str) -> int:
    """``2GiB``, ``512MiB``, ``1G``, ``1000000`` -> bytes."""
    units = {
        "": 1,
        "k": 10**3,
        "m": 10**6,
        "g": 10**9,
        "t": 10**12,
        "ki": 2**10,
        "mi": 2**20,
        "gi": 2**30,
        "ti": 2**40,
    }
    t = text.strip().lower().removesuffix("b")
    num = t.rstrip("kmgti")
    try:
        return int(float(num) * units[t[len(num) :]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB)") from None


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="converting", file=sys.stderr)


def cmd_convert(args: argparse.Namespace) -> int:
    """``convert``: checks the options, plans the run, converts each step, reports."""
    _check_convert_options(args)
    target = _convert_target(args)
    wanted = _parse_steps(args.steps)
    root = epath.Path(args.root)
    if (hint := _no_steps_hint(root)) is not None:
        return hint
    steps = [s for s in find_steps(root) if wanted is None or s.step in wanted]
    if args.rescan == "stack" and any(_unscanned(s) for s in steps):
        # a usage error (exit 2), before any step is planned or moved; a step in the other
        # form is refused by its own plan ("the scan form differs")
        rescan.check_plain_stack(target, plain_scan=args.plain_scan, where=args.root)
    if args.rescan is not None:  # a usage error (exit 2), before any step is written
        check_rescan_destination([s.path for s in steps], args.out, FLAGS)
    reports, inside = _skip_outside_links(args, root, steps)
    failures = _convert_all(args, target, root, _plan_run(args, target, inside), reports)
    _print_run_report(args, reports)
    if failures:
        _print_failures(failures)
        return 1
    return 0


def _unscanned(info: StepInfo) -> bool:
    """Whether a step's model is stored unscanned (`layermap.scanned_form`; metadata only)."""
    item = info.path / ("model_params" if info.layout is Layout.TUNIX else "items")
    try:
        return scanned_form(read_specs(item)) is False
    except OrbaxMaxTextLayoutError:  # its own plan reports it
        return False


def _check_convert_options(args: argparse.Namespace) -> None:
    """`convert_step`'s own option checks (`options.check`), naming the flags: a refusal
    is a usage error (exit 2)."""
    asked = ConvertOptions(
        in_place=args.in_place,
        copy=args.copy,
        remove_legacy=args.remove_legacy,
        out=args.out,
        rescan=args.rescan,
    )
    try:
        check_options(asked, args.root, FLAGS)
    except ReadOnlyStepError as e:  # --out with --in-place/--remove-legacy
        raise UsageError(str(e)) from e


def _target_for(args: argparse.Namespace) -> Target | None:
    """`_load_target`; a target that cannot be built is a usage error (exit 2)."""
    try:
        return _load_target(args)
    except (LayoutMismatchError, CheckpointReadError, ImportError, AttributeError) as e:
        raise UsageError(f"cannot build the target: {e}") from e


def _convert_target(args: argparse.Namespace) -> Target:
    if (target := _target_for(args)) is None:
        raise UsageError(
            "convert needs --target-from DIR, --target MODULE:FUNCTION or "
            "--maxtext-config CONFIG [KEY=VALUE ...]"
        )
    return target


def _skip_outside_links(
    args: argparse.Namespace, root: epath.Path, steps: list[StepInfo]
) -> tuple[list[StepReport], list[StepInfo]]:
    """The reports of steps that are links leading outside ROOT (skipped unless
    ``--follow-symlinks``), and the steps to convert."""
    reports, inside = [], []
    for info in steps:
        if args.follow_symlinks or not _outside(root, info.path):
            inside.append(info)
            continue
        note = (
            f"a link to {os.path.realpath(str(info.path))}, outside {root}: converted only "
            "with --follow-symlinks (then where it lives)"
        )
        reports.append(StepReport(str(info.path), "skipped", info.layout.value, notes=[note]))
        if not args.json and not args.quiet:
            print(f"{info.path}: skipped ({note})", flush=True)
    return reports, inside


def _plan_run(
    args: argparse.Namespace, target: Target, steps: list[StepInfo]
) -> list[renumbering.PlannedStep]:
    """The run plan: every step's conversion plan, then the renumbering moves, in the order
    the real run makes them; the dry run reports it, the real run makes the moves under each
    directory's lock (planning them again there) and converts each step where it lands."""
    moves = not args.keep_step_numbers and args.out is None

    def plan_of(step_dir: epath.Path) -> Plan:
        return plan_step(
            step_dir,
            target,
            optimizer=args.optimizer,
            ignore=args.ignore,
            scan=args.rescan,
            plain_scan=args.plain_scan,
        )

    placed = renumbering.plan_run(steps, plan_of, renumber=moves)
    if moves and not args.dry_run:
        placed = renumbering.apply_renumbering(placed, plan_of)
    return placed


def _convert_all(
    args: argparse.Namespace,
    target: Target,
    root: epath.Path,
    placed: list[renumbering.PlannedStep],
    reports: list[StepReport],
) -> list[tuple[StepInfo, Exception]]:
    """Converts each placed step, appending its report to ``reports`` (and printing it);
    returns the steps that failed, with their errors."""
    show = sys.stderr.isatty() and not args.json and not args.quiet and not args.dry_run
    bar = _progress(sum(p.plan.source_bytes() for p in placed if p.plan is not None), show)
    failures = []
    for p in placed:
        report, error = _convert_one(args, target, root, p)
        if error is not None:
            failures.append((p.info, error))
        reports.append(report)
        if bar is not None and p.plan is not None:
            bar.update(p.plan.source_bytes())
        if not args.json and not args.quiet:
            shown = args.verbose or report.status != "skipped"
            why = "; ".join(report.notes) or "nothing to do"
            print(report if shown else f"{report.step_dir}: skipped ({why})", flush=True)
    if bar is not None:
        bar.close()
    return failures


def _convert_one(
    args: argparse.Namespace, target: Target, root: epath.Path, p: renumbering.PlannedStep
) -> tuple[StepReport, Exception | None]:
    """One step's report, and its error if it failed (a refusal, or a failed write)."""
    renumber = not args.keep_step_numbers
    try:
        report = convert_placed(
            p,
            target,
            dry_run=args.dry_run,
            optimizer=args.optimizer,
            ignore=args.ignore,
            memory_budget=args.memory_budget,
            in_place=args.in_place,
            remove_legacy=args.remove_legacy,
            copy=args.copy,
            out=_dest(root, p.info, args.out, renumber=renumber),
            rescan=args.rescan,
            plain_scan=args.plain_scan,
            renumber=renumber and args.out is not None,
        )
    except (OrbaxMaxTextLayoutError, OSError) as e:
        report = StepReport(str(p.info.path), "failed", p.info.layout.value, notes=[str(e)])
        if isinstance(e, LoraAdapterStepError):
            report.lora = e.adapters.to_dict()
        return report, e
    return report, None


def _print_run_report(args: argparse.Namespace, reports: list[StepReport]) -> None:
    """``--json``: every report; else (unless ``--quiet``) a summary of the statuses."""
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    elif not args.quiet:
        counts: dict[str, int] = {}
        for r in reports:
            counts[r.status] = counts.get(r.status, 0) + 1
        print(
            "summary: "
            + (", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no steps found")
        )


def _print_failures(failures: list[tuple[StepInfo, Exception]]) -> None:
    print(f"{len(failures)} step(s) failed:", file=sys.stderr)
    for info, e in failures:
        first = str(e).splitlines()[0]
        print(f"  {info.path}: {type(e).__name__}: {first}", file=sys.stderr)


def _dest(
    root: epath.Path, info: StepInfo, out: str | None, *, renumber: bool
) -> epath.Path | None:
    """``<out>/<step relative to root>`` (``<out>`` itself when ROOT is a step); with
    ``renumber``, a Tunix step's directory takes MaxText's number."""
    if out is None:
        return None
    rel = os.path.relpath(str(info.path), str(root))
    dest = epath.Path(out) if rel == "." else epath.Path(out) / rel
    tunix_step = tunix_step_number(info.path) if info.layout is Layout.TUNIX else None
    if renumber and rel != "." and tunix_step is not None and tunix_step >= 1:
        dest = dest.parent / str(maxtext_number(tunix_step))
    return dest


def _outside(root: epath.Path, step: epath.Path) -> bool:
    """A step reached through a symbolic link that leads outside ROOT (local paths only)."""
    return store_for(root).is_outside(root, step)


def _no_steps_hint(root: epath.Path) -> int | None:
    """Exit code 1 with a hint when ROOT holds no steps but a directory below it does."""
    if find_steps(root):
        return None
    below = find_step_roots(root)
    if not below:
        return None
    print_error(
        f"no steps found in {root}; steps were found in "
        + ", ".join(str(d) for d in below)
        + ". Point the command at that directory."
    )
    return 1


def cmd_verify(args: argparse.Namespace) -> int:
    if (hint := _no_steps_hint(epath.Path(args.root))) is not None:
        return hint
    results = []
    for info in find_steps(epath.Path(args.root)):
        if info.layout is not Layout.MAXTEXT:
            continue
        # merge-lora's and a MaxText step's scan change's replay from the sources they record
        written = (converted_provenance(info.path) or {}).get("source_layout")
        if written in (SOURCE_LAYOUT, RESCANNED) or (info.path / "model_params").is_dir():
            results.append(verify_step(info.path, quick=args.quick))
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    else:
        for r in results:
            print(f"{r.step_dir}: {'ok' if r.ok else 'MISMATCH'} ({r.checked} leaves)")
            for p in r.problems:
                print(f"  {p}")
    if not results:
        # A check that checked nothing must not pass: CI scripts tell it from "all verified".
        print_error(
            f"nothing verified: {args.root} holds no converted step that still has its legacy "
            "items (model_params/ beside items/) and no step written by merge-lora or by a "
            "scan change of a MaxText step; steps "
            "converted --in-place or with --remove-legacy have nothing left to compare with."
        )
        return NOTHING_VERIFIED
    return 0 if all(r.ok for r in results) else 1


def cmd_inspect(args: argparse.Namespace) -> int:
    if (hint := _no_steps_hint(epath.Path(args.path))) is not None:
        return hint
    target = _load_target(args)
    out = []
    for info in find_steps(epath.Path(args.path)):
        entry = {
            "path": str(info.path),
            "step": info.step,
            "layout": info.layout.value,
            "role": info.role,
        }
        items = ["items"] if info.layout is Layout.MAXTEXT else ["model_params", "optimizer_state"]
        groups: dict[str, dict[str, int]] = {}
        specs = {}  # each item's metadata read once: for the groups, LoRA and the plan
        for item in items:
            if (info.path / item).is_dir():
                specs[item] = read_specs(info.path / item)
                for p, s in specs[item].items():
                    g = groups.setdefault(f"{item}/{p[0]}", {"leaves": 0, "bytes": 0})
                    g["leaves"] += 1
                    g["bytes"] += s.nbytes
        entry["groups"] = groups
        stored = specs.get("items") or specs.get(TUNIX_PARAMS_ITEM) or {}
        layers = rescan.stored_layers(stored)
        entry["scan"] = {"scanned": scanned_form(stored), "layers": layers.describe()}
        entry["converted_by"] = converted_provenance(info.path)
        lora = None
        if info.layout is Layout.TUNIX and TUNIX_PARAMS_ITEM in specs:
            custom = stepmeta.read(info.path).get("custom_metadata")
            params = specs[TUNIX_PARAMS_ITEM]
            lora = adapters_of(model_paths(params), params, custom)
        entry["lora"] = lora.to_dict() if lora is not None else None
        if target is not None and info.layout is Layout.TUNIX:
            try:
                plan = plan_step(info.path, target, specs=specs)
                entry["plan"] = convert_step(info.path, target, dry_run=True, plan=plan).to_dict()
            except LayoutMismatchError as e:
                entry["mismatch"] = [e.summary, *e.problems, *([e.hint] if e.hint else [])]
        out.append(entry)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for e in out:
        _print_inspected(e)
    return 0


def _print_inspected(e: dict) -> None:
    """`cmd_inspect`'s text for one step."""
    role = f" role={e['role']}" if e["role"] else ""
    conv = " (converted by orbax-maxtext-layout)" if e["converted_by"] else ""
    print(f"{e['path']}: step {e['step']} {e['layout']}{role}{conv}")
    for g, d in e["groups"].items():
        print(f"  {g:<40}{d['leaves']:>6} leaves{d['bytes']:>14,} bytes")
    form = {True: "scanned", False: "unscanned", None: "no layer groups"}
    print(f"  layers: {form[e['scan']['scanned']]}")
    for line in e["scan"]["layers"]:
        print(f"    {line}")
    if e["lora"]:
        lo = e["lora"]
        axis = "unscanned" if not lo["scanned"] else f"layer axis {lo['layer_axis']}"
        alpha = f", alpha {lo['alpha']:g}" if lo["alpha"] is not None else ", alpha not recorded"
        print(
            f"  LoRA adapters: rank {lo['rank']}{alpha}, {axis}, {lo['dtype']}, "
            f"{len(lo['modules'])} modules; holds no base weights (merge them with "
            "merge-lora, or resume with train_sft's lora.lora_restore_path)"
        )
        for m in lo["modules"]:
            print(f"    {m}")
    if "plan" in e:
        for dest, d in e["plan"]["destinations"].items():
            print(f"  -> {dest:<12}{d['leaves']:>6} leaves{d['bytes']:>14,} bytes")
    for line in e.get("mismatch", []):
        print(f"  mismatch: {line}")


def cmd_merge_lora(args: argparse.Namespace) -> int:
    target = _target_for(args)
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


def cmd_export_hf(args: argparse.Namespace) -> int:
    from ..hf.export_hf import export_hf

    report = export_hf(
        args.step,
        args.out,
        maxtext_config=args.maxtext_config,
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
    print(report.to_json() if args.json else report)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Copies the shipped example RL run to a temp dir and converts it."""
    out = Path(args.out or tempfile.mkdtemp(prefix="omtl-demo-"))
    run = out / "tunix_rl_run"
    shutil.copytree(EXAMPLES / "tunix_rl_run", run, dirs_exist_ok=True)
    target_dir = EXAMPLES / "maxtext_run" / "checkpoints" / "2"
    print(f"example Tunix RL run copied to {run}")
    print(f"target: MaxText checkpoint of the same model at {target_dir}\n")
    ns = build_parser().parse_args(
        ["convert", str(run / "checkpoints"), "--target-from", str(target_dir), "-v"]
    )
    return cmd_convert(ns)


_Subparsers = argparse._SubParsersAction  # the type of `add_subparsers`' result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbax-maxtext-layout", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in (
        _add_convert,
        _add_verify,
        _add_inspect,
        _add_merge_lora,
        _add_export_hf,
        _add_demo,
    ):
        add(sub)
    return p


def _add_target(sp: argparse.ArgumentParser) -> None:
    """``--target-from`` | ``--target`` | ``--maxtext-config`` (convert, inspect, merge-lora)."""
    g = sp.add_mutually_exclusive_group()
    g.add_argument(
        "--target-from", metavar="DIR", help="a MaxText-layout checkpoint of the same model"
    )
    g.add_argument(
        "--target",
        metavar="MODULE:FUNCTION",
        help="returns an abstract nnx.Module/State, a Target, or MaxText abstract items",
    )
    g.add_argument(
        "--maxtext-config",
        nargs="+",
        action=_MaxTextConfigValues,
        metavar=("CONFIG", "KEY=VALUE"),
        help="MaxText 0.2.5 builds the target from its config, given as its commands take "
        "it: the config file (e.g. .../maxtext/configs/base.yml), then KEY=VALUE overrides "
        "(metadata only; needs maxtext installed)",
    )


# The flag names the written form; the target names the model, in either form.
_FORM_NOTE = (
    "; the target (--target-from, --maxtext-config's scan_layers) may be in either form; a "
    "MaxText-layout step is written into --out"
)


def _add_scan_form(sp: argparse.ArgumentParser, *, target_note: bool) -> None:
    """``--unroll`` | ``--stack`` (convert, merge-lora); ``target_note``: the help says the
    target is given in the written form."""
    form = sp.add_mutually_exclusive_group()
    for flag, const, form_help, note in (
        ("--unroll", "unroll", "the unscanned form (layers_<i>)", _FORM_NOTE),
        ("--stack", "stack", "the scanned form (layers)", _FORM_NOTE),
    ):
        form.add_argument(
            flag,
            dest="rescan",
            action="store_const",
            const=const,
            help=f"write {form_help}" + (note if target_note else ""),
        )
    sp.add_argument(
        "--plain-scan",
        action="store_true",
        help="--stack onto an unscanned target with no scanned form at hand (no "
        "--maxtext-config, no scanned --target-from): the model is a plain scan (layers_<i> -> "
        "layers); refused without it, as a block-scanned model (gemma3, gpt-oss, llama4) "
        "would be written in a layout MaxText cannot read",
    )


def _add_memory_budget(sp: argparse.ArgumentParser, help_note: str = "") -> None:
    sp.add_argument(
        "--memory-budget",
        type=parse_size,
        default=DEFAULT_BUDGET,
        metavar="SIZE",
        help=f"bytes held at once, e.g. 2GiB{help_note}",
    )


def _add_json(sp: argparse.ArgumentParser, *, described: bool = True) -> None:
    help_text = "machine-readable report on stdout" if described else None
    sp.add_argument("--json", action="store_true", help=help_text)


def _add_convert(sub: _Subparsers) -> None:
    c = sub.add_parser(
        "convert",
        help="convert every Tunix-layout step under ROOT (with --unroll/--stack and --out, "
        "MaxText-layout steps too: into the other scan form)",
    )
    c.add_argument("root")
    _add_target(c)
    c.add_argument("--optimizer", choices=["convert", "drop"], default="convert")
    c.add_argument(
        "--dry-run", action="store_true", help="report only; reads metadata, writes nothing"
    )
    c.add_argument("--steps", help="e.g. 1,3,10-20")
    c.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="GLOB",
        help="drop model leaves matching GLOB as intermediates (repeatable)",
    )
    _add_memory_budget(c, " (peak is this plus the largest array)")
    _add_scan_form(c, target_note=True)
    _add_convert_destination(c)
    _add_json(c)
    c.add_argument("-q", "--quiet", action="store_true")
    c.add_argument("-v", "--verbose", action="store_true")
    c.set_defaults(fn=cmd_convert)


def _add_convert_destination(c: argparse.ArgumentParser) -> None:
    """Where convert writes, which steps it follows, and what it does to the source."""
    c.add_argument(
        "--out",
        metavar="DIR",
        help="write converted steps under DIR (same relative paths; DIR itself when ROOT is a "
        "step); the source is only read, so it may be read-only. Required for --unroll/--stack "
        "of a MaxText-layout step, which is never rewritten in place",
    )
    c.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="convert steps that are links leading outside ROOT, where they live "
        "(default: report and skip them)",
    )
    c.add_argument(
        "--keep-step-numbers",
        action="store_true",
        help="keep Tunix's directory numbers (N: the state after N updates) instead of "
        "MaxText's (N-1), e.g. for consumers that read Tunix's numbering",
    )
    c.add_argument(
        "--in-place",
        action="store_true",
        help="turn the legacy items into items/ without rewriting array bytes (shared data "
        "files), then delete the legacy items once items/ verifies",
    )
    c.add_argument(
        "--copy",
        action="store_true",
        help="write private copies of the data files (a second physical copy); by default "
        "items/ shares them with the legacy items: reflinks where the file system supports "
        "them, else hard links, else (per file, e.g. across file systems) copies",
    )
    c.add_argument(
        "--remove-legacy",
        action="store_true",
        help="delete model_params/optimizer_state once items/ verifies",
    )


def _add_verify(sub: _Subparsers) -> None:
    v = sub.add_parser("verify", help="check converted steps against their legacy items")
    v.add_argument("root")
    v.add_argument("--quick", action="store_true", help="compare metadata only")
    _add_json(v, described=False)
    v.set_defaults(fn=cmd_verify)


def _add_inspect(sub: _Subparsers) -> None:
    i = sub.add_parser("inspect", help="show layout, role and tree summary (metadata only)")
    i.add_argument("path")
    _add_target(i)
    _add_json(i, described=False)
    i.set_defaults(fn=cmd_inspect)


def _add_merge_lora(sub: _Subparsers) -> None:
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
    _add_target(m)
    _add_scan_form(m, target_note=False)
    m.add_argument(
        "--scan-axis",
        type=int,
        choices=[0, 1],
        help="the model's param_scan_axis, only where the shapes fit both",
    )
    _add_memory_budget(m)
    m.add_argument("--dry-run", action="store_true", help="report only; reads metadata")
    _add_json(m)
    m.set_defaults(fn=cmd_merge_lora)


def _add_export_hf(sub: _Subparsers) -> None:
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
    _add_memory_budget(e)
    e.add_argument(
        "--max-shard-size",
        type=parse_size,
        metavar="SIZE",
        help="split the weights into files of at most SIZE (default 3GiB, as MaxText)",
    )
    e.add_argument("--process-index", type=int, help="this process (several-process export)")
    e.add_argument("--process-count", type=int, help="how many processes share the export")
    e.add_argument(
        "--maxtext-config",
        nargs="+",
        required=True,
        action=_MaxTextConfigValues,
        metavar=("CONFIG", "KEY=VALUE"),
        help="the model's MaxText config: the config file, then KEY=VALUE overrides",
    )
    e.add_argument("--dry-run", action="store_true", help="report only; reads metadata")
    _add_json(e)
    e.set_defaults(fn=cmd_export_hf)


def _add_demo(sub: _Subparsers) -> None:
    d = sub.add_parser(
        "demo", help="convert the shipped example into a temp dir and print the report"
    )
    d.add_argument("--out", help="directory to copy the example into (default: a new temp dir)")
    d.set_defaults(fn=cmd_demo)


def _positionals_first(argv: Sequence[str]) -> list[str]:
    """Moves positional arguments given after ``--maxtext-config``'s values in front of it.

    argparse's ``nargs="+"`` would take them as the option's values, and then miss them. The
    values are the config file, then KEY=VALUE overrides (MaxText's own arguments): any other
    value that follows, up to the next option, is a positional argument (a path with ``=`` in
    it must be given before the option).
    """
    out = list(argv)
    end = out.index("--") if "--" in out else len(out)
    if "--maxtext-config" not in out[:end]:
        return out
    i = out.index("--maxtext-config")
    j = i + 2  # past the option and its config file
    values, moved = [], []
    while j < end and not out[j].startswith("-"):
        (values if "=" in out[j] else moved).append(out[j])
        j += 1
    return out[:i] + moved + out[i : i + 2] + values + out[j:]


def _on_cpu() -> None:
    """Every command runs on JAX's CPU backend unless the user set ``JAX_PLATFORMS``: none
    needs an accelerator, and this host's may be held by a trainer (a second process that
    opens a TPU fails on libtpu's lockfile). Fresh RNG keys (`jax.random.key`) and
    MaxText's model (`--maxtext-config`) would otherwise start the default backend."""
    if not os.environ.get("JAX_PLATFORMS"):
        import jax

        jax.config.update("jax_platforms", "cpu")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(_positionals_first(argv))
    _on_cpu()
    try:
        return args.fn(args)
    except UsageError as e:
        print_error(e)
        return 2
    except OrbaxMaxTextLayoutError as e:
        print_error(e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
