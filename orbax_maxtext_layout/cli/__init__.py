"""Command line: ``orbax-maxtext-layout {demo,inspect,convert,verify,merge-lora,export-hf,import-hf}``.

A thin layer over `find_steps`, `plan_step`, `convert_step`, `merge_lora`, `export_hf` and
`import_hf`.
Exit codes: 0 all steps converted or skipped, 1 a step failed, 2 usage error (`verify`: 3
when nothing was verified).

One module per command, each holding its ``cmd_*`` and its parser (``add_*``): `convert`,
`verify`, `inspect_steps`, `merge_lora`, `export_hf`, `import_hf`, `demo`; `common` holds what several
share (the target options, sizes, the option adders, the CPU backend).

Imports: every folder below it (the top of the house, docs/design.md); nothing imports it
but `__main__`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..base.gcfreeze import freeze_for_exit
from ..errors import OrbaxMaxTextLayoutError, UsageError, print_error
from .common import on_cpu, owned_process, parse_size, positionals_first
from .convert import add_convert
from .demo import add_demo
from .export_hf import add_export_hf
from .import_hf import add_import_hf
from .inspect_steps import add_inspect
from .merge_lora import add_merge_lora
from .verify import NOTHING_VERIFIED, add_verify

__all__ = ["NOTHING_VERIFIED", "build_parser", "main", "parse_size", "run"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbax-maxtext-layout", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in (
        add_convert,
        add_verify,
        add_inspect,
        add_merge_lora,
        add_export_hf,
        add_import_hf,
        add_demo,
    ):
        add(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(positionals_first(argv))
    on_cpu()
    try:
        with owned_process():
            return args.fn(args)
    except UsageError as e:
        print_error(e)
        return 2
    except OrbaxMaxTextLayoutError as e:
        print_error(e)
        return 1


def run() -> int:
    """The console script and ``python -m orbax_maxtext_layout``: `main` on ``sys.argv``, its
    exit code returned for the process to exit with, the heap frozen first (`freeze_for_exit`:
    the exit after a command that loaded MaxText is 1.2 s shorter)."""
    rc = main()
    freeze_for_exit()
    return rc


if __name__ == "__main__":
    sys.exit(run())
