"""Object stores (``gs://``): what differs from a disk, in one place.

An object store has no directories and no rename: a "rename" is a copy of every
object and a delete, in no fixed order, and fsspec refuses to rename onto an
existing object. So on an object store this package:

* writes a new ``items/`` in place, data first, ``_METADATA`` after the files it relies
  on, and ``items/commit_success.txt`` last: that marker is the commit point, and an
  ``items/`` without it is incomplete (never MaxText layout; a rerun removes it);
* replaces the step's ``_CHECKPOINT_METADATA`` with one write (a single object write
  is atomic);
* copies object data with the store's server-side copy (GCS rewrite), so no array
  byte travels through the client;
* creates a lock with a conditional write (create only if absent: GCS
  ``ifGenerationMatch=0``).

gcsfs (the ``gcs`` extra) provides the client; it is imported only for ``gs://`` paths.
"""

from __future__ import annotations

import contextlib
from typing import Any

from etils import epath

COMMIT_MARKER = "commit_success.txt"


def is_remote(path: epath.PathLike) -> bool:
    """True for a URL path (``gs://``, ``s3://``), i.e. not a local POSIX path."""
    return "://" in str(path)


def _fs(path: epath.PathLike) -> Any:
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - etils[epath] brings fsspec
        raise ImportError(
            f"{path}: object stores need fsspec and gcsfs (pip install "
            "'orbax-maxtext-layout[gcs]')."
        ) from e
    fs, _ = fsspec.core.url_to_fs(str(path))
    return fs


def refresh(path: epath.PathLike) -> None:
    """Forgets cached listings (the client caches them; tensorstore writes bypass it)."""
    with contextlib.suppress(Exception):
        _fs(path).invalidate_cache()


def copy_tree(src: epath.Path, dst: epath.Path) -> None:
    """Copies every object under ``src`` to ``dst`` with server-side copies (no data
    through the client)."""
    fs = _fs(src)
    root = fs._strip_protocol(str(src)).rstrip("/") + "/"
    fs.invalidate_cache()
    files = [f for f in fs.find(root) if not f.endswith("/")]
    base = str(dst).rstrip("/") + "/"
    fs.copy(files, [base + f[len(root) :] for f in files])
    refresh(dst)


def remove_tree(path: epath.Path) -> None:
    """Deletes every object under ``path`` (missing is fine)."""
    fs = _fs(path)
    fs.invalidate_cache()
    with contextlib.suppress(FileNotFoundError):
        fs.rm(str(path).rstrip("/"), recursive=True)
    refresh(path)


def write_exclusive(path: epath.Path, data: bytes) -> bool:
    """Creates the object ``path`` only if it does not exist; False if it does.

    A conditional write (GCS ``ifGenerationMatch=0``), not check-then-write: of two
    writers exactly one succeeds.
    """
    fs = _fs(path)
    try:
        fs.pipe_file(str(path), data, mode="create")
    except FileExistsError:
        return False
    except OSError as e:  # gcsfs reports a failed precondition as an HTTP 412
        if "412" in str(e) or "recondition" in str(e):
            return False
        raise
    finally:
        refresh(path)
    return True
