"""A Hugging Face directory read as untrusted input: `HfDir`, its config and its tensors.

A directory holds ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file) with its
shards, on a local disk or under a ``gs://`` prefix. A Hub cache snapshot
(``models--<org>--<name>/snapshots/<rev>/``, every file a symlink ``-> ../../blobs/<hash>``)
reads too.

As transformers does, ``model.safetensors`` is read where there is one, else the index.

It usually comes from the internet, so every byte of it is hostile until checked, and
`HfDir.open` checks all of it (the config, the index, every shard's header) before it
reads a byte of tensor data; anything wrong is an `HfInputError`, one line naming the
file and, where there is one, the tensor:

- a file named by the index (or this module) must stay inside the directory:
  `containment`'s rule (no absolute path, no empty, ``.`` or ``..`` component, no NUL);
  on a disk it is opened by a walk from the directory's descriptor, one component at a
  time (`containment.open_beneath`: each symlink on the way read and walked by the walk,
  never followed by the kernel, so nothing swapped in meanwhile leads out), ending inside
  the directory or, in a Hub cache snapshot, directly in a real ``blobs/`` directory of
  its own repo (a ``blobs`` that is a link is walked as a link: out of the repo, refused);
  it must be a regular file;
- ``config.json`` and the index are read only below a size (`CONFIG_LIMIT`,
  `INDEX_LIMIT`), must be JSON objects, and ``weight_map`` a str -> str mapping, no name
  twice;
- a safetensors header (an 8-byte little-endian length, then that much JSON) is read
  only once its length is checked against `HEADER_LIMIT` and the file's size (a refusal
  never shows the length: it is the file's first bytes); it must have a header's shape
  before it is parsed (`_structure`), then be UTF-8 JSON, an object whose entries are
  ``__metadata__`` (str -> str, optional) and tensors of exactly ``dtype`` (one of
  `DTYPES`), ``shape`` (at most 64 non-negative ints) and ``data_offsets`` (``[begin,
  end]`` inside the data), each dtype's itemsize times the shape's product equal to ``end -
  begin``, no two tensors overlapping, no name twice;
- each tensor lies in exactly one shard: the one the index maps it to (a tensor the index
  does not list is refused too).

Nothing is allocated from a size the input declares before it is checked against the
file's real size: a tensor's buffer is allocated only for its checked bytes, and a header
is read only for the bytes the file really holds. A header's JSON is checked for a
header's shape (`HEADER_DEPTH` levels, lists of at most `MAX_NDIM` numbers) before Python's
parser builds anything of it: a 100 MB header of nested empty lists cost 2.4 GiB and 24 s
before its refusal, and 195 MiB and 1 s with the check (bench/hf_headers.py; the
safetensors library 1.1 GiB). A header of that shape costs the parser in proportion to its
entries: a real header is a few KiB per hundred tensors, a forged one of a million empty
tensors (70 MB) 840 MiB, accepted, as the safetensors library accepts it.

Reads (`HfDir.read`, `HfDir.read_rows`) are one range read each (in `REMOTE_PIECE` parts
on an object store), from a file opened once, safe from several threads at once:
``os.preadv`` on a local file descriptor; on ``gs://`` ranged reads of exactly the bytes
asked for (fsspec's ``cat_file``; no read-ahead). Nothing is mapped (the safetensors library
maps): a mapped page of a shard cut short meanwhile (a download replacing it, a
cache cleaned) raises SIGBUS and ends the process, where a read comes back short, which
is refused (`HfInputError` naming the file). Each byte is read once, and
`HfDir.bytes_read` counts every byte read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import stat
import struct
import threading
from typing import Any

import ml_dtypes
import numpy as np
from etils import epath

from ..errors import CheckpointRefusedError, UsageError
from ..storage.containment import LinkLeaves, escape, open_beneath
from ..storage.store import store_for

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_LIMIT = 16 << 20  # config.json; real ones are a few KiB
INDEX_LIMIT = 64 << 20  # the index: ~100 bytes a tensor, so room for over 600k tensors
HEADER_LIMIT = 100_000_000  # a safetensors header: the safetensors library's own limit
MAX_NDIM = 64  # NumPy's
REMOTE_PIECE = 64 << 20  # an object-store read is made of ranged reads of this size
SNAPSHOTS, BLOBS = "snapshots", "blobs"  # a Hub cache repo: snapshots/<rev>/ -> blobs/
HUB_REPO = "models--"  # how the Hub cache names a model's repo: models--<org>--<name>
_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC  # walked, not read
_NAME_SHOWN = 160  # a name from the input is shown (repr) up to this many characters

# safetensors' dtype names; the sub-byte ones (F4, F6_*) are not read
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))

# A header's JSON is checked for its shape before it is parsed (`_structure`): Python's
# parser builds every list and object it meets before any check can run (100 MB of nested
# empty lists cost it 2.4 GiB), and a header has a fixed shape: an object of objects
# (``__metadata__`` and the tensors), their lists of integers.
HEADER_DEPTH = 3  # {"name": {"shape": [1, 2]}}
_LIST_HOLDS_MORE = re.compile(rb"\[[^\[\]{}]*[\[{]")  # a list or object in a list (`_bare`)
_LONG_LIST = re.compile(rb"\[(?:[^\],]*,){%d}" % MAX_NDIM)  # a list of over MAX_NDIM items
_NESTING = np.zeros(256, np.int8)
_NESTING[list(b"{[")], _NESTING[list(b"}]")] = 1, -1
_SCAN = 1 << 20  # the depth is counted this many bytes at a time


class HfInputError(CheckpointRefusedError):
    """A Hugging Face directory refused as damaged or forged (or a file of it missing or
    unreadable): one line naming the file and, where there is one, the tensor. Raised by
    `HfDir.open`, before any tensor data is read; by a read only for a file that shrank
    since."""


def _q(value: object) -> str:
    """A value taken from the input, shown safely: its repr, cut short."""
    r = repr(value)
    return r if len(r) <= _NAME_SHOWN else r[: _NAME_SHOWN - 3] + "..."


def _refuse(where: object, what: str, *, forged: bool = True) -> HfInputError:
    """The refusal of ``where`` for ``what``; ``forged``: it says what the input is, not
    merely missing or unreadable."""
    why = "; refused (a damaged or forged Hugging Face directory)" if forged else ""
    return HfInputError(" ".join(f"{where}: {what}{why}.".splitlines()))


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of the directory, as its checked header says."""

    name: str
    file: str  # relative to the directory, as the index names it (or "model.safetensors")
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file: 8 + header length + data_offsets[0]
    nbytes: int


class _Short(Exception):
    """A file gave fewer bytes than its checked size promised (it shrank meanwhile)."""


class _LocalFile:
    """A regular file on a disk, opened once (``fd``, by `containment.open_beneath`; closed
    here if it is not a regular file); `read_into` is ``os.preadv`` (thread-safe)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise IsADirectoryError("not a regular file")
        except BaseException:
            os.close(self.fd)
            raise
        self.size = st.st_size

    def read_into(self, buf: np.ndarray, at: int) -> None:
        view, done = memoryview(buf).cast("B"), 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], at + done)
            if got <= 0:
                raise _Short(f"{done} of {len(view)} bytes at offset {at}")
            done += got

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:  # an HfDir dropped unclosed leaves no descriptor open
        with contextlib.suppress(Exception):
            self.close()


class _RemoteFile:
    """An object (``gs://``): ranged reads through the handle's file system where it has
    one (fsspec's ``cat_file``: exactly the bytes asked for, no read-ahead), else a fresh
    handle per read, seeked. Thread-safe."""

    def __init__(self, path: epath.Path) -> None:
        st = path.stat()
        if st.is_directory or st.length is None:
            raise IsADirectoryError("not a regular file")
        self.path, self.size = path, int(st.length)
        with path.open("rb") as fh:
            fs, key = getattr(fh, "fs", None), getattr(fh, "path", None)
        self._cat = getattr(fs, "cat_file", None) if isinstance(key, str) else None
        self._key = key

    def read_into(self, buf: np.ndarray, at: int) -> None:
        view = memoryview(buf).cast("B")
        for lo in range(0, len(view), REMOTE_PIECE):
            n = min(REMOTE_PIECE, len(view) - lo)
            if self._cat is not None:
                data = self._cat(self._key, start=at + lo, end=at + lo + n)
            else:
                with self.path.open("rb") as fh:
                    fh.seek(at + lo)
                    data = fh.read(n)
            if len(data) != n:
                raise _Short(f"{len(data)} of {n} bytes at offset {at + lo}")
            view[lo : lo + n] = data

    def close(self) -> None:
        pass


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _parse(data: np.ndarray, where: object, what: str, *, unique: bool) -> Any:
    """``data`` (bytes) as UTF-8 JSON; ``unique``: a key named twice in an object is refused
    (Python's parser would keep the last silently)."""
    try:
        return json.loads(
            str(memoryview(data), "utf-8"), object_pairs_hook=_unique if unique else None
        )
    except _Duplicate as e:
        raise _refuse(where, f"{_q(e.key)} is named twice in the {what}") from None
    except UnicodeDecodeError as e:  # its own message shows the byte: not shown
        raise _refuse(
            where, f"the {what} is not valid JSON (not UTF-8 at byte {e.start})"
        ) from None
    except (ValueError, RecursionError, MemoryError) as e:
        why = {RecursionError: "nested too deeply", MemoryError: "too large to parse"}
        raise _refuse(where, f"the {what} is not valid JSON ({why.get(type(e), e)})") from None


def _structure(text: np.ndarray) -> str | None:
    """Why the header ``text`` cannot be a safetensors header (`HEADER_DEPTH`: nested
    deeper, an object below the tensors' entries, a list holding a list or an object or
    more than `MAX_NDIM` items), found without parsing it, in memory no larger than the
    text; None where it may be one (the parse checks the rest)."""
    bare = _bare(text)
    if _LIST_HOLDS_MORE.search(bare):
        return "a list in it holds a list or an object"
    if _LONG_LIST.search(bare):
        return f"a list in it holds more than {MAX_NDIM} items"
    depth = 0
    for lo in range(0, len(bare), _SCAN):
        part = np.frombuffer(bare, np.uint8, min(_SCAN, len(bare) - lo), lo)
        at = np.cumsum(_NESTING[part], dtype=np.int32)
        at += depth
        if at.size and int(at.max()) > HEADER_DEPTH:
            return f"nested deeper than {HEADER_DEPTH} levels"
        if np.any((part == ord("{")) & (at >= HEADER_DEPTH)):
            return "an object inside a tensor's entry"
        depth = int(at[-1]) if at.size else depth
    return None


def _bare(text: np.ndarray) -> memoryview:
    """The JSON ``text`` with every string (its quotes included) left out: what is left is
    its structure, where no bracket inside a string counts. Vectorized a `_SCAN` at a time
    (a regular expression's replacement per string took 5 s for 10 MB of quotes): a quote
    is a string's edge unless an odd run of backslashes precedes it."""
    out, kept, in_string, run = np.empty(len(text), np.uint8), 0, 0, 0
    for lo in range(0, len(text), _SCAN):
        part = text[lo : lo + _SCAN]
        quote = part == ord('"')
        slash = part == ord("\\")
        if run or slash.any():  # ``run``: the backslashes ending the previous part
            quote &= ~_escaped(slash, run)
            run = _trailing(slash, run)
        # 1 from a string's opening quote to the character before its closing one
        inside = np.bitwise_xor.accumulate(quote.view(np.uint8)) ^ in_string
        left = part[(inside == 0) & ~quote]
        out[kept : kept + len(left)] = left
        kept, in_string = kept + len(left), int(inside[-1])
    return memoryview(out)[:kept]


def _escaped(slash: np.ndarray, run: int) -> np.ndarray:
    """Which characters follow an odd run of backslashes (``slash``), ``run`` of them ending
    the text before."""
    at = np.arange(len(slash))
    first = slash.copy()
    first[1:] &= ~slash[:-1]
    if run and slash[0]:
        first[0] = False  # the run goes on from the previous part
    starts = np.where(first, at, -run if run else -(1 << 40))
    starts = np.maximum.accumulate(starts)  # where the run each backslash is in began
    before = np.zeros(len(slash), np.int64)  # the backslashes right before each character
    before[1:] = np.where(slash[:-1], at[:-1] - starts[:-1] + 1, 0)
    before[0] = run
    return (before & 1).astype(bool)


def _trailing(slash: np.ndarray, run: int) -> int:
    """How many backslashes end ``slash``'s text, ``run`` of them ending the text before."""
    if not slash[-1]:
        return 0
    others = np.flatnonzero(~slash)
    return len(slash) - int(others[-1]) - 1 if others.size else run + len(slash)


class HfDir:
    """A Hugging Face directory, every header checked (module docstring): `open` it, then
    `read` tensors whole or `read_rows` of them. `close` (or ``with``) closes its files."""

    dir: epath.Path
    config: dict
    tensors: dict[str, TensorInfo]

    def __init__(self, hf_dir: epath.PathLike) -> None:
        self.dir = epath.Path(hf_dir)
        self.remote = not store_for(hf_dir).reads_files  # an object store: range reads
        self.config = {}
        self.tensors = {}
        self._files: dict[str, _LocalFile | _RemoteFile] = {}
        self._sizes: dict[str, int] = {}  # each safetensors file's size
        self._index: dict[str, str] = {}  # the index's weight_map, once checked
        self._bytes_read = 0
        self._lock = threading.Lock()
        self._names: tuple[str, str] | None = None  # `open`'s ``files``
        # On a disk, every file is opened by a walk beneath ``_top`` (`open_beneath`, from
        # a descriptor open while `open` runs): the directory itself, or in a Hub cache
        # snapshot (``models--<org>--<name>/snapshots/<rev>``) its repo, the walk starting
        # at ``_start`` and ending only in the snapshot or directly in the repo's blobs/.
        self._root = self._top_path = self._start = ""
        self._top = -1
        if not self.remote:
            self._root = self._top_path = os.path.realpath(os.fspath(hf_dir))
            parent, rev = os.path.split(self._root)
            repo, snapshots = os.path.split(parent)
            if snapshots == SNAPSHOTS and os.path.basename(repo).startswith(HUB_REPO):
                self._top_path, self._start = repo, f"{SNAPSHOTS}/{rev}/"

    # -- opening: everything checked, no tensor data read ------------------------------
    @classmethod
    def open(cls, hf_dir: epath.PathLike, *, files: tuple[str, str] | None = None) -> HfDir:
        """The directory ``hf_dir`` (a local path or ``gs://``), its config, index and every
        shard's header read and checked; `HfInputError` for anything wrong. ``files``: another
        kind of directory's (config, weights) file names, with the same checks (a PEFT
        adapter's ``adapter_config.json`` and ``adapter_model.safetensors``): no index, and a
        config naming a key twice refused (which of the two would count is the reader's
        guess)."""
        self = cls(hf_dir)
        self._names = files
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def _open(self) -> None:
        if self.remote:
            self._open_all()
            return
        if not os.path.isdir(self._root):
            raise _refuse(self.dir, "no such directory", forged=False)
        try:
            self._top = os.open(self._top_path, _DIR_FLAGS)
        except OSError as e:
            raise _refuse(self.dir, f"cannot be read ({e.strerror or e})", forged=False) from None
        try:
            self._open_all()
        finally:
            top, self._top = self._top, -1
            os.close(top)

    def _open_all(self) -> None:
        config_file, weights_file = self._names or (CONFIG_FILE, WEIGHTS_FILE)
        unique = self._names is not None
        config = self._read_json(config_file, CONFIG_LIMIT, "config", unique=unique)
        if not isinstance(config, dict):
            raise _refuse(self._where(config_file), "the config is not a JSON object")
        self.config = config
        if self._exists(weights_file):
            self._add_shard(weights_file, None)
        elif self._names is not None:
            raise _refuse(self.dir, f"no {weights_file} here", forged=False)
        elif self._exists(INDEX_FILE):
            shards = self._read_index()
            for rel in sorted(shards):
                self._add_shard(rel, shards[rel])
        else:
            raise _refuse(self.dir, f"neither {WEIGHTS_FILE} nor {INDEX_FILE} is here")
        self.tensors = dict(sorted(self.tensors.items()))

    def _where(self, rel: str) -> str:
        shown = rel if len(rel) <= _NAME_SHOWN and rel.isprintable() else _q(rel)
        return f"{self.dir}/{shown}"

    def _exists(self, rel: str) -> bool:
        if self.remote:
            return (self.dir / rel).exists()
        return os.path.lexists(os.path.join(self._root, rel))

    def _read_json(self, rel: str, limit: int, what: str, *, unique: bool) -> Any:
        f = self._file(rel, None, None)
        try:
            if f.size > limit:
                raise _refuse(
                    self._where(rel),
                    f"the {what} is {f.size:,} bytes, more than the {limit:,} read",
                )
            data = self._read(f, rel, None, 0, f.size)
        finally:
            f.close()
        return _parse(data, self._where(rel), what, unique=unique)

    def _read_index(self) -> dict[str, list[str]]:
        """The index's shards: each file name -> the tensors it maps there; every name
        checked to stay inside the directory before any shard is opened."""
        where = self._where(INDEX_FILE)
        index = self._read_json(INDEX_FILE, INDEX_LIMIT, "index", unique=True)
        if not isinstance(index, dict):
            raise _refuse(where, "the index is not a JSON object")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise _refuse(where, f"its weight_map is {_q(weight_map)}, not an object of files")
        shards: dict[str, list[str]] = {}
        for name, rel in weight_map.items():
            if not isinstance(rel, str):
                raise _refuse(where, f"tensor {_q(name)}: its file is {_q(rel)}, not a string")
            why = escape(rel)
            if why is not None:
                raise _refuse(where, f"tensor {_q(name)}: file {_q(rel)} leaves {self.dir} ({why})")
            shards.setdefault(rel, []).append(name)
        self._index = weight_map
        return shards

    def _file(self, rel: str, tensor: str | None, named_by: str | None) -> _LocalFile | _RemoteFile:
        """File ``rel`` opened, once it is shown to be a regular file inside the directory
        (or in its Hub cache repo's ``blobs/``). ``named_by``: the file naming it."""
        where = self._where(rel)
        about = f"tensor {_q(tensor)}: " if tensor is not None else ""
        if named_by is not None:
            about += f"named by {named_by}: "
        why = escape(rel)
        if why is not None:  # the names of this module pass; the index's were checked
            raise _refuse(where, f"{about}the path leaves {self.dir} ({why})")
        try:
            if self.remote:
                return _RemoteFile(self.dir / rel)
            return _LocalFile(
                open_beneath(self._top, self._top_path, self._start + rel, self._ends)
            )
        except LinkLeaves as e:
            raise _refuse(
                where,
                f"{about}a link to {_q(e.target)}, outside {self.dir} (by way of {_q(e.link)}; "
                f"only a Hub cache snapshot's links into a real {BLOBS}/ directory of its "
                "own repo are followed)",
            ) from None
        except FileNotFoundError:
            raise _refuse(where, f"{about}missing", forged=False) from None
        except IsADirectoryError:
            raise _refuse(where, f"{about}not a regular file") from None
        except OSError as e:
            raise _refuse(
                where, f"{about}cannot be read ({e.strerror or e})", forged=False
            ) from None

    def _ends(self, at: tuple[str, ...]) -> bool:
        """Whether a file may be opened in the directory ``at`` (components beneath
        ``_top``): anywhere in the directory; in a Hub cache snapshot, in the snapshot or
        directly in its repo's ``blobs/`` (walked into as a real directory, never a link)."""
        if not self._start:
            return True
        return at[:2] == tuple(self._start.split("/")[:2]) or at == (BLOBS,)

    def _add_shard(self, rel: str, listed: list[str] | None) -> None:
        """Shard ``rel`` opened and its header checked; its tensors added. ``listed``: the
        tensors the index maps to it (None: the single ``model.safetensors``)."""
        named_by = INDEX_FILE if listed is not None else None
        f = self._file(rel, listed[0] if listed else None, named_by)
        self._files[rel] = f
        self._sizes[rel] = f.size
        where = self._where(rel)
        found = self._header(f, rel, where)
        wanted = set(listed) if listed is not None else None
        for info in found:
            other = self.tensors.get(info.name)
            if other is not None:
                raise _refuse(where, f"tensor {_q(info.name)} is also in {_q(other.file)}")
            if wanted is not None and info.name not in wanted:
                there = self._index.get(info.name)
                said = f"maps it to {_q(there)}" if there is not None else "does not list it"
                raise _refuse(where, f"tensor {_q(info.name)} is here, but {INDEX_FILE} {said}")
            self.tensors[info.name] = info
        if wanted is not None:
            missing = sorted(wanted - {i.name for i in found})
            if missing:
                raise _refuse(
                    where, f"tensor {_q(missing[0])}: {INDEX_FILE} maps it here, but it is not here"
                )

    def _header(self, f: _LocalFile | _RemoteFile, rel: str, where: str) -> list[TensorInfo]:
        """The tensors of ``f``'s header, every entry checked against the file's size."""
        if f.size < 8:
            raise _refuse(where, f"{f.size} bytes, shorter than a safetensors header length")
        (n,) = struct.unpack("<Q", self._read(f, rel, None, 0, 8).tobytes())
        # the length is the file's first 8 bytes: a refusal never shows it (a file that is
        # no safetensors file would have them printed, "TOPSECRE" as an integer)
        if n > HEADER_LIMIT:
            raise _refuse(
                where,
                f"the header length its first 8 bytes give is implausible: over the limit "
                f"of {HEADER_LIMIT:,} bytes (the file has {f.size:,}); not a safetensors file",
            )
        if n > f.size - 8:
            raise _refuse(
                where,
                "the header length its first 8 bytes give is implausible: past the end of "
                f"the file's {f.size:,} bytes; not a safetensors file, or cut short",
            )
        text = self._read(f, rel, None, 8, n)
        why = _structure(text)
        if why is not None:
            raise _refuse(where, f"the header is not a safetensors header's JSON ({why})")
        header = _parse(text, where, "header", unique=True)
        if not isinstance(header, dict):
            raise _refuse(where, "the header is not a JSON object")
        meta = header.pop("__metadata__", None)
        if meta is not None and not (
            isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
        ):
            raise _refuse(where, "its __metadata__ is not a mapping of strings to strings")
        data_len = f.size - 8 - n
        found = [_entry(name, e, rel, (8 + n, data_len), where) for name, e in header.items()]
        spans = sorted((i.start, i.start + i.nbytes, i.name) for i in found if i.nbytes)
        for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
            if begin < end:
                raise _refuse(where, f"tensor {_q(b)} overlaps tensor {_q(a)}")
        return found

    # -- reading ----------------------------------------------------------------------
    def _read(
        self,
        f: _LocalFile | _RemoteFile,
        rel: str,
        tensor: str | None,
        at: int,
        n: int,
        *,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        """Bytes ``[at, at + n)`` of ``f`` (``n`` checked against its size by the caller), into
        ``into`` (``n`` bytes of uint8) where given, else a fresh buffer."""
        buf = np.empty(n, np.uint8) if into is None else into
        try:
            if n:
                f.read_into(buf, at)
        except _Short as e:
            about = f"tensor {_q(tensor)}: " if tensor is not None else ""
            raise _refuse(
                self._where(rel), f"{about}the file is shorter than it was ({e})"
            ) from None
        except OSError as e:
            about = f"tensor {_q(tensor)}: " if tensor is not None else ""
            what = f"{about}cannot be read ({e.strerror or e})"
            raise _refuse(self._where(rel), what, forged=False) from None
        with self._lock:
            self._bytes_read += n
        return buf

    @property
    def bytes_read(self) -> int:
        """Every byte read so far: the config, the index, headers and tensor data."""
        return self._bytes_read

    @property
    def safetensors_bytes(self) -> int:
        """The sizes of the safetensors files, added up."""
        return sum(self._sizes.values())

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.dir}: no tensor {name!r}") from None

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` whole: one range read, a C-order array of its dtype."""
        t = self._info(name)
        return self._array(t, 0, t.nbytes, t.shape)

    def read_into(self, name: str, out: np.ndarray) -> np.ndarray:
        """Tensor ``name`` whole, read into the first bytes of ``out`` (C-contiguous uint8,
        reused by the caller: fresh pages cost more than the read on a VM), refused as `read`
        refuses; a view of ``out`` in the tensor's dtype and shape."""
        t = self._info(name)
        if out.dtype != np.uint8 or out.ndim != 1 or out.nbytes < t.nbytes:
            raise UsageError(f"{self.dir}: tensor {name!r} needs {t.nbytes} bytes to read into")
        return self._array(t, 0, t.nbytes, t.shape, into=out[: t.nbytes])

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of tensor ``name`` on its axis 0: one range read."""
        t = self._info(name)
        if not t.shape or not 0 <= start <= stop <= t.shape[0]:
            raise UsageError(
                f"{self.dir}: tensor {name!r} is {list(t.shape)}: it has no rows [{start}, {stop})"
            )
        row = t.nbytes // t.shape[0] if t.shape[0] else 0
        return self._array(t, start * row, (stop - start) * row, (stop - start, *t.shape[1:]))

    def _array(
        self,
        t: TensorInfo,
        offset: int,
        n: int,
        shape: tuple[int, ...],
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        f = self._files.get(t.file)
        if f is None:
            raise UsageError(f"{self.dir}: read after close")
        buf = self._read(f, t.file, t.name, t.start + offset, n, into=into)
        if t.dtype == np.bool_:
            np.minimum(buf, 1, out=buf)  # any other byte would be a bool NumPy misreads
        return buf.view(t.dtype).reshape(shape)

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def __enter__(self) -> HfDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HfDir({str(self.dir)!r}, {len(self.tensors)} tensors in {len(self._sizes)} files)"


def _entry(name: str, e: Any, rel: str, region: tuple[int, int], where: str) -> TensorInfo:
    """Header entry ``name`` checked: its keys, dtype, shape and byte range (inside the
    data region, ``region`` = (its first byte, its length), matching dtype x shape, in
    Python ints: no overflow)."""
    data_start, data_len = region

    def bad(what: str) -> HfInputError:
        return _refuse(where, f"tensor {_q(name)}: {what}")

    if not isinstance(e, dict) or set(e) != _ENTRY_KEYS:
        keys = sorted(e) if isinstance(e, dict) else type(e).__name__
        raise bad(f"its entry is {_q(keys)}, not exactly dtype, shape and data_offsets")
    dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"dtype {_q(dtype)} is not one this library reads ({', '.join(DTYPES)})")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise bad(f"shape {_q(shape)} is not a list of at most {MAX_NDIM} sizes")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"shape {_q(shape)} holds something other than non-negative integers")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
    ):
        raise bad(f"data_offsets {_q(offsets)} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise bad(f"data_offsets {_q(offsets)} are not a range of its {data_len} bytes of data")
    itemsize, span = DTYPES[dtype].itemsize, end - begin
    if 0 in shape:
        size = 0
    else:  # stops as soon as the product passes the span: a forged shape costs no big ints
        size = itemsize
        for d in shape:
            size *= d
            if size > span:
                break
    if size != span:
        raise bad(f"{dtype}{_q(shape)} is not the {span} bytes its data_offsets span")
    return TensorInfo(name, rel, DTYPES[dtype], tuple(shape), data_start + begin, span)
