"""The one rule for paths a checkpoint names itself: they stay inside it.

An OCDBT database names its data files in its manifest and B-tree nodes as (base path,
relative path) strings, and the format allows any relative path. Tensorstore's file
kvstore refuses a key that is absolute or has an empty, ``.`` or ``..`` component
("Invalid key"), so stock Orbax never reads outside an item. Everything in this package
that opens a file or an object by a name taken from a checkpoint's own bytes checks the
name here first, with that same rule, on a disk and on ``gs://`` alike (an object store
has no ``..``, but a name that means "outside" on a disk is refused everywhere, so a
checkpoint reads the same wherever it lies). Symlinks inside a checkpoint are followed,
as stock follows them.
"""

from __future__ import annotations

from ..errors import CheckpointReadError

LEAVES = "data file path leaves the checkpoint"


def escape(rel: str) -> str | None:
    """Why ``rel`` (a path relative to a checkpoint's item, ``/``-separated) would leave
    it, or None when it stays inside: tensorstore's file kvstore's rule for keys."""
    if not rel:
        return "an empty path"
    if "\0" in rel:
        return "a NUL byte"
    if rel.startswith("/"):
        return "an absolute path"
    for part in rel.split("/"):
        if not part:
            return "an empty component"
        if part in (".", ".."):
            return f"a {part!r} component"
    return None


def check_inside(item: object, key: str, rel: str) -> str:
    """``rel`` unchanged when it stays inside ``item``; else a `CheckpointReadError`
    naming the item, the key that names it, and the path. Call before opening anything."""
    why = escape(rel)
    if why is not None:
        raise CheckpointReadError(
            f"{item}: {key}: {LEAVES}: {rel!r} ({why}). Nothing outside the checkpoint is "
            "read, and nothing was written; the checkpoint is damaged or crafted."
        )
    return rel
