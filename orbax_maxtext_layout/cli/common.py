"""What several commands share: the target (``--target-from`` | ``--target`` |
``--maxtext-config``), sizes (`parse_size`), the hint for a ROOT that holds no steps, the
option adders (scan form, memory budget, ``--json``), and the argument handling `main` does
before any command runs (`positionals_first`, `on_cpu`, `owned_process`)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
from collections.abc import Iterator, Sequence

from etils import epath

from ..base.gcfreeze import frozen_heap
from ..errors import CheckpointReadError, LayoutMismatchError, UsageError, print_error
from ..model.target import Target
from ..plan import rescan
from ..plan.steps import find_step_roots, find_steps
from ..storage import scratch
from ..storage.memory import DEFAULT_BUDGET

Subparsers = argparse._SubParsersAction  # the type of `add_subparsers`' result


def load_target(args: argparse.Namespace) -> Target | None:
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


def target_for(args: argparse.Namespace) -> Target | None:
    """`load_target`; a target that cannot be built is a usage error (exit 2)."""
    try:
        return load_target(args)
    except (LayoutMismatchError, CheckpointReadError, ImportError, AttributeError) as e:
        raise UsageError(f"cannot build the target: {e}") from e


class MaxTextConfigValues(argparse.Action):
    """``--maxtext-config CONFIG [KEY=VALUE ...]``: refuses a value that is neither (positional
    arguments after its values are moved in front of it first, by `positionals_first`)."""

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


def no_steps_hint(root: epath.Path) -> int | None:
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


def add_target(sp: argparse.ArgumentParser) -> None:
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
        action=MaxTextConfigValues,
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


def add_scan_form(sp: argparse.ArgumentParser, *, target_note: bool) -> None:
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


def add_memory_budget(sp: argparse.ArgumentParser, help_note: str = "") -> None:
    sp.add_argument(
        "--memory-budget",
        type=parse_size,
        default=DEFAULT_BUDGET,
        metavar="SIZE",
        help=f"bytes held at once, e.g. 2GiB{help_note}",
    )


def add_json(sp: argparse.ArgumentParser, *, described: bool = True) -> None:
    help_text = "machine-readable report on stdout" if described else None
    sp.add_argument("--json", action="store_true", help=help_text)


def positionals_first(argv: Sequence[str]) -> list[str]:
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


@contextlib.contextmanager
def owned_process() -> Iterator[None]:
    """What a command, which owns its process, tunes in it; never a library call (a guest in
    a trainer's process changes none of its settings, issue 57).

    - The allocator: glibc's mmap threshold fixed, NumPy's huge pages off
      (`scratch.tune_for_command`: a copy's RSS within its budget, fresh pages cheap).
    - BLAS runs on one thread: merge-lora's and export-hf's workers run one matmul each, a
      worker a core, and BLAS's own threads would spin against them (a fifth of the CPU
      time, measured). OpenBLAS's count is the process's (its per-thread setter sets the
      global count too, in NumPy's build), so a library call leaves it alone.
    - The objects alive when the command starts (MaxText's, JAX's) are frozen while it runs
      (`gcfreeze.frozen_heap`): an operation over many leaves triggers full collections,
      each of which would walk them all.
    """
    from threadpoolctl import threadpool_limits  # sets KMP_DUPLICATE_LIB_OK on import

    scratch.tune_for_command()
    with threadpool_limits(1, user_api="blas"), frozen_heap():
        yield


def on_cpu() -> None:
    """Every command runs on JAX's CPU backend unless the user set ``JAX_PLATFORMS``: none
    needs an accelerator, and this host's may be held by a trainer (a second process that
    opens a TPU fails on libtpu's lockfile). Fresh RNG keys (`jax.random.key`) and
    MaxText's model (`--maxtext-config`) would otherwise start the default backend."""
    if not os.environ.get("JAX_PLATFORMS"):
        import jax

        jax.config.update("jax_platforms", "cpu")


def add_model_config(sp: argparse.ArgumentParser, note: str = "") -> None:
    """The required ``--maxtext-config`` of the Hugging Face commands, then ``--dry-run`` and
    ``--json`` (export-hf, import-hf)."""
    sp.add_argument(
        "--maxtext-config",
        nargs="+",
        required=True,
        action=MaxTextConfigValues,
        metavar=("CONFIG", "KEY=VALUE"),
        help=f"the model's MaxText config: the config file, then KEY=VALUE overrides{note}",
    )
    sp.add_argument("--dry-run", action="store_true", help="report only; reads metadata")
    add_json(sp)
