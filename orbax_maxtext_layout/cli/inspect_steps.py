"""``inspect``: each step's layout, role, tree summary, scan form and LoRA adapters, and with
a target its conversion plan (metadata only)."""

from __future__ import annotations

import argparse
import json

from etils import epath

from ..errors import LayoutMismatchError
from ..execute.convert import convert_step, converted_provenance
from ..model.layermap import scanned_form
from ..model.lora import adapters_of, model_paths
from ..orbax_io import stepmeta
from ..orbax_io.layout import TUNIX_PARAMS_ITEM, Layout
from ..orbax_io.spec import read_specs
from ..plan import rescan
from ..plan.step_plan import plan_step
from ..plan.steps import find_steps
from .common import Subparsers, add_json, add_target, load_target, no_steps_hint


def cmd_inspect(args: argparse.Namespace) -> int:
    if (hint := no_steps_hint(epath.Path(args.path))) is not None:
        return hint
    target = load_target(args)
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


def add_inspect(sub: Subparsers) -> None:
    i = sub.add_parser("inspect", help="show layout, role and tree summary (metadata only)")
    i.add_argument("path")
    add_target(i)
    add_json(i, described=False)
    i.set_defaults(fn=cmd_inspect)
