"""What a step written by this library records of how it was written (its provenance):
one builder for every writer, so `verify` can replay any of them.

The record sits in the step's custom metadata under `stepmeta.PROVENANCE_KEY`; the writer
adds what it measured (bytes written, how the data files were placed).
"""

from __future__ import annotations

from typing import Any

from .._version import __version__
from ..base.treepaths import keystr
from ..model.layermap import scanned_form
from .moves import Plan

SCAN_LAYERS_KEY = "scan_layers"  # MaxText's own key in the step's custom metadata


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


def scan_layers(plan: Plan) -> bool | None:
    """The scan form ``plan`` writes, as MaxText's ``save_checkpoint`` records it
    (``custom_metadata["scan_layers"]``): True if its params hold a scanned layer group
    (``layers/...``, gemma3's ``layers/layers_<k>/...``), False if they hold unrolled layers
    (``layers_0/...`` or a list ``layers/0/...``), None for a model without layer groups
    (nothing to record): `layermap.scanned_form`.

    MaxText's readers of the key (`verify_and_sync_scan_layers`: ``to_huggingface``,
    ``from_pretrained``, the serving engine) take the saved form when the user does not
    set ``scan_layers``, and refuse a mismatch when they do."""
    return scanned_form(m.dst for m in plan.moves if m.dst[:1] == ("params",))
