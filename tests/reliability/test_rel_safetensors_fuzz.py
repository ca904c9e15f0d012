"""Fuzz (seeded) of Hugging Face directories under `formats.safetensors_reader.HfDir` (issue 43).

Two directories are written here: ``single`` (one ``model.safetensors`` written by
``safetensors.numpy``) and ``sharded`` (two shards and transformers' index, beside links
in and out of it, a FIFO and a folder), with a real, readable safetensors file planted
outside them (the bait). Each case replaces one file of them with a damaged copy:

- a shard truncated at every few offsets (every offset with OMTL_RELIABILITY_FULL=1);
- bits flipped in its header, the length prefix included;
- its header JSON edited (dtypes, shapes, data_offsets, keys, names, ``__metadata__``, the
  header's type, a name twice, the length prefix), then written back;
- the index edited (``weight_map`` entries pointing at ``..``, absolute paths, links out,
  the FIFO, the folder, missing files, other shards; names added, dropped or renamed).

A child under a memory cap (``RLIMIT_AS``) opens the directory, each case under a time
bound, and reads every tensor whole and by rows. Each case may only:

- be refused: `HfInputError`, one line naming a file of the directory; or
- open, and read consistently: each tensor's bytes are the file's at its offsets, its size
  its dtype times its shape, its rows the rows of the whole, no two tensors overlapping, the
  bytes counted; and equal to what the safetensors library reads where it reads the file.

Never another exception, never a hang, never a file opened outside the directory (the
bait), never a write. Case counts: `rel_support.scale` (CI / OMTL_RELIABILITY_FULL=1).
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import rel_support as S
from conftest import address_space_cap
from safetensors.numpy import save_file

CAP = address_space_cap()  # the child's address space (scales with the cores)
CASE_SECONDS = 20  # the time bound of one case (each takes milliseconds)
TRUNCATE_EVERY = S.scale(3, 1)  # bytes between truncation points in a header
FLIPS = S.scale(250, 4000)
EDITS = S.scale(300, 5000)
INDEX_EDITS = S.scale(150, 2500)
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
ALIAS = "alias.safetensors"  # a link inside the directory, to SHARD1
GOOD_FILES = {SHARD1, SHARD2, ALIAS}  # what an index that opens may name


# -- the directories -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    rng = np.random.default_rng(S.SEED)
    world = tmp_path_factory.mktemp("st-fuzz").resolve()
    single = world / "single"
    single.mkdir()
    (single / "config.json").write_text('{"model_type": "llama"}')
    save_file(
        {
            "a.f32": rng.standard_normal((4, 6)).astype(np.float32),
            "b.i64": rng.integers(-(1 << 40), 1 << 40, (3,)),
            "c.bool": rng.integers(0, 2, (5,)).astype(bool),
            "d.f16": rng.standard_normal((2, 3, 4)).astype(np.float16),
            "e.u8": rng.integers(0, 256, (7,)).astype(np.uint8),
            "f.scalar": np.array(1.25),
            "g.empty": np.zeros((0, 3), np.int32),
            "h.i8": rng.integers(-128, 128, (2, 2)).astype(np.int8),
        },
        str(single / WEIGHTS),
        metadata={"format": "pt"},
    )
    sharded = world / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text('{"model_type": "llama"}')
    s1 = {"x.w": rng.standard_normal((4, 4)).astype(np.float32), "x.b": np.arange(2)}
    s2 = {"y.w": rng.standard_normal((3, 5)).astype(np.float16), "y.m": np.ones(4, bool)}
    save_file(s1, str(sharded / SHARD1), metadata={"format": "pt"})
    save_file(s2, str(sharded / SHARD2), metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(s1, SHARD1), **dict.fromkeys(s2, SHARD2)}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (sharded / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    save_file({"x.w": np.ones((4, 4), np.float32)}, str(world / "bait.safetensors"))
    (sharded / "link.safetensors").symlink_to("../bait.safetensors")
    (sharded / ALIAS).symlink_to(SHARD1)
    os.mkfifo(sharded / "fifo")
    (sharded / "subdir").mkdir()
    return world


def digest(world: Path) -> dict[str, str]:
    import hashlib

    out = {}
    for p in sorted(world.rglob("*")):
        if p.is_symlink():
            out[str(p)] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[str(p)] = "not a file"
    return out


# -- the cases -------------------------------------------------------------------------------
def split(data: bytes) -> tuple[int, dict]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def truncations(data: bytes) -> list[bytes]:
    n, _ = split(data)
    cuts = [*range(0, 8 + n, TRUNCATE_EVERY), *range(8 + n, len(data), 16)]
    return [data[:k] for k in cuts]


def flips(data: bytes, rng: random.Random) -> bytes:
    n, _ = split(data)
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(8) if rng.random() < 0.25 else rng.randrange(8 + n)
        b[at] ^= rng.randint(1, 255)
    return bytes(b)


DTYPES = ["BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16", "F32",
          "F64", "C64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F128", "", "f32", 4,
          None, ["F32"]]  # fmt: skip
DIMS = [0, 1, 2, 3, 4, 5, 7, 8, 16, -1, 1 << 31, 1 << 32, 1 << 62, 1 << 64, 1.0, "2", True, None]
OFFSETS = [0, 1, 8, 16, 24, 100, 4096, -1, -8, 1 << 63, 1 << 64, 2.0, "8", None]
NAMES = ["", "__metadata__", "a.f32", "x.w", "é", "\n", "n" * 5000, "y.m", "z"]


def _shape(rng: random.Random, old: list):
    pick = rng.randrange(6)
    if pick == 0:
        return [rng.choice(DIMS) for _ in range(rng.randint(0, 4))]
    if pick == 1 and isinstance(old, list) and old:
        new = list(old)
        i = rng.randrange(len(new))
        new[i] = new[i] + rng.choice([-1, 1]) if type(new[i]) is int else 1
        return new
    if pick == 2:
        return [1] * rng.choice([64, 65, 1000])
    if pick == 3 and isinstance(old, list):
        return list(reversed(old))
    return rng.choice([None, "3", 3, {}, [[2]], []])


def _offsets(rng: random.Random, old, others: list):
    pick = rng.randrange(6)
    if pick == 0:
        return [rng.choice(OFFSETS), rng.choice(OFFSETS)]
    if pick == 1 and isinstance(old, list) and len(old) == 2 and all(type(o) is int for o in old):
        k = rng.choice([-8, -4, -1, 1, 4, 8])
        return [old[0] + k, old[1] + k] if rng.random() < 0.5 else [old[0], old[1] + k]
    if pick == 2 and isinstance(old, list):
        return list(reversed(old))
    if pick == 3 and others:
        return rng.choice(others)  # another tensor's: an overlap
    return rng.choice([None, [0], [0, 8, 16], "0-8", {}])


def edit_header(h: dict, rng: random.Random) -> dict | list | str | int | None:
    """``h`` (a parsed header) with 1-3 random edits, or replaced by another JSON value."""
    if rng.random() < 0.05:
        return rng.choice([[], None, 3, "x", [h], {"__metadata__": h}])
    h = dict(h)
    for _ in range(rng.randint(1, 3)):
        names = [k for k in h if k != "__metadata__"] or ["t"]
        name = rng.choice(names)
        entry = dict(h[name]) if isinstance(h.get(name), dict) else {}
        others = [e.get("data_offsets") for k, e in h.items() if k != name and isinstance(e, dict)]
        op = rng.randrange(11)
        if op == 0:
            entry["dtype"] = rng.choice(DTYPES)
        elif op == 1:
            entry["shape"] = _shape(rng, entry.get("shape"))
        elif op == 2:
            entry["data_offsets"] = _offsets(rng, entry.get("data_offsets"), others)
        elif op == 3 and entry:
            del entry[rng.choice(sorted(entry))]
        elif op == 4:
            entry[rng.choice(["extra", "dtype ", "offsets"])] = 1
        elif op == 5:
            h[name] = rng.choice([3, "x", [], None, [entry]])
            continue
        elif op == 6:
            h.pop(name, None)
            continue
        elif op == 7:  # a second name for the same bytes
            h[rng.choice(NAMES)] = entry
            continue
        elif op == 8:  # renamed
            h[rng.choice(NAMES)] = h.pop(name, entry)
            continue
        elif op == 9:
            h["__metadata__"] = rng.choice([None, [1], {"format": 1}, "pt", {"format": "pt"}, {}])
            continue
        else:  # the dtype and shape changed together, keeping the byte count
            size = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1}
            st = rng.choice(sorted(size))
            span = entry.get("data_offsets", [0, 0])
            if isinstance(span, list) and len(span) == 2 and all(type(o) is int for o in span):
                n = span[1] - span[0]
                if n >= 0 and n % size[st] == 0:
                    entry["dtype"], entry["shape"] = st, [n // size[st]]
        h[name] = entry
    return h


def serialize(h, rng: random.Random, data: bytes) -> bytes:
    """``h`` written back as a header: sometimes non-ASCII as UTF-8, padded, a name twice,
    or nested deeply; its length prefix right, or (one case in ten) wrong."""
    text = json.dumps(h, ensure_ascii=rng.random() < 0.7)
    if isinstance(h, dict) and h and rng.random() < 0.05:
        k, v = next(iter(h.items()))
        text = "{" + json.dumps(k) + ":" + json.dumps(v) + "," + text[1:]
    if rng.random() < 0.02:
        text = "[" * 50_000 + "]" * 50_000
    raw = text.encode() + b" " * rng.choice([0, 0, 3, 8])
    n = len(raw)
    if rng.random() < 0.1:
        n = rng.choice([n - 1, n + 1, n + 8, 0, 1 << 32, (1 << 64) - 1, 100_000_001])
    return struct.pack("<Q", n) + raw + data


PATHS = [SHARD1, SHARD2, ALIAS, "../bait.safetensors", "link.safetensors", "fifo", "subdir",
         "config.json", INDEX, "missing.safetensors", f"./{SHARD1}", f"sub//{SHARD1}",
         f"subdir/../{SHARD1}", "", "\0", f"{SHARD1}/", "/etc/passwd", 5, None, [SHARD1]]  # fmt: skip


def edit_index(index: dict, rng: random.Random) -> bytes:
    index = json.loads(json.dumps(index))
    wm = index["weight_map"]
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(7)
        name = rng.choice(sorted(wm) or ["t"])
        if op < 3:
            wm[name] = rng.choice(PATHS)
        elif op == 3:
            wm.pop(name, None)
        elif op == 4:
            wm[rng.choice(NAMES)] = rng.choice(PATHS)
        elif op == 5:
            wm[rng.choice(NAMES)] = wm.pop(name, SHARD1)
        else:
            index["weight_map"] = rng.choice([None, [], "x", {}, {n: SHARD1 for n in wm}])
            break
    text = json.dumps(index, indent=2, sort_keys=True)
    if rng.random() < 0.1:
        text = text[: rng.randrange(len(text))]
    return text.encode()


def draw_cases(world: Path) -> list[dict]:
    """Every case: first each directory as written (must open), then the edits."""
    rng = random.Random(S.SEED)
    targets = [("single", WEIGHTS), ("sharded", SHARD2)]
    cases = [{"dir": d, "file": f, "kind": "original", "value": ""} for d, f in targets]
    for d, f in targets:
        data = (world / d / f).read_bytes()
        cases += [
            {"dir": d, "file": f, "kind": "truncated", "value": v.hex()} for v in truncations(data)
        ]
    for kind, count in (("flipped", FLIPS), ("edited", EDITS)):
        for _ in range(count):
            d, f = targets[0] if rng.random() < 0.75 else targets[1]
            data = (world / d / f).read_bytes()
            if kind == "flipped":
                value = flips(data, rng)
            else:
                n, h = split(data)
                value = serialize(edit_header(h, rng), rng, data[8 + n :])
            cases.append({"dir": d, "file": f, "kind": kind, "value": value.hex()})
    index = json.loads((world / "sharded" / INDEX).read_text())
    aliased = {k: ALIAS if v == SHARD1 else v for k, v in index["weight_map"].items()}
    for weight_map in (aliased, dict(reversed(index["weight_map"].items()))):  # both open
        value = json.dumps({"weight_map": weight_map}).encode()
        cases.append({"dir": "sharded", "file": INDEX, "kind": "index", "value": value.hex()})
    for _ in range(INDEX_EDITS):
        value = edit_index(index, rng)
        cases.append({"dir": "sharded", "file": INDEX, "kind": "index", "value": value.hex()})
    return cases


# -- the child -------------------------------------------------------------------------------
CHILD = r'''
import json, os, resource, signal, stat, sys
from pathlib import Path

cap, seconds, world, cases, out = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], sys.argv[5]
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
import numpy as np
from safetensors.numpy import load_file
from orbax_maxtext_layout.formats.safetensors_reader import HfDir, HfInputError


class Hang(BaseException):
    pass


def on_alarm(*_):
    raise Hang()


signal.signal(signal.SIGALRM, on_alarm)
opened = []
real_open = os.open


def spy(path, flags, *args, **kwargs):
    # what the kernel opened (a walk opens each component from its parent's descriptor), a
    # directory's path with a trailing "/"
    fd = real_open(path, flags, *args, **kwargs)
    real = os.readlink(f"/proc/self/fd/{fd}")
    opened.append(real + "/" if stat.S_ISDIR(os.fstat(fd).st_mode) else real)
    return fd


def raw(a):
    a = np.ascontiguousarray(a)
    return (a.view(np.uint8) != 0).tobytes() if a.dtype == np.bool_ else a.tobytes()


def check(hf):
    """'ok', or what is wrong with what HfDir read."""
    with HfDir.open(hf) as d:
        files = {t.file: (hf / t.file).read_bytes() for t in d.tensors.values()}
        counted = d.bytes_read
        spans = []
        for name, t in d.tensors.items():
            if t.nbytes != t.dtype.itemsize * int(np.prod(t.shape, dtype=object)):
                return f"wrong: {name}: {t.nbytes} bytes for {t.dtype}{t.shape}"
            data = files[t.file][t.start : t.start + t.nbytes]
            if len(data) != t.nbytes or t.start < 8:
                return f"wrong: {name}: [{t.start}, +{t.nbytes}) is not in its file"
            a = d.read(name)
            counted += t.nbytes
            if a.dtype != t.dtype or a.shape != t.shape or not a.flags.c_contiguous:
                return f"wrong: {name}: read as {a.dtype}{a.shape}"
            want = data if t.dtype != np.bool_ else bytes(int(x != 0) for x in data)
            if a.tobytes() != want:
                return f"wrong: {name}: other bytes than its file's"
            if t.shape and t.shape[0] > 1:
                rows = d.read_rows(name, 1, t.shape[0])
                counted += rows.nbytes
                if rows.tobytes() != a[1:].tobytes():
                    return f"wrong: {name}: rows differ from the whole"
            if t.nbytes:
                spans.append((t.file, t.start, t.start + t.nbytes, name))
        spans.sort()
        for (f1, _, e1, n1), (f2, b2, _, n2) in zip(spans, spans[1:]):
            if f1 == f2 and b2 < e1:
                return f"wrong: {n1} and {n2} overlap"
        if d.bytes_read != counted:
            return f"wrong: bytes_read {d.bytes_read}, read {counted}"
        if (hf / "model.safetensors").exists():
            try:
                stock = load_file(str(hf / "model.safetensors"))
            except Exception:
                return "ok"
            if sorted(stock) != sorted(d.tensors):
                return f"wrong: safetensors reads {sorted(stock)}"
            for name, a in stock.items():
                if raw(a) != raw(d.read(name)) or a.shape != d.tensors[name].shape:
                    return f"wrong: {name}: safetensors reads other values"
        return "ok"


with open(out, "w") as results:
    for case in json.loads(Path(cases).read_text()):
        hf = world / case["dir"]
        target = hf / case["file"]
        original = target.read_bytes()
        if case["kind"] != "original":
            target.write_bytes(bytes.fromhex(case["value"]))
        opened.clear()
        os.open = spy
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            got = {"outcome": check(hf)}
        except HfInputError as e:
            got = {"outcome": "refused", "message": str(e)}
        except Hang:
            got = {"outcome": "hang"}
        except BaseException as e:
            got = {"outcome": f"escaped: {type(e).__name__}: {e}"[:400]}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            os.open = real_open
        root = os.path.realpath(hf) + "/"
        got["outside"] = [p for p in opened if not p.startswith(root)]
        target.write_bytes(original)
        results.write(json.dumps(got) + "\n")
        results.flush()
'''


def leaves(rel) -> bool:
    """containment's rule, written out again: the spec the reader is held to."""
    return isinstance(rel, str) and (
        not rel
        or "\0" in rel
        or rel.startswith("/")
        or any(p in ("", ".", "..") for p in rel.split("/"))
    )


def findings(world: Path, cases: list[dict], results: list[dict]) -> list[str]:
    bad = []
    for case, got in zip(cases, results, strict=True):
        value = bytes.fromhex(case["value"])
        where = f"{case['kind']} {case['dir']}/{case['file']} ({len(value)} bytes: {value[:120]!r})"
        outcome = got["outcome"]
        if case["kind"] == "original" and outcome != "ok":
            bad.append(f"the original did not open: {outcome} ({where})")
        if got["outside"]:
            bad.append(f"opened outside the directory: {got['outside']} ({where})")
        if outcome == "refused":
            message = got["message"]
            if "\n" in message or not message.startswith(str(world / case["dir"])):
                bad.append(f"refused with {message!r}: not one line naming a file ({where})")
        elif outcome != "ok":
            bad.append(f"{outcome} ({where})")
        elif case["kind"] == "index":
            index = json.loads(value)
            named = set(index["weight_map"].values())
            if not named <= GOOD_FILES or any(leaves(r) for r in named):
                bad.append(f"opened an index naming {sorted(map(repr, named))} ({where})")
    return bad


def run_child(world: Path, cases: list[dict], tmp_path: Path) -> list[dict]:
    """Each case's outcome in the child; every case must end, and the child exit 0."""
    spec, out = tmp_path / "cases.json", tmp_path / "results.jsonl"
    spec.write_text(json.dumps(cases))
    args = [str(CAP), str(CASE_SECONDS), str(world), str(spec), str(out)]
    cmd = [sys.executable, "-c", CHILD, *args]
    env = {**os.environ, **S.child_env()}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=S.REPO, env=env)
    done = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if res.returncode != 0 or len(done) != len(cases):
        stop = cases[len(done)] if len(done) < len(cases) else {}
        pytest.fail(
            f"the child ended with {res.returncode} in case {len(done)} of {len(cases)} "
            f"({stop.get('kind')} {stop.get('dir')}/{stop.get('file')}: "
            f"{bytes.fromhex(stop.get('value', ''))[:200]!r}): {res.stderr[-3000:]}"
        )
    return done


def test_hf_dir_fuzz_in_a_capped_child(world, tmp_path):
    cases = draw_cases(world)
    before = digest(world)
    results = run_child(world, cases, tmp_path)
    assert digest(world) == before  # nothing written, every damaged file put back
    bad = findings(world, cases, results)
    assert not bad, f"{len(bad)} of {len(cases)} cases:\n" + "\n".join(bad[:30])
    by_kind: dict[str, set[str]] = {}
    for case, got in zip(cases, results, strict=True):
        by_kind.setdefault(case["kind"], set()).add(got["outcome"])
    # edits both open (what the checks allow: a name, a dtype of the same size) and are
    # refused; a flipped bit almost always breaks the header
    assert by_kind["edited"] == by_kind["index"] == {"ok", "refused"}, by_kind
    assert "refused" in by_kind["flipped"], by_kind
    assert by_kind["truncated"] == {"refused"}  # safetensors' writer leaves no slack
    S.count("fuzzed", len(cases))
