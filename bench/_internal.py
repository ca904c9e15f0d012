"""The package internals the bench needs, in one place (issue 59: a bench that cannot rot).

The bench uses the public API (``import orbax_maxtext_layout as oml``,
`orbax_maxtext_layout.training`) wherever one exists. What it measures sometimes lies below it:
the readers' counters, the chunk reader a floor decodes with, MaxText's abstract model, the
functions a profile wraps in timers. Each such need is one accessor here, with why, and no bench script imports
``orbax_maxtext_layout.<room>...`` itself (tests/test_bench.py checks that), so a module moved
or renamed in the package breaks this file, by name:

- ``tests/test_bench.py`` calls `check` (every module of `SURFACE` imported, each name looked
  up): the core suite fails;
- ``bench/smoke.py`` runs ``python bench/_internal.py`` (the same check) beside every script.

Each accessor imports when called, not when this module is imported: a child that runs
another checkout's package (``--before DIR``) imports only what it uses, and a script's
orchestrator stays light (a child's ru_maxrss starts from its parent's high-water mark).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def parse_size(text: str) -> int:
    """``512MiB`` -> bytes, with the CLI's own parser: the bench's size options read exactly
    as the CLI's ``--memory-budget`` does."""
    from orbax_maxtext_layout.cli import parse_size as parse

    return parse(text)


def run_cli(argv: Sequence[str]) -> int:
    """The CLI in this process (``python -m orbax_maxtext_layout`` without a new interpreter):
    `bench/walk.py` profiles the calls it makes, `bench/leaves.py` times ``inspect`` alone."""
    from orbax_maxtext_layout.cli import main

    return main(list(argv))


def load_cli() -> None:
    """Imports what the CLI imports, and runs nothing: `bench/realsize.py`'s ``baseline``
    (what every operation spends before its work)."""
    import orbax_maxtext_layout.cli  # noqa: F401


def abstract_items(argv: Sequence[str]) -> dict:
    """MaxText's own abstract train state for ``<base.yml> KEY=VALUE...`` (the tree and shapes
    a bench step is built with; the public `Target.from_maxtext_config` keeps only what it
    classifies, not the abstract arrays)."""
    from orbax_maxtext_layout.model.maxtext_config import abstract_items as items

    return items(list(argv))


def abstract_model(argv: Sequence[str]) -> tuple[dict, dict]:
    """``(abstract items, layer axes)`` of MaxText's model for ``<base.yml> KEY=VALUE...``:
    `bench/realsize_build.py` draws each param's values per fsdp piece on its non-layer axis."""
    from orbax_maxtext_layout.model.maxtext_config import abstract_model as model

    return model(list(argv))


def small_pages(nbytes: int) -> Any:
    """A fresh buffer of ``nbytes`` in small pages, as the restore engine decodes into
    (`bench/restore.py`'s ``floor decode`` must allocate as the engine does)."""
    from orbax_maxtext_layout.storage.scratch import small_pages as alloc

    return alloc(nbytes)


def io_counts() -> contextlib.AbstractContextManager:
    """The readers' counters (listings, metadata reads, chunks decoded per database):
    `bench/leaves.py` reports them per operation. A package without them (an older
    ``--before`` checkout) counts nothing."""
    try:
        from orbax_maxtext_layout.orbax_io.orbax_files import io_counts as counts
    except ImportError:
        return contextlib.nullcontext()
    return counts()


def chunk_reader() -> tuple[Callable[[], Any], Callable[[Any], Any], Any]:
    """``(ts_context, keys_by_array, ItemReader)``: the package's own chunk reader, with which
    `bench/floor.py` decodes every stored chunk once (the floor of the streaming operations
    is what their reader spends)."""
    from orbax_maxtext_layout.orbax_io import item_writer, ocdbt
    from orbax_maxtext_layout.orbax_io.reader import ItemReader

    return item_writer.ts_context, ocdbt.keys_by_array, ItemReader


def hf_dir() -> tuple[Any, type[Exception]]:
    """``(HfDir, HfInputError)``: the safetensors reader whose header check
    `bench/hf_headers.py` times (no public entry opens a directory without importing it)."""
    from orbax_maxtext_layout.formats.safetensors_reader import HfDir, HfInputError

    return HfDir, HfInputError


def import_hf_rooms() -> dict[str, ModuleType]:
    """The modules `bench/import_hf.py phases` wraps in timers (``import_hf``, ``hf_mapping``,
    ``safetensors_in``, ``stepdir``): where an import's time goes, phase by phase. Its
    ``CHUNK_BYTES`` is also the piece size of that bench's floor."""
    from orbax_maxtext_layout.formats import safetensors_reader as safetensors_in
    from orbax_maxtext_layout.hf import import_hf as ih
    from orbax_maxtext_layout.model import hf_mapping
    from orbax_maxtext_layout.orbax_io import stepdir

    return {"import_hf": ih, "hf_mapping": hf_mapping, "safetensors_in": safetensors_in,
            "stepdir": stepdir}  # fmt: skip


# What the accessors above import: module -> names. `check` imports each and looks each name up
# (strictly: `io_counts` tolerates its absence at run time, the check does not). Keep it in step
# with the accessors (tests/test_bench.py compares the two).
SURFACE: dict[str, tuple[str, ...]] = {
    "orbax_maxtext_layout.cli": ("main", "parse_size"),
    "orbax_maxtext_layout.model.maxtext_config": ("abstract_items", "abstract_model"),
    "orbax_maxtext_layout.storage.scratch": ("small_pages",),
    "orbax_maxtext_layout.orbax_io.orbax_files": ("io_counts",),
    "orbax_maxtext_layout.orbax_io.item_writer": ("ts_context",),
    "orbax_maxtext_layout.orbax_io.ocdbt": ("keys_by_array",),
    "orbax_maxtext_layout.orbax_io.reader": ("ItemReader",),
    "orbax_maxtext_layout.formats.safetensors_reader": ("HfDir", "HfInputError"),
    "orbax_maxtext_layout.model.hf_mapping": ("load_config", "load_import"),
    # bench/import_hf.py phases wraps these (private ones too: it times the import's phases)
    "orbax_maxtext_layout.hf.import_hf": (
        "CHUNK_BYTES",
        "import_hf",
        "plan_import",
        "_run_slices",
        "_slice",
        "_write_slice",
        "_copy",
        "cast",
        "Gate",
        "orbax_files",
        "item_writer",
        "stepdir",
    ),
    "orbax_maxtext_layout.orbax_io.stepdir": ("commit", "publish_step"),
}


def check() -> list[str]:
    """Imports every module of `SURFACE` and looks up each of its names; returns what failed
    (``module.name: error``), empty if nothing did."""
    import importlib

    failed = []
    for module, names in SURFACE.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            failed.append(f"{module}: {type(e).__name__}: {e}")
            continue
        failed += [f"{module}.{n}: missing" for n in names if not hasattr(mod, n)]
    return failed


if __name__ == "__main__":
    import sys

    problems = check()
    print("\n".join(problems) or f"bench/_internal.py: {len(SURFACE)} modules, every name found")
    sys.exit(1 if problems else 0)
