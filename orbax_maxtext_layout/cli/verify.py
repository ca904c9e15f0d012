"""``verify``: replays each converted step's plan against the sources it was written from (a
converted step's legacy items, merge-lora's and a scan change's recorded sources)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from etils import epath

from ..errors import print_error
from ..execute.convert import converted_provenance
from ..execute.verify import RESCANNED, verify_step
from ..lora.merge_plan import SOURCE_LAYOUT
from ..orbax_io.layout import Layout
from ..plan.steps import find_steps
from .common import Subparsers, add_json, no_steps_hint

# `verify`'s exit code when it found nothing to verify (0: all verified, 1: a mismatch or an
# error, 2: a usage error).
NOTHING_VERIFIED = 3


def cmd_verify(args: argparse.Namespace) -> int:
    if (hint := no_steps_hint(epath.Path(args.root))) is not None:
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


def add_verify(sub: Subparsers) -> None:
    v = sub.add_parser("verify", help="check converted steps against their legacy items")
    v.add_argument("root")
    v.add_argument("--quick", action="store_true", help="compare metadata only")
    add_json(v, described=False)
    v.set_defaults(fn=cmd_verify)
