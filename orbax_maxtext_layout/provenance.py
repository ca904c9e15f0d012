"""What a step written by this library records of how it was written (its provenance):
one builder for every writer, so `verify` can replay any of them.

The record sits in the step's custom metadata under `stepmeta.PROVENANCE_KEY`; the writer
adds what it measured (bytes written, how the data files were placed).
"""

from __future__ import annotations

from typing import Any

from ._version import __version__
from .moves import Plan
from .scan import SCAN_GROUPS
from .treepaths import keystr

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
    (``custom_metadata["scan_layers"]``): True if its params hold a stacked layer group
    (``layers/...``), False if they hold unrolled layers (``layers_0/...`` or a list
    ``layers/0/...``), None for a model without layer groups (nothing to record).

    MaxText's readers of the key (`verify_and_sync_scan_layers`: ``to_huggingface``,
    ``from_pretrained``, the serving engine) take the saved form when the user does not
    set ``scan_layers``, and refuse a mismatch when they do."""
    found: set[bool] = set()
    for m in plan.moves:
        keys = [str(k) for k in m.dst]
        if not keys or keys[0] != "params":
            continue
        for k, nxt in zip(keys, [*keys[1:], ""], strict=True):
            if k in SCAN_GROUPS:
                found.add(not nxt.isdigit())
            elif k.rpartition("_")[0] in SCAN_GROUPS and k.rpartition("_")[2].isdigit():
                found.add(False)
    return True if True in found else (False if found else None)
