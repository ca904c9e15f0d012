"""What a step written by this library records of how it was written (its provenance):
one builder for every writer, so `verify` can replay any of them.

The record sits in the step's custom metadata under `stepmeta.PROVENANCE_KEY`; the writer
adds what it measured (bytes written, how the data files were placed).
"""

from __future__ import annotations

from typing import Any

from ._version import __version__
from .moves import Plan
from .paths import keystr


def record(plan: Plan, source_layout: str, **details: Any) -> dict[str, Any]:
    """The provenance of a step written from ``plan`` out of a ``source_layout`` step:
    the converter's version, the rules applied, every dropped leaf with its reason, and
    the writer's own ``details`` (what its replay needs)."""
    return {
        "source_layout": source_layout,
        "converter_version": __version__,
        "rules": list(plan.rules),
        **details,
        "dropped": [{"path": f"{d.item}/{keystr(d.src)}", "reason": d.reason} for d in plan.drops],
    }
