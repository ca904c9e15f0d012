"""A step's ``_CHECKPOINT_METADATA``: the one reader and writer of it and of what this
library records in it (provenance, a moved step's update count, ``scan_layers``).

Reads go through one record per step, kept while the file is unchanged: a read first asks
the store for the file's version (a ``stat`` on a disk, the object's generation on an
object store) and reads the file only when that version is new. So an operation that
looks at a step's metadata from several places (detection, numbering, the plan, the
commit, the legacy removal) reads it once, and a change made by another process is
still seen. Writes replace the file atomically (`store.StepStore.replace_file`) and
keep what they wrote as the record.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable, Hashable
from typing import Any

from etils import epath

from ..errors import CheckpointReadError
from ..storage.store import StepStore, store_for
from .orbax_files import count, parse_json, read_limited

STEP_METADATA = "_CHECKPOINT_METADATA"
# The most a step's metadata file may hold (issue 46: checkpoints are untrusted input). Orbax
# writes a few KB (handlers, metrics, custom metadata); a larger file is refused before it is
# read, not parsed (a 200 MB one cost 2 GB and 20 s to parse).
STEP_METADATA_LIMIT = 64 << 20
PROVENANCE_KEY = "orbax_maxtext_layout"  # our key in the step's custom metadata
# Recorded in a moved legacy step's custom metadata: the Tunix step (update count) it holds.
TUNIX_STEP_KEY = "orbax_maxtext_layout.tunix_step"

_KEEP = 4096  # records kept (a few KB each): a long-lived manager must not grow without end
_records: collections.OrderedDict[str, tuple[Hashable, dict]] = collections.OrderedDict()
_guard = threading.Lock()


def _remember(f: epath.Path, version: Hashable | None, data: dict) -> None:
    with _guard:
        _records[str(f)] = (version, data)
        _records.move_to_end(str(f))
        while len(_records) > _KEEP:
            _records.popitem(last=False)


def read(step_dir: epath.PathLike, *, store: StepStore | None = None) -> dict[str, Any]:
    """The step's ``_CHECKPOINT_METADATA`` JSON (a fresh copy to edit), ``{}`` if it has none.

    Read from storage only when the file changed since this process last read or wrote it
    (each such read is counted by `orbax_files.io_counts` as ``("step metadata", step)``).
    ``store``: the root's, as the caller decided it (else decided here, for a reader that
    holds none).
    """
    f = epath.Path(step_dir) / STEP_METADATA
    store = store or store_for(f)
    version = store.version(f)
    if version is None:
        return {}
    with _guard:
        known = _records.get(str(f))
    if known is not None and known[0] == version:
        return json.loads(json.dumps(known[1]))
    count("step metadata", str(step_dir))
    try:
        raw = read_limited(f, STEP_METADATA_LIMIT, "step metadata file", store=store)
    except FileNotFoundError as e:  # gone since the check: moved or removed meanwhile
        raise CheckpointReadError(
            f"{f}: disappeared while being read (another process moved or removed the step?)."
            " Run again."
        ) from e
    try:
        data = parse_json(raw, f, "JSON")
    except CheckpointReadError as e:
        raise CheckpointReadError(
            f"{e} Fix or remove the file; the arrays are not affected."
        ) from e.__cause__
    if not isinstance(data, dict):
        raise CheckpointReadError(f"{f}: expected a JSON object, got {type(data).__name__}.")
    _remember(f, version, data)
    return json.loads(json.dumps(data))


def write(step_dir: epath.PathLike, meta: dict[str, Any], *, store: StepStore) -> None:
    """Replaces the step's ``_CHECKPOINT_METADATA`` with ``meta``, atomically (``store``: the
    root's)."""
    f = epath.Path(step_dir) / STEP_METADATA
    store.replace_file(f, json.dumps(meta))
    _remember(f, store.version(f), json.loads(json.dumps(meta)))


def update(step_dir: epath.PathLike, change: Callable[[dict], dict], *, store: StepStore) -> None:
    """Replaces the step's metadata with ``change(current)``, atomically."""
    write(step_dir, change(read(step_dir, store=store)), store=store)


def restore(step_dir: epath.PathLike, old: dict[str, Any], *, store: StepStore) -> None:
    """Puts back ``old`` (as `read` returned it: ``{}`` for none) after a failed commit."""
    if old:
        write(step_dir, old, store=store)
    else:
        f = epath.Path(step_dir) / STEP_METADATA
        store.remove(f)


def moved(src: epath.PathLike, dst: epath.PathLike, *, store: StepStore) -> None:
    """The step directory ``src`` now lives at ``dst`` (renumbered by this process): its
    record follows it, so the metadata is not read again there."""
    f, g = epath.Path(src) / STEP_METADATA, epath.Path(dst) / STEP_METADATA
    with _guard:
        known = _records.pop(str(f), None)
    if known is not None:
        _remember(g, store.version(g), known[1])


# -- what the record holds --------------------------------------------------------------
def custom(meta: dict[str, Any]) -> dict[str, Any]:
    """The step's custom metadata (``{}`` if none)."""
    return dict(meta.get("custom_metadata") or {})


def provenance(meta: dict[str, Any]) -> dict[str, Any] | None:
    """What this library recorded when it wrote the step, or None for a native step."""
    return custom(meta).get(PROVENANCE_KEY)


def read_provenance(step_dir: epath.PathLike) -> dict[str, Any] | None:
    """`provenance` of the step at ``step_dir``."""
    return provenance(read(step_dir))


def recorded_tunix_step(meta: dict[str, Any]) -> int | None:
    """The update count recorded when the step was moved to MaxText's number, if any."""
    recorded = custom(meta).get(TUNIX_STEP_KEY)
    return recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else None


def with_custom(meta: dict[str, Any], **entries: Any) -> dict[str, Any]:
    """``meta`` with ``entries`` set in its custom metadata."""
    return {**meta, "custom_metadata": {**custom(meta), **entries}}


def with_tunix_step(meta: dict[str, Any], tunix_step: int) -> dict[str, Any]:
    """``meta`` recording `TUNIX_STEP_KEY` (for a step moved to MaxText's number)."""
    return with_custom(meta, **{TUNIX_STEP_KEY: tunix_step})


def with_item(
    meta: dict[str, Any],
    item: str,
    handler: str,
    provenance: dict[str, Any],
    custom: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``meta`` naming the new ``item`` (read by ``handler``) and recording ``provenance``
    and the ``custom`` entries MaxText reads (``scan_layers``) beside it."""
    meta = dict(meta) or {"item_handlers": {}, "metrics": {}, "performance_metrics": {}}
    handlers = dict(meta.get("item_handlers") or {})
    handlers[item] = handler
    entries = {**(custom or {}), PROVENANCE_KEY: provenance}
    return with_custom({**meta, "item_handlers": handlers}, **entries)
