"""``demo``: the shipped example RL run, copied to a temp dir and converted (`cmd_convert`)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from .._version import EXAMPLES_DIR as EXAMPLES
from .common import Subparsers
from .convert import add_convert, cmd_convert


def cmd_demo(args: argparse.Namespace) -> int:
    """Copies the shipped example RL run to a temp dir and converts it."""
    out = Path(args.out or tempfile.mkdtemp(prefix="omtl-demo-"))
    run = out / "tunix_rl_run"
    shutil.copytree(EXAMPLES / "tunix_rl_run", run, dirs_exist_ok=True)
    target_dir = EXAMPLES / "maxtext_run" / "checkpoints" / "2"
    print(f"example Tunix RL run copied to {run}")
    print(f"target: MaxText checkpoint of the same model at {target_dir}\n")
    ns = _convert_args(
        ["convert", str(run / "checkpoints"), "--target-from", str(target_dir), "-v"]
    )
    return cmd_convert(ns)


def _convert_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed as `build_parser`'s parser parses it (its ``convert`` command alone:
    `build_parser` sits above this module)."""
    p = argparse.ArgumentParser(prog="orbax-maxtext-layout")
    add_convert(p.add_subparsers(dest="cmd", required=True))
    return p.parse_args(argv)


def add_demo(sub: Subparsers) -> None:
    d = sub.add_parser(
        "demo", help="convert the shipped example into a temp dir and print the report"
    )
    d.add_argument("--out", help="directory to copy the example into (default: a new temp dir)")
    d.set_defaults(fn=cmd_demo)
