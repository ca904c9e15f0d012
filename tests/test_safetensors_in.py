"""A Hugging Face directory read as untrusted input (issue 43): `formats.safetensors_reader.HfDir`.

Real files first, written by ``safetensors.numpy.save_file`` (single file, and sharded with
an index as transformers writes it) and by hand where safetensors' numpy side has no dtype
(bfloat16, float8), and a Hub cache snapshot whose files are links into ``blobs/``: every
tensor reads back whole and by rows, each byte once, counted.

Then one crafted directory per refusal (`REFUSALS`): each must raise `HfInputError`, one
line naming the file (and the tensor, where there is one), having opened nothing outside
the directory, written nothing, and left no file descriptor open.
"""

from __future__ import annotations

import concurrent.futures
import gc
import hashlib
import json
import os
import stat
import struct
import tracemalloc
import types
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from orbax_maxtext_layout.errors import CheckpointReadError, UsageError
from orbax_maxtext_layout.formats import safetensors_reader as si
from orbax_maxtext_layout.formats.safetensors_reader import HfDir, HfInputError

CONFIG = {"model_type": "llama", "hidden_size": 8, "architectures": ["LlamaForCausalLM"]}
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
RNG = np.random.default_rng(43)

# every dtype safetensors' numpy side writes; the rest are written by hand (`write_st`)
NUMPY_DTYPES = [
    np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8,
    np.uint64, np.uint32, np.uint16, np.uint8, np.bool_, np.complex64,
]  # fmt: skip
ML_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}


def values(dtype, shape) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return RNG.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return RNG.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (RNG.standard_normal(shape) + 1j * RNG.standard_normal(shape)).astype(dtype)
    return RNG.standard_normal(shape).astype(np.float32).astype(dtype)


# -- writing directories -------------------------------------------------------------------
def craft(path: Path, header: dict | bytes, data: bytes = b"", *, length: int | None = None):
    """A safetensors file written by hand: the length prefix (``length``, else the real
    one), the header (a dict as JSON, or raw bytes) and ``data``."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(text) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + text + data)
    return path


def write_st(path: Path, tensors: dict[str, tuple[str, np.ndarray]], gap: int = 0) -> Path:
    """``tensors`` (name -> (safetensors dtype, values)) in one file, in name order,
    ``gap`` bytes of padding after each (safetensors' own writer leaves none)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, (st, a) in sorted(tensors.items()):
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {
            "dtype": st,
            "shape": list(a.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw + b"\0" * gap
    return craft(path, header, data)


def write_index(hf: Path, weight_map: dict, total: int = 0) -> None:
    """``model.safetensors.index.json`` as transformers' ``save_pretrained`` writes it."""
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (hf / si.INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def new_dir(root: Path, name: str = "hf") -> Path:
    hf = root / name
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps(CONFIG))
    return hf


def sharded(hf: Path) -> dict[str, np.ndarray]:
    """Two shards and their index, as transformers writes them; the tensors written."""
    s1 = {
        "model.embed_tokens.weight": values(np.float32, (16, 8)),
        "a.bias": values(np.int64, (3,)),
    }
    s2 = {"lm_head.weight": values(np.float16, (16, 8)), "z.flag": values(bool, (2, 2))}
    save_file(s1, str(hf / SHARD1), metadata={"format": "pt"})
    save_file(s2, str(hf / SHARD2), metadata={"format": "pt"})
    total = sum(a.nbytes for a in [*s1.values(), *s2.values()])
    write_index(hf, {**dict.fromkeys(s1, SHARD1), **dict.fromkeys(s2, SHARD2)}, total)
    return {**s1, **s2}


def digest(root: Path) -> dict[str, str]:
    """Every path under ``root``: a file's sha256, a link's target, or what else it is."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p)] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[str(p)] = "not a file"
    return out


def open_fds() -> set[str]:
    """This process's open descriptors, once garbage no earlier test closed is collected (a
    dropped `HfDir` closes its files when collected, which could happen during a test)."""
    gc.collect()
    return set(os.listdir("/proc/self/fd"))


def spy_on_open(monkeypatch) -> list[str]:
    """The real path of everything `os.open` opens from now until the test ends (as the
    kernel names the descriptor it gave: a walk opens each component from its parent's
    descriptor), a directory's with a trailing ``/``."""
    seen: list[str] = []
    real_open = os.open

    def spy(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        real = os.readlink(f"/proc/self/fd/{fd}")
        seen.append(real + "/" if stat.S_ISDIR(os.fstat(fd).st_mode) else real)
        return fd

    monkeypatch.setattr(os, "open", spy)
    return seen


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    return spy_on_open(monkeypatch)


def files(seen: list[str]) -> list[str]:
    """What `spy_on_open` saw opened, but directories (walked, never read)."""
    return [p for p in seen if not p.endswith("/")]


def equal(got: np.ndarray, want: np.ndarray) -> bool:
    return (
        got.dtype == want.dtype
        and got.shape == want.shape
        and got.flags.c_contiguous
        and got.tobytes() == np.ascontiguousarray(want).tobytes()
    )


# -- reading real directories --------------------------------------------------------------
def test_a_single_file_of_every_numpy_dtype_reads_back_whole(tmp_path):
    hf = new_dir(tmp_path)
    want = {f"t.{np.dtype(d).name}": values(d, (3, 5)) for d in NUMPY_DTYPES}
    want |= {"scalar": np.array(2.5, np.float32), "empty": np.zeros((0, 4), np.int32)}
    save_file(want, str(hf / si.WEIGHTS_FILE), metadata={"format": "pt"})
    with HfDir.open(hf) as d:
        assert d.config == CONFIG
        assert sorted(d.tensors) == sorted(want)
        assert d.tensors["scalar"].shape == () and d.tensors["empty"].nbytes == 0
        for name, a in want.items():
            assert equal(d.read(name), a), name
        stock = load_file(str(hf / si.WEIGHTS_FILE))  # safetensors' own reader agrees
        assert all(equal(d.read(k), v) for k, v in stock.items())


def test_bfloat16_and_float8_read_back_whole_and_by_rows(tmp_path):
    hf = new_dir(tmp_path)
    want = {f"t.{st}": (st, values(dt, (6, 2, 3))) for st, dt in ML_DTYPES.items()}
    want["t.F32"] = ("F32", values(np.float32, (6, 4)))
    write_st(hf / si.WEIGHTS_FILE, want, gap=5)  # a gap after each tensor is allowed
    d = HfDir.open(hf)
    for name, (st, a) in want.items():
        assert d.tensors[name].dtype == si.DTYPES[st] == a.dtype
        assert equal(d.read(name), a)
        for start, stop in ((0, 6), (1, 4), (5, 6), (3, 3)):
            assert equal(d.read_rows(name, start, stop), a[start:stop]), (name, start, stop)
    d.close()


def test_bool_bytes_other_than_0_and_1_read_as_true(tmp_path):
    hf = new_dir(tmp_path)
    craft(
        hf / si.WEIGHTS_FILE,
        {"m": {"dtype": "BOOL", "shape": [4], "data_offsets": [0, 4]}},
        bytes([0, 1, 2, 255]),
    )
    with HfDir.open(hf) as d:
        m = d.read("m")
        assert m.tolist() == [False, True, True, True] and m.view(np.uint8).tolist() == [0, 1, 1, 1]


def test_rows_are_one_read_of_their_bytes_and_bytes_read_counts_every_byte(tmp_path):
    hf = new_dir(tmp_path)
    a = values(np.float32, (10, 7))
    save_file({"w": a, "b": values(np.int8, (3,))}, str(hf / si.WEIGHTS_FILE))
    d = HfDir.open(hf)
    file = hf / si.WEIGHTS_FILE
    (n,) = struct.unpack("<Q", file.read_bytes()[:8])
    config = (hf / "config.json").stat().st_size
    assert d.bytes_read == config + 8 + n  # the config and the header, no data
    assert d.safetensors_bytes == file.stat().st_size
    assert (
        d.tensors["w"].start
        == 8 + n + json.loads(file.read_bytes()[8 : 8 + n])["w"]["data_offsets"][0]
    )
    before = d.bytes_read
    assert equal(d.read_rows("w", 2, 5), a[2:5])
    assert d.bytes_read - before == 3 * 7 * 4
    assert equal(d.read("w"), a)
    assert d.bytes_read - before == 3 * 7 * 4 + a.nbytes
    for start, stop in ((-1, 2), (5, 3), (0, 11)):
        with pytest.raises(UsageError, match="no rows"):
            d.read_rows("w", start, stop)
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        d.read("nope")
    d.close()
    with pytest.raises(UsageError, match="after close"):
        d.read("w")


def test_an_hf_dir_dropped_unclosed_leaves_no_descriptor_open(tmp_path):
    hf = new_dir(tmp_path)
    sharded(hf)
    fds = open_fds()
    d = HfDir.open(hf)
    assert len(open_fds() - fds) == 2  # one per shard, opened once
    del d
    assert open_fds() == fds


def test_a_sharded_directory_with_transformers_index(tmp_path):
    hf = new_dir(tmp_path)
    want = sharded(hf)
    with HfDir.open(str(hf)) as d:
        assert {k: t.file for k, t in d.tensors.items()} == json.loads(
            (hf / si.INDEX_FILE).read_text()
        )["weight_map"]
        for name, a in want.items():
            assert equal(d.read(name), a)
        assert equal(d.read_rows("lm_head.weight", 4, 12), want["lm_head.weight"][4:12])


def test_model_safetensors_wins_over_an_index_as_in_transformers(tmp_path):
    hf = new_dir(tmp_path)
    sharded(hf)
    save_file({"only": np.ones(3, np.float32)}, str(hf / si.WEIGHTS_FILE))
    with HfDir.open(hf) as d:
        assert list(d.tensors) == ["only"]


def test_threads_read_rows_at_once(tmp_path):
    hf = new_dir(tmp_path)
    a = values(np.float32, (512, 256))
    save_file({"w": a}, str(hf / si.WEIGHTS_FILE))
    d = HfDir.open(hf)
    before = d.bytes_read
    blocks = [(i, i + 16) for i in range(0, 512, 16)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        parts = list(pool.map(lambda b: d.read_rows("w", *b), blocks))
    assert equal(np.concatenate(parts), a)
    assert d.bytes_read - before == a.nbytes
    d.close()


def hub_cache(root: Path, repo: str = "models--org--tiny") -> tuple[Path, dict]:
    """A Hub cache repo as huggingface_hub lays it out: ``blobs/<sha256>``, ``refs/main``
    and ``snapshots/<rev>/<file> -> ../../blobs/<sha256>``; its snapshot directory."""
    src = new_dir(root / "download")
    want = sharded(src)
    rev = "0123456789abcdef0123456789abcdef01234567"
    blobs, snap = root / repo / "blobs", root / repo / "snapshots" / rev
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (root / repo / "refs").mkdir()
    (root / repo / "refs" / "main").write_text(rev)
    for f in src.iterdir():
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        (blobs / sha).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(f"../../blobs/{sha}")
    return snap, want


def test_a_hub_cache_snapshot_reads_through_its_links_into_blobs(tmp_path, opened):
    snap, want = hub_cache(tmp_path)
    with HfDir.open(snap) as d:
        for name, a in want.items():
            assert equal(d.read(name), a)
    repo = os.path.realpath(tmp_path / "models--org--tiny")
    assert files(opened) and all(p.startswith(f"{repo}/blobs/") for p in files(opened))
    assert all(p.startswith(f"{repo}/") for p in opened)  # nothing outside even walked


def test_remote_reads_through_epath(tmp_path, monkeypatch):
    """The object-store path (gs://: `_RemoteFile`), here on a local directory read through
    ``epath`` with a seek per read (what a handle without a ranged ``cat_file`` gets)."""
    hf = new_dir(tmp_path)
    want = sharded(hf)
    monkeypatch.setattr(si, "store_for", lambda p: types.SimpleNamespace(reads_files=False))
    monkeypatch.setattr(si, "REMOTE_PIECE", 100)  # several ranged reads per tensor
    with HfDir.open(hf) as d:
        assert all(isinstance(f, si._RemoteFile) for f in d._files.values())
        before = d.bytes_read
        for name, a in want.items():
            assert equal(d.read(name), a)
        assert equal(
            d.read_rows("model.embed_tokens.weight", 3, 9), want["model.embed_tokens.weight"][3:9]
        )
        assert d.bytes_read - before == sum(a.nbytes for a in want.values()) + 6 * 8 * 4


def test_a_file_cut_short_after_open_is_refused_on_read(tmp_path):
    hf = new_dir(tmp_path)
    save_file({"w": values(np.float32, (64, 64))}, str(hf / si.WEIGHTS_FILE))
    d = HfDir.open(hf)
    os.truncate(hf / si.WEIGHTS_FILE, d.tensors["w"].start + 100)
    with pytest.raises(HfInputError, match=r"model.safetensors: tensor 'w': the file is shorter"):
        d.read("w")
    d.close()


def test_no_memory_in_proportion_to_what_a_header_claims(tmp_path):
    """A header that claims 16 TiB, and a length prefix that claims 99 MB, in files of a
    few bytes: refused with nothing allocated in proportion."""
    claims = {
        "w": {"dtype": "F32", "shape": [1 << 21, 1 << 21], "data_offsets": [0, 1 << 44]},
    }
    cases = {
        "huge-tensor": lambda p: craft(p, claims, b"\0" * 16),
        "huge-prefix": lambda p: craft(p, b"{}", length=99_000_000),
        "huge-shape": lambda p: craft(
            p, {"w": {"dtype": "F32", "shape": [1 << 62] * 64, "data_offsets": [0, 16]}}, b"\0" * 16
        ),
    }
    for name, write in cases.items():
        hf = new_dir(tmp_path, name)
        write(hf / si.WEIGHTS_FILE)
        tracemalloc.start()
        try:
            with pytest.raises(HfInputError, match=r"model\.safetensors"):
                HfDir.open(hf)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, (name, peak)


def test_brackets_inside_strings_do_not_count_and_escapes_are_followed(tmp_path):
    """A header's shape is checked before it is parsed (`si._structure`), strings left out:
    brackets in a name or in metadata (behind escaped quotes and backslashes) are text, and
    a name ending in an escaped backslash ends where its quote does."""
    hf = new_dir(tmp_path)
    w = values(np.float32, (2,))
    odd = 'w"[[{\\"]]\\'
    header = {"__metadata__": {"format": 'p"t[[\\'}, odd: {**F32x2}}
    craft(hf / si.WEIGHTS_FILE, header, w.tobytes())
    with HfDir.open(hf) as d:
        assert equal(d.read(odd), w)
    craft(hf / si.WEIGHTS_FILE, b'{"w\\\\": [[], []]}', b"")  # the name: w, one backslash
    with pytest.raises(HfInputError, match="a list in it holds a list"):
        HfDir.open(hf)


def test_the_refusal_is_a_checkpoint_read_error():
    assert issubclass(HfInputError, CheckpointReadError)
    assert issubclass(HfInputError, si.CheckpointRefusedError)


# -- refusals: one crafted directory each --------------------------------------------------
# name -> builder(hf, outside, monkeypatch) -> the fragments the message must hold, each
# formatted with {hf} (the directory); ``outside`` holds a real, readable safetensors file
# (secret.safetensors) beside the directory, which must never be opened.
Builder = Callable[[Path, Path, pytest.MonkeyPatch], list[str]]
REFUSALS: dict[str, Builder] = {}


def refusal(fn: Builder) -> Builder:
    REFUSALS[fn.__name__] = fn
    return fn


def one(hf: Path, header: dict | bytes, data: bytes = b"", **kw) -> None:
    craft(hf / si.WEIGHTS_FILE, header, data, **kw)


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
WEIGHTS = "{hf}/model.safetensors"
INDEX = "{hf}/model.safetensors.index.json"


@refusal
def config_missing(hf, outside, mp):
    (hf / "config.json").unlink()
    one(hf, {"w": F32x2}, b"\0" * 8)
    return ["{hf}/config.json: missing"]


@refusal
def config_too_large(hf, outside, mp):
    mp.setattr(si, "CONFIG_LIMIT", 16)
    return ["{hf}/config.json: the config is", "more than the 16 read"]


def _text(file: str, text: str | bytes, fragment: str) -> Builder:
    """A refusal of ``file`` written as ``text``: the message names the file."""

    def build(hf, outside, mp):
        raw = text if isinstance(text, bytes) else text.encode()
        (hf / file).write_bytes(raw)
        return ["{hf}/" + file + ": ", fragment]

    return build


REFUSALS |= {
    "config_not_json": _text("config.json", '{"model_type": ', "the config is not valid JSON"),
    "config_not_an_object": _text("config.json", "[1, 2]", "the config is not a JSON object"),
    "config_not_utf8": _text("config.json", b'{"a": "\xff"}', "the config is not valid JSON"),
    "index_malformed": _text(si.INDEX_FILE, '{"weight_map": {"a": ', "is not valid JSON"),
    "index_nested_too_deeply": _text(si.INDEX_FILE, "[" * 100_000, "nested too deeply"),
    "index_not_an_object": _text(si.INDEX_FILE, '["weight_map"]', "is not a JSON object"),
    "index_without_weight_map": _text(
        si.INDEX_FILE, '{"metadata": {"total_size": 8}}', "its weight_map is None, not an object"
    ),
    "weight_map_a_list": _text(
        si.INDEX_FILE, '{"weight_map": ["a"]}', "its weight_map is ['a'], not an object"
    ),
    "weight_map_names_a_tensor_twice": _text(
        si.INDEX_FILE, '{"weight_map": {"w": "a", "w": "b"}}', "'w' is named twice in the index"
    ),
}


@refusal
def no_weights(hf, outside, mp):
    (hf / "pytorch_model.bin").write_bytes(b"x")
    return ["{hf}: neither model.safetensors nor model.safetensors.index.json"]


@refusal
def index_too_large(hf, outside, mp):
    sharded(hf)
    mp.setattr(si, "INDEX_LIMIT", 64)
    return [INDEX, "the index is", "more than the 64 read"]


@refusal
def weight_map_file_not_a_string(hf, outside, mp):
    write_index(hf, {"w": 1})
    return [INDEX, "tensor 'w': its file is 1, not a string"]


@refusal
def weight_map_names_a_tensor_twice(hf, outside, mp):
    sharded(hf)
    text = f'{{"weight_map": {{"w": "{SHARD1}", "w": "{SHARD2}"}}}}'
    (hf / si.INDEX_FILE).write_text(text)
    return [INDEX, "'w' is named twice in the index"]


def _leaves(rel: str, why: str) -> Builder:
    def build(hf, outside, mp):
        sharded(hf)
        write_index(hf, {"model.embed_tokens.weight": rel.format(outside=outside)})
        return [INDEX, "tensor 'model.embed_tokens.weight'", f"leaves {{hf}} ({why})"]

    return build


REFUSALS |= {
    "dotdot_to_a_real_file_outside": _leaves("../outside/secret.safetensors", "a '..' component"),
    "absolute_path_to_a_real_file": _leaves("{outside}/secret.safetensors", "an absolute path"),
    "empty_component": _leaves(f"sub//{SHARD1}", "an empty component"),
    "dot_component": _leaves(f"./{SHARD1}", "a '.' component"),
    "empty_name": _leaves("", "an empty path"),
    "nul_byte": _leaves(f"{SHARD1}\0.txt", "a NUL byte"),
}


@refusal
def symlink_out_of_the_directory(hf, outside, mp):
    sharded(hf)
    (hf / "evil.safetensors").symlink_to(outside / "secret.safetensors")
    write_index(hf, {"model.embed_tokens.weight": "evil.safetensors"})
    return ["{hf}/evil.safetensors: tensor 'model.embed_tokens.weight'", "outside {hf}"]


@refusal
def relative_symlink_out(hf, outside, mp):
    (hf / si.WEIGHTS_FILE).symlink_to("../outside/secret.safetensors")
    return [WEIGHTS + ": a link to", "outside {hf}"]


@refusal
def symlinked_folder_out(hf, outside, mp):
    (hf / "sub").symlink_to(outside)
    write_index(hf, {"secret": "sub/secret.safetensors"})
    return ["{hf}/sub/secret.safetensors: tensor 'secret'", "outside {hf}"]


@refusal
def a_symlink_loop(hf, outside, mp):
    (hf / si.WEIGHTS_FILE).symlink_to(si.WEIGHTS_FILE)
    return [WEIGHTS + ": cannot be read (Too many levels of symbolic links)"]


@refusal
def config_symlink_out(hf, outside, mp):
    (hf / "config.json").unlink()
    (outside / "config.json").write_text("{}")
    (hf / "config.json").symlink_to(outside / "config.json")
    return ["{hf}/config.json: a link to", "outside {hf}"]


@refusal
def a_fifo(hf, outside, mp):
    os.mkfifo(hf / si.WEIGHTS_FILE)  # opening it to read would wait for a writer
    return [WEIGHTS + ": not a regular file"]


@refusal
def a_directory(hf, outside, mp):
    sharded(hf)
    (hf / "dir.safetensors").mkdir()
    write_index(hf, {"model.embed_tokens.weight": "dir.safetensors"})
    return ["{hf}/dir.safetensors: tensor 'model.embed_tokens.weight'", "not a regular file"]


@refusal
def a_missing_shard(hf, outside, mp):
    sharded(hf)
    write_index(hf, {"model.embed_tokens.weight": "model-00003-of-00003.safetensors"})
    return ["{hf}/model-00003-of-00003.safetensors: tensor 'model.embed_tokens.weight'", "missing"]


def _header(header: dict | bytes, data: bytes, fragment: str, length: int | None = None):
    """A refusal of a ``model.safetensors`` crafted from ``header`` and ``data``."""

    def build(hf, outside, mp):
        craft(hf / si.WEIGHTS_FILE, header, data, length=length)
        return [WEIGHTS + ": " + fragment]

    return build


@refusal
def too_short_for_a_length(hf, outside, mp):
    (hf / si.WEIGHTS_FILE).write_bytes(b"\x10\0\0\0")
    return [WEIGHTS + ": 4 bytes, shorter than a safetensors header length"]


NOT_A_HEADER = "the header is not a safetensors header's JSON ("
IMPLAUSIBLE = "the header length its first 8 bytes give is implausible: "
TWICE = f'{{"w": {json.dumps(F32x2)}, "w": {json.dumps(F32x2)}}}'.encode()
NOT_STR_TO_STR = "its __metadata__ is not a mapping of strings to strings"
REFUSALS |= {
    "length_over_the_limit": _header(
        b"{}",
        b"",
        IMPLAUSIBLE + "over the limit of 100,000,000 bytes (the file has 10)",
        (1 << 64) - 1,
    ),
    "length_past_the_end": _header(
        {"w": F32x2}, b"\0" * 8, IMPLAUSIBLE + "past the end of the file's 77 bytes", 4096
    ),
    "header_not_utf8": _header(
        b'{"w\xff": 1}', b"", "the header is not valid JSON (not UTF-8 at byte 3)"
    ),
    "header_not_json": _header(b'{"w": {"dtype": "F32", ', b"", "the header is not valid JSON"),
    "header_not_an_object": _header(b"[]", b"", "the header is not a JSON object"),
    "header_names_a_tensor_twice": _header(TWICE, b"\0" * 8, "'w' is named twice in the header"),
    "metadata_not_a_mapping": _header(
        {"__metadata__": ["format", "pt"], "w": F32x2}, b"\0" * 8, NOT_STR_TO_STR
    ),
    "metadata_value_not_a_string": _header({"__metadata__": {"format": 1}}, b"", NOT_STR_TO_STR),
    # refused before the JSON is parsed (`_structure`): no tensor named
    "shape_of_65_dims": _header(
        {"w": {**F32x2, "shape": [1] * 65}}, b"\0" * 8, NOT_A_HEADER + "a list in it holds more"
    ),
    "a_list_of_lists": _header({"w": [[], []]}, b"", NOT_A_HEADER + "a list in it holds a list"),
    "an_object_in_an_entry": _header(
        {"w": {**F32x2, "dtype": {"F32": 1}}}, b"\0" * 8, NOT_A_HEADER + "an object inside"
    ),
    "lists_nested_50000_deep": _header(
        b'{"w": {"shape": [' + b"[" * 50_000, b"", NOT_A_HEADER + "a list in it holds a list"
    ),
    "objects_nested_50000_deep": _header(
        b'{"w": ' * 50_000, b"", NOT_A_HEADER + "nested deeper than 3 levels"
    ),
}


def _entry_refused(entry: object, fragment: str, data: bytes = b"\0" * 16) -> Builder:
    def build(hf, outside, mp):
        one(hf, {"ok": F32x2, "w": entry}, data)
        return [WEIGHTS + ": tensor 'w': ", fragment]

    return build


REFUSALS |= {
    "entry_not_an_object": _entry_refused(3, "its entry is 'int'"),
    "entry_without_shape": _entry_refused({"dtype": "F32", "data_offsets": [8, 16]}, "its entry"),
    "entry_with_a_fourth_key": _entry_refused({**F32x2, "extra": 1}, "not exactly dtype"),
    "dtype_unknown": _entry_refused({**F32x2, "dtype": "F128"}, "dtype 'F128' is not one"),
    "dtype_sub_byte": _entry_refused({**F32x2, "dtype": "F4"}, "dtype 'F4' is not one"),
    "dtype_not_a_string": _entry_refused({**F32x2, "dtype": 4}, "dtype 4 is not one"),
    "shape_not_a_list": _entry_refused({**F32x2, "shape": "2"}, "shape '2' is not a list"),
    "shape_negative": _entry_refused({**F32x2, "shape": [-2]}, "shape [-2] holds"),
    "shape_float": _entry_refused({**F32x2, "shape": [2.0]}, "shape [2.0] holds"),
    "shape_bool": _entry_refused({**F32x2, "shape": [True, 2]}, "shape [True, 2] holds"),
    "offsets_three": _entry_refused({**F32x2, "data_offsets": [0, 4, 8]}, "is not [begin, end]"),
    "offsets_floats": _entry_refused({**F32x2, "data_offsets": [8.0, 16]}, "is not [begin, end]"),
    "offsets_reversed": _entry_refused({**F32x2, "data_offsets": [16, 8]}, "are not a range"),
    "offsets_negative": _entry_refused({**F32x2, "data_offsets": [-8, 0]}, "are not a range"),
    "offsets_past_the_data": _entry_refused(
        {**F32x2, "data_offsets": [12, 20]}, "are not a range of its 16 bytes"
    ),
    "size_mismatch": _entry_refused({**F32x2, "shape": [3]}, "F32[3] is not the 8 bytes"),
    "size_overflowing_int64": _entry_refused(
        {**F32x2, "shape": [1 << 62, 1 << 62, 4]}, "is not the 8 bytes"
    ),
    "zero_dim_with_bytes": _entry_refused({**F32x2, "shape": [0, 2]}, "is not the 8 bytes"),
}


@refusal
def two_tensors_overlap(hf, outside, mp):
    one(hf, {"a": F32x2, "b": {**F32x2, "data_offsets": [4, 12]}}, b"\0" * 12)
    return [WEIGHTS + ": tensor 'b' overlaps tensor 'a'"]


@refusal
def a_tensor_in_two_shards(hf, outside, mp):
    sharded(hf)
    save_file(
        {"lm_head.weight": values(np.float16, (16, 8)), "a.bias": values(np.int64, (3,))},
        str(hf / SHARD2),
    )
    return ["{hf}/" + SHARD2 + ": tensor 'a.bias' is also in '" + SHARD1 + "'"]


def _remapped(edit: Callable[[dict], object], shard: str, fragment: str) -> Builder:
    """A refusal of ``shard`` once two shards' index has its weight_map edited."""

    def build(hf, outside, mp):
        sharded(hf)
        weight_map = json.loads((hf / si.INDEX_FILE).read_text())["weight_map"]
        edit(weight_map)
        write_index(hf, weight_map)
        return ["{hf}/" + shard + ": tensor " + fragment]

    return build


REFUSALS |= {
    "a_tensor_the_index_maps_elsewhere": _remapped(
        lambda m: m.update({"a.bias": SHARD2}),
        SHARD1,
        f"'a.bias' is here, but {si.INDEX_FILE} maps it to '{SHARD2}'",
    ),
    "a_tensor_the_index_does_not_list": _remapped(
        lambda m: m.pop("a.bias"), SHARD1, f"'a.bias' is here, but {si.INDEX_FILE} does not list it"
    ),
    "a_tensor_listed_but_not_in_its_shard": _remapped(
        lambda m: m.update({"ghost.weight": SHARD2}),
        SHARD2,
        f"'ghost.weight': {si.INDEX_FILE} maps it here, but it is not here",
    ),
}


@refusal
def a_newline_in_a_tensor_name(hf, outside, mp):
    one(hf, {"w\nerror: all good": {**F32x2, "dtype": "X"}}, b"\0" * 8)
    return [WEIGHTS + ": tensor 'w\\nerror: all good': dtype 'X'"]


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_refusal(case, tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"secret": np.arange(4, dtype=np.float32)}, str(outside / "secret.safetensors"))
    hf = new_dir(tmp_path)
    fragments = REFUSALS[case](hf, outside, monkeypatch)
    before, fds = digest(tmp_path), open_fds()
    spied = spy_on_open(monkeypatch)
    with pytest.raises(HfInputError) as e:
        HfDir.open(hf)
    seen = list(spied)  # what the open opened
    message = str(e.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment.format(hf=hf) in message, (fragment.format(hf=hf), message)
    root = os.path.realpath(hf) + "/"
    assert all(p.startswith(root) for p in seen), (seen, message)  # nothing outside opened
    assert digest(tmp_path) == before  # nothing written
    assert not open_fds() - fds  # nothing left open


def test_a_hub_cache_snapshot_follows_links_into_its_own_blobs_only(tmp_path, opened):
    snap, _ = hub_cache(tmp_path)
    other, _ = hub_cache(tmp_path / "elsewhere", "models--org--other")
    (snap / SHARD2).unlink()
    (snap / SHARD2).symlink_to(os.path.realpath(other / SHARD2))  # another repo's blob
    with pytest.raises(
        HfInputError, match=rf"{SHARD2}: tensor .* a link to .*models--org--other/blobs/"
    ):
        HfDir.open(snap)
    # the same layout under a folder that is not "snapshots": blobs/ is outside it
    moved = tmp_path / "models--org--tiny" / "not-snapshots"
    (tmp_path / "models--org--tiny" / "snapshots").rename(moved)
    (snap_moved,) = moved.iterdir()
    with pytest.raises(HfInputError, match=r"config.json: a link to .*, outside"):
        HfDir.open(snap_moved)
    assert not [p for p in opened if "models--org--other" in p]
    assert not [p for p in files(opened) if "not-snapshots" in p]
