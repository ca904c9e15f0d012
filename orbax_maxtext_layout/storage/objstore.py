"""Object stores (``gs://``): what differs from a disk, in one place.

An object store has no directories and no rename: a "rename" is a copy of every
object and a delete, in no fixed order, and fsspec refuses to rename onto an
existing object. So on an object store this package:

* writes a new ``items/`` in place, data first, ``_METADATA`` after the files it relies
  on, and ``items/commit_success.txt`` last: that marker is the commit point, and an
  ``items/`` without it is incomplete (never MaxText layout; a rerun removes it);
* replaces the step's metadata file with one write (a single object write
  is atomic);
* copies object data with the store's server-side copy (GCS rewrite), so no array
  byte travels through the client;
* creates a lock with a conditional write (create only if absent: GCS
  ``ifGenerationMatch=0``);
* moves a step directory (renumbering) with `move_dir`: a marker object in the
  destination first, server-side copies, the destination's ``commit_success.txt``, then
  the source's marker before the rest of it. A step directory is a step only with its
  ``commit_success.txt`` (as for Orbax), so at every moment one of the two is a complete
  step (for a moment both are) and neither is a partial one; `finish_move` completes or
  rolls back a killed move.

gcsfs (the ``gcs`` extra) provides the client; it is imported only for ``gs://`` paths.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Iterable, Iterator
from typing import Any

from etils import epath

COMMIT_MARKER = "commit_success.txt"
MOVING = ".orbax-maxtext-layout.moving"  # in a step directory being moved into (`move_dir`)


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


# -- reads within a read-only operation -------------------------------------------------------
# Each request to an object store waits a round trip (tens of ms at a real bucket), and a
# restore asked the same questions several times over (issue 58: 55-65 metadata requests,
# one after another, before the first byte of data): whether ``items/`` and each
# ``commit_success.txt`` exist, then each item's JSON files with a stat, an existence check
# and a read. Within `read_only` (a restore: nothing is written, and a step being read cannot
# change under its reader), each answer is asked once and kept; files are read with one
# ranged request, no stat first; independent reads go out together (`prefetch`). Outside
# it, nothing is kept: every call asks the store. Scoped to the calling thread's context.
_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "orbax_maxtext_layout_objstore_memo", default=None
)


class TooLarge(ValueError):
    """A file holds more bytes than its reader takes (`read_file`)."""


@contextlib.contextmanager
def read_only() -> Iterator[None]:
    """Within it, each object's existence, each listing and each small file read is asked
    of the store once (the outermost such block keeps them)."""
    if _MEMO.get() is not None:
        yield
        return
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


def _memo(kind: str, path: epath.PathLike, ask: Any) -> Any:
    memo = _MEMO.get()
    if memo is None:
        return ask()
    key = (kind, str(path).rstrip("/"))
    if key not in memo:
        memo[key] = ask()
    return memo[key]


def exists(path: epath.PathLike) -> bool:
    """Whether the object (or a "directory" holding some) ``path`` exists."""
    if (got := _known_file(path)) is not None:
        return got
    return _memo("exists", path, lambda: _fs(path).exists(str(path)))


def is_dir(path: epath.PathLike) -> bool:
    """Whether ``path`` is a "directory": some object's name starts with ``path/``."""
    return _memo("is_dir", path, lambda: _fs(path).isdir(str(path)))


def list_dir(path: epath.PathLike) -> list[str]:
    """The names directly under ``path`` (objects and "directories"), sorted; [] if none."""

    def ask() -> list[str]:
        fs = _fs(path)
        try:
            entries = fs.ls(str(path), detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    return _memo("list", path, ask)


def _known_file(path: epath.PathLike) -> bool | None:
    """Whether ``path`` exists, where a read of it in this operation told already."""
    memo = _MEMO.get()
    got = None if memo is None else memo.get(("read", str(path).rstrip("/")))
    return None if got is None else not isinstance(got[1], FileNotFoundError)


def read_file(path: epath.PathLike, limit: int) -> bytes:
    """The bytes of the object ``path``, with one ranged request (no stat): `TooLarge` if it
    holds more than ``limit``, `FileNotFoundError` if it is missing, other `OSError`s as
    the client raises them."""
    memo = _MEMO.get()
    key = ("read", str(path).rstrip("/"))
    got = None if memo is None else memo.get(key)
    if got is None or got[0] < limit:  # (bytes asked for - 1, what came back)
        got = (limit, _read_head(path, limit + 1))
        if memo is not None:
            memo[key] = got
    data = got[1]
    if isinstance(data, OSError):
        raise data
    if len(data) > limit:  # read up to one byte more than a kept limit: a whole file or more
        raise TooLarge(f"{path}: more than {limit} bytes")
    return data


def prefetch(paths: Iterable[epath.PathLike], limit: int) -> None:
    """Reads the objects ``paths`` (at most ``limit`` bytes of each is kept for `read_file`;
    a missing one is remembered as missing) with their requests all in flight at once.
    Only within `read_only`: elsewhere nothing would keep them."""
    memo = _MEMO.get()
    if memo is None:
        return
    todo = [str(p).rstrip("/") for p in paths]
    todo = [p for p in todo if ("read", p) not in memo]
    if not todo:
        return
    fs = _fs(todo[0])
    keys = [_key(fs, p) for p in todo]
    got = fs.cat_ranges(keys, [0] * len(keys), [limit + 1] * len(keys), on_error="return")
    for p, data in zip(todo, got, strict=True):
        if _empty(data):
            data = b""
        if isinstance(data, (bytes, OSError)):
            memo[("read", p)] = (limit, data)
        # anything else (another exception type): left for `read_file` to ask again


def _read_head(path: epath.PathLike, n: int) -> bytes | OSError:
    fs = _fs(path)
    try:
        return fs.cat_file(_key(fs, path), start=0, end=n)
    except OSError as e:  # kept (a missing file stays missing within the operation)
        return e
    except Exception as e:
        if _empty(e):
            return b""
        raise


def _empty(e: object) -> bool:
    """Whether a ranged read's error says the object is empty: the store refuses any range of
    an object of 0 bytes ("416 Range Not Satisfiable"), which a plain read gives as b""."""
    return isinstance(e, Exception) and getattr(e, "code", None) == 416


def refresh(path: epath.PathLike) -> None:
    """Forgets cached listings (the client caches them; tensorstore writes bypass it).

    In every instance of the store's file system class in this process: ``etils.epath``
    (so Orbax) holds its own gcsfs instance (built with other options than ours), whose
    listings would otherwise still show what was just deleted, e.g. a moved step's source
    directory, into which Orbax then refuses to save.
    """
    with contextlib.suppress(Exception):
        fs = _fs(path)
        instances = [fs, *getattr(type(fs), "_cache", {}).values()]
        for inst in {id(i): i for i in instances}.values():
            inst.invalidate_cache()


def generation(path: epath.PathLike) -> Any:
    """The object's generation (it changes with every write of it), None if it is missing.

    Asked of the server, not of the client's cached listings (another process may have
    written it meanwhile)."""
    fs = _fs(path)
    fs.invalidate_cache(str(path))
    try:
        info = fs.info(str(path))
    except FileNotFoundError:
        return None
    return info.get("generation") or (info.get("updated"), info.get("size"))


def _key(fs: Any, path: epath.PathLike) -> str:
    return fs._strip_protocol(str(path)).rstrip("/")


def _objects(fs: Any, path: epath.PathLike) -> list[str]:
    """The names of the objects under ``path``, relative to it (a fresh listing)."""
    root = _key(fs, path) + "/"
    fs.invalidate_cache()
    return [f[len(root) :] for f in fs.find(root) if not f.endswith("/")]


def copy_tree(
    src: epath.Path,
    dst: epath.Path,
    *,
    skip: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
) -> None:
    """Copies every object under ``src`` (but the relative names in ``skip``; only those
    in ``only`` if given) to ``dst`` with server-side copies (no data through the client)."""
    fs = _fs(src)
    s, d = _key(fs, src), _key(fs, dst)
    names = [n for n in _objects(fs, src) if n not in skip and (only is None or n in only)]
    if names:
        fs.copy([f"{s}/{n}" for n in names], [f"{d}/{n}" for n in names])
    refresh(dst)


def upload(local: epath.PathLike, dst: epath.Path) -> None:
    """Uploads the local file ``local`` to the object ``dst``, streamed from disk."""
    fs = _fs(dst)
    fs.put_file(str(local), _key(fs, dst))
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


def move_dir(src: epath.Path, dst: epath.Path, *, skip: tuple[str, ...] = ()) -> None:
    """Moves the committed step directory ``src`` to its sibling ``dst`` (no rename here).

    Order: ``dst/.orbax-maxtext-layout.moving`` (naming ``src``), server-side copies of
    every object but ``commit_success.txt`` and ``skip`` (relative names), then
    ``dst/commit_success.txt``: the moment ``dst`` becomes a step. Then `finish_move`
    deletes ``src``, its ``commit_success.txt`` first, and the marker last. A kill leaves
    either ``src`` listed and ``dst`` uncommitted, or ``dst`` listed (and ``src`` too
    until its marker is deleted: `finish_move` resolves that twin).
    """
    fs = _fs(src)
    s, d = _key(fs, src), _key(fs, dst)
    fs.invalidate_cache()
    if not fs.exists(f"{s}/{COMMIT_MARKER}"):  # a partial step must never become one
        raise FileNotFoundError(f"{src}: no {COMMIT_MARKER}, not a committed step; not moved.")
    fs.pipe_file(f"{d}/{MOVING}", json.dumps({"from": src.name}).encode())
    copy_tree(src, dst, skip=(*skip, COMMIT_MARKER, MOVING))
    fs.copy(f"{s}/{COMMIT_MARKER}", f"{d}/{COMMIT_MARKER}")
    finish_move(dst)


def finish_move(dst: epath.Path) -> str | None:
    """Completes or rolls back a `move_dir` into ``dst`` that was killed; None if none was.

    ``dst`` committed: the source is deleted (its ``commit_success.txt`` first). Not
    committed: ``dst``'s partial copy is deleted and the source, still committed, stays.
    The marker goes last, so a kill here is finished by the next call. Call it under the
    lock that serialises moves in the directory (or on the one process that moves).
    """
    marker = dst / MOVING
    if not marker.exists():
        return None
    src = dst.parent / json.loads(marker.read_text())["from"]
    fs = _fs(dst)
    if (dst / COMMIT_MARKER).exists():
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(f"{_key(fs, src)}/{COMMIT_MARKER}")
        remove_tree(src)
        done = f"finished moving {src.name} to {dst.name}"
    else:
        rest = [f"{_key(fs, dst)}/{n}" for n in _objects(fs, dst) if n != MOVING]
        if rest:
            fs.rm(rest)
        done = f"rolled back an unfinished move of {src.name} to {dst.name}"
    fs.rm_file(f"{_key(fs, dst)}/{MOVING}")
    refresh(dst)
    return done


def finish_moves(folder: epath.Path) -> list[str]:
    """`finish_move` for every step directory directly in ``folder`` (one listing)."""
    fs = _fs(folder)
    fs.invalidate_cache()
    base = _key(fs, folder)
    try:
        found = fs.glob(f"{base}/*/{MOVING}")
    except FileNotFoundError:
        return []
    return [
        n
        for f in found
        if (n := finish_move(epath.Path(folder) / f[len(base) + 1 :].split("/")[0]))
    ]
