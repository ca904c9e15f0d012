"""``convert``: every Tunix-layout step under ROOT into MaxText's layout (with
``--unroll``/``--stack`` and ``--out``, MaxText-layout steps too, into the other scan form).
Checks the options, plans the run (renumbering included), converts each step, reports."""

from __future__ import annotations

import argparse
import json
import os
import sys

from etils import epath

from ..errors import OrbaxMaxTextLayoutError, ReadOnlyStepError, UsageError, detached
from ..execute.convert import StepReport, check_rescan_destination, convert_placed
from ..execute.options import FLAGS, ConvertOptions
from ..execute.options import check as check_options
from ..model.layermap import scanned_form
from ..model.lora import LoraAdapterStepError
from ..model.target import Target
from ..orbax_io.layout import Layout, maxtext_number, tunix_step_number
from ..orbax_io.spec import read_specs
from ..plan import renumbering, rescan
from ..plan.moves import Plan
from ..plan.step_plan import plan_step
from ..plan.steps import StepInfo, find_steps
from ..storage.store import StepStore, store_for
from .common import (
    Subparsers,
    add_json,
    add_memory_budget,
    add_scan_form,
    add_target,
    no_steps_hint,
    target_for,
)


def cmd_convert(args: argparse.Namespace) -> int:
    """``convert``: checks the options, plans the run, converts each step, reports."""
    _check_convert_options(args)
    target = _convert_target(args)
    wanted = _parse_steps(args.steps)
    root = epath.Path(args.root)
    if (hint := no_steps_hint(root)) is not None:
        return hint
    steps = [s for s in find_steps(root) if wanted is None or s.step in wanted]
    if args.rescan == "stack" and any(_unscanned(s) for s in steps):
        # a usage error (exit 2), before any step is planned or moved; a step in the other
        # form is refused by its own plan ("the scan form differs")
        rescan.check_plain_stack(target, plain_scan=args.plain_scan, where=args.root)
    if args.rescan is not None:  # a usage error (exit 2), before any step is written
        check_rescan_destination([s.path for s in steps], args.out, FLAGS)
    store = store_for(root)  # decided once for ROOT, handed down
    reports, inside = _skip_outside_links(args, root, steps, store=store)
    planned = _plan_run(args, target, inside, store=store)
    failures = _convert_all(args, target, root, planned, reports)
    _print_run_report(args, reports)
    if failures:
        _print_failures(failures)
        return 1
    return 0


def _parse_steps(text: str | None) -> set[int] | None:
    if not text:
        return None
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="converting", file=sys.stderr)


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


def _convert_target(args: argparse.Namespace) -> Target:
    if (target := target_for(args)) is None:
        raise UsageError(
            "convert needs --target-from DIR, --target MODULE:FUNCTION or "
            "--maxtext-config CONFIG [KEY=VALUE ...]"
        )
    return target


def _skip_outside_links(
    args: argparse.Namespace, root: epath.Path, steps: list[StepInfo], *, store: StepStore
) -> tuple[list[StepReport], list[StepInfo]]:
    """The reports of steps that are links leading outside ROOT (skipped unless
    ``--follow-symlinks``), and the steps to convert."""
    reports, inside = [], []
    for info in steps:
        if args.follow_symlinks or not store.is_outside(root, info.path):
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
    args: argparse.Namespace, target: Target, steps: list[StepInfo], *, store: StepStore
) -> list[renumbering.PlannedStep]:
    """The run plan: every step's conversion plan, then the renumbering moves, in the order
    the real run makes them; the dry run reports it, the real run makes the moves under each
    directory's lock (planning them again there) and converts each step where it lands.
    ``store``: ROOT's."""
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

    placed = renumbering.plan_run(steps, plan_of, store=store, renumber=moves)
    if moves and not args.dry_run:
        placed = renumbering.apply_renumbering(placed, plan_of, store=store)
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
        options = ConvertOptions(
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
        report = convert_placed(p, target, options)
    except (OrbaxMaxTextLayoutError, OSError) as e:
        report = StepReport(str(p.info.path), "failed", p.info.layout.value, notes=[str(e)])
        if isinstance(e, LoraAdapterStepError):
            report.lora = e.adapters.to_dict()
        return report, detached(e)
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


def add_convert(sub: Subparsers) -> None:
    c = sub.add_parser(
        "convert",
        help="convert every Tunix-layout step under ROOT (with --unroll/--stack and --out, "
        "MaxText-layout steps too: into the other scan form)",
    )
    c.add_argument("root")
    add_target(c)
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
    add_memory_budget(c, " (peak is this plus the largest array)")
    add_scan_form(c, target_note=True)
    _add_convert_destination(c)
    add_json(c)
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
