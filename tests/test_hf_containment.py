"""One containment rule for a Hugging Face directory, with no way around it (issue 58).

Every file of a local directory is opened by a walk from a directory descriptor, one
component at a time with ``O_NOFOLLOW`` (`storage.containment.open_beneath`), its symlinks
read and walked by the walk itself; a Hub cache snapshot's links are followed only into a
real ``blobs/`` directory of its own repo. Here, with real safetensors files written by
``safetensors.numpy.save_file``:

- ``blobs`` a symlink out of the repo (to a folder holding a blob of the same name and other
  values) is refused, naming it; so is a snapshot of the same layout outside a
  ``models--`` repo; links that stay inside the directory are still followed;
- two races, an intermediate folder (or ``blobs``) swapped for a symlink to an outside one
  by a thread while the reader opens and reads the directory again and again: no read ever
  returns the outside values (3,000 tries; 30,000 in the slow pass);
- a refusal never shows bytes of the file it refused ("TOPSECRE" as an integer);
- a 100 MB header of nested lists is refused, in a child under a memory cap, for a small
  part of what parsing it cost (2.68 GB).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import address_space_cap, child_env
from safetensors.numpy import save_file

from orbax_maxtext_layout.formats import safetensors_reader as si
from orbax_maxtext_layout.formats.safetensors_reader import HfDir, HfInputError

HERE = Path(__file__).parent
CONFIG = {"model_type": "llama", "hidden_size": 8}
REV = "0123456789abcdef0123456789abcdef01234567"
SHARD = "model-00001-of-00001.safetensors"
INSIDE, OUTSIDE = 1.0, 2.0  # the values of "w" in the directory and outside it


def _shard(path: Path, value: float) -> bytes:
    save_file({"w": np.full((64,), value, np.float32)}, str(path))
    return path.read_bytes()


def _folder(root: Path) -> tuple[Path, Path, Path]:
    """A directory whose index maps ``w`` to ``sub/<shard>``, and ``outside/<shard>`` beside
    it (other values): the directory, the folder to swap, the folder to swap it for."""
    hf = root / "hf"
    (hf / "sub").mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps(CONFIG))
    (hf / si.INDEX_FILE).write_text(json.dumps({"weight_map": {"w": f"sub/{SHARD}"}}))
    _shard(hf / "sub" / SHARD, INSIDE)
    (root / "outside").mkdir()
    _shard(root / "outside" / SHARD, OUTSIDE)
    return hf, hf / "sub", root / "outside"


def _hub(root: Path) -> tuple[Path, Path, Path]:
    """A Hub cache repo (``models--org--tiny``: ``snapshots/<rev>/<file> -> ../../blobs/<sha>``)
    and ``outside/blobs`` beside it, the same blob names, the shard's with other values: the
    snapshot, its repo's ``blobs``, the outside ``blobs``."""
    repo = root / "models--org--tiny"
    blobs, snap, other = repo / "blobs", repo / "snapshots" / REV, root / "outside" / "blobs"
    for d in (blobs, snap, other, repo / "refs"):
        d.mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    files = {"config.json": json.dumps(CONFIG).encode()}
    files[si.WEIGHTS_FILE] = _shard(root / "w.safetensors", INSIDE)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (blobs / sha).write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{sha}")
        if name == si.WEIGHTS_FILE:
            _shard(other / sha, OUTSIDE)
        else:
            (other / sha).write_bytes(data)
    return snap, blobs, other


LAYOUTS = {"folder": _folder, "blobs": _hub}


def _read(hf: Path) -> float | None:
    """``w``'s value as the reader reads the directory, or None where it is refused."""
    try:
        with HfDir.open(hf) as d:
            values = d.read("w")
    except HfInputError:
        return None
    assert len(set(values.tolist())) == 1
    return float(values[0])


def test_a_hub_snapshot_whose_blobs_is_a_link_out_of_its_repo_is_refused(tmp_path):
    snap, blobs, other = _hub(tmp_path)
    assert _read(snap) == INSIDE
    shutil.copytree(blobs, blobs.with_name("elsewhere"))
    shutil.rmtree(blobs)
    blobs.symlink_to(other)  # absolute
    with pytest.raises(HfInputError, match=r"by way of '.*/models--org--tiny/blobs'") as e:
        HfDir.open(snap)
    assert "outside" in str(e.value) and str(other) in str(e.value)
    blobs.unlink()
    blobs.symlink_to("../outside/blobs")  # relative
    with pytest.raises(HfInputError, match=r"by way of '.*/models--org--tiny/blobs'"):
        HfDir.open(snap)
    blobs.unlink()
    blobs.symlink_to("elsewhere")  # the same blobs, inside the repo, but not its blobs/
    with pytest.raises(HfInputError, match=r"a link to '.*/models--org--tiny/elsewhere/"):
        HfDir.open(snap)


def test_links_that_stay_inside_the_directory_are_followed(tmp_path):
    """The walk follows what resolving the path followed, as long as it stays inside: an
    absolute link to a file of the directory, a relative one through ``..`` and a folder
    link, a chain of links."""
    hf, sub, _ = _folder(tmp_path)
    (hf / "deep").mkdir()
    (hf / "deep" / "up").symlink_to("../sub")  # a folder link through ..
    (hf / "abs.safetensors").symlink_to(sub / SHARD)  # absolute, inside
    (hf / "chain.safetensors").symlink_to("abs.safetensors")
    for rel in (f"deep/up/{SHARD}", "abs.safetensors", "chain.safetensors"):
        (hf / si.INDEX_FILE).write_text(json.dumps({"weight_map": {"w": rel}}))
        assert _read(hf) == INSIDE, rel
    (hf / "deep" / "out").symlink_to("../../outside")
    (hf / si.INDEX_FILE).write_text(json.dumps({"weight_map": {"w": f"deep/out/{SHARD}"}}))
    with pytest.raises(HfInputError, match=r"by way of '.*/hf/deep/out'"):
        HfDir.open(hf)


def test_outside_the_hub_layout_a_snapshot_s_links_into_blobs_are_refused(tmp_path):
    """The exception is a Hub cache repo's (``models--<org>--<name>``): the same layout under
    another name is a plain directory whose links leave it."""
    snap, _, _ = _hub(tmp_path)
    assert _read(snap) == INSIDE
    (tmp_path / "models--org--tiny").rename(tmp_path / "org-tiny")
    with pytest.raises(HfInputError, match=r"config.json: a link to .*/org-tiny/blobs/.*outside"):
        HfDir.open(tmp_path / "org-tiny" / "snapshots" / REV)


_LIBC = ctypes.CDLL(None, use_errno=True)
_RENAME_EXCHANGE = 2  # renameat2(2): two names swapped in one step


def _exchange(a: Path, b: Path) -> None:
    """``a`` and ``b`` swapped atomically (``renameat2``'s ``RENAME_EXCHANGE``): the name is
    never missing, so every open meets one or the other."""
    at = -100  # AT_FDCWD
    if _LIBC.renameat2(at, bytes(a), at, bytes(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def _exchanges(a: Path, b: Path) -> bool:
    """Whether this kernel swaps two names in one step (gVisor has no ``RENAME_EXCHANGE``,
    an old C library no ``renameat2``)."""
    try:
        _exchange(a, b)
        _exchange(a, b)
    except (AttributeError, OSError):
        return False
    return True


def _swap(folder: Path, outside: Path, stop: threading.Event) -> None:
    """``folder`` replaced by a symlink to ``outside`` and back, until ``stop``: atomically
    where the kernel can, else by renames (the name then goes missing in between)."""
    link = folder.with_name(folder.name + ".link")
    link.symlink_to(outside)
    if _exchanges(folder, link):
        while not stop.is_set():
            _exchange(folder, link)
        return
    real = folder.with_name(folder.name + ".real")
    while not stop.is_set():
        os.rename(folder, real)
        os.rename(link, folder)
        os.rename(folder, link)
        os.rename(real, folder)


def _race(tmp_path: Path, layout: str, tries: int) -> dict:
    hf, folder, outside = LAYOUTS[layout](tmp_path)
    seen = {INSIDE: 0, OUTSIDE: 0, None: 0}
    stop = threading.Event()
    swapper = threading.Thread(target=_swap, args=(folder, outside, stop), daemon=True)
    swapper.start()
    try:
        for _ in range(tries):
            seen[_read(hf)] += 1
    finally:
        stop.set()
        swapper.join()
    return seen


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_folder_swapped_for_a_link_out_is_never_read_through(tmp_path, layout):
    seen = _race(tmp_path, layout, 3000)
    assert seen[OUTSIDE] == 0, seen
    assert seen[INSIDE] and seen[None], seen  # the swaps landed during opens, both ways


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_folder_swapped_for_a_link_out_is_never_read_through_long(tmp_path, layout):
    seen = _race(tmp_path, layout, 30_000)
    assert seen[OUTSIDE] == 0, seen


SECRETS = {
    "text": b"TOPSECRET: the launch codes are 0000\n",
    "binary": b"\x93\xa7\xff\x81secret\xfe\x80" * 4,
    "short-length": struct.pack("<Q", 10) + b'{"w\xfe\xfd": 1}',  # a header, not UTF-8
}


@pytest.mark.parametrize("kind", sorted(SECRETS))
def test_a_refusal_never_shows_bytes_of_the_file_it_refuses(tmp_path, kind):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(CONFIG))
    secret = SECRETS[kind]
    (hf / si.WEIGHTS_FILE).write_bytes(secret)
    with pytest.raises(HfInputError) as e:
        HfDir.open(hf)
    message = str(e.value)
    assert message.startswith(f"{hf}/{si.WEIGHTS_FILE}: "), message
    assert f"file has {len(secret)}" in message or "not UTF-8 at byte 3" in message, message
    shown = {str(int.from_bytes(secret[:8], "little")), secret[:8].hex(), "TOPSECRE"}
    shown |= {f"\\x{b:02x}" for b in secret if b > 0x7F} | {f"0x{b:02x}" for b in secret}
    assert not [s for s in shown if s in message], message


def test_a_header_of_100mb_of_nested_lists_is_refused_for_little_memory(tmp_path):
    """Python's parser built every list first (2.68 GB at 100 MB; the safetensors library
    needs 111 MB to refuse it): refused before the parse, in a child under a memory cap,
    for at most 3 times the header's bytes more than the child held before."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(CONFIG))
    text = b'{"w": {"dtype": "F32", "shape": [' + b"[]," * 33_000_000 + b"[]]}}"
    assert len(text) < si.HEADER_LIMIT
    with open(hf / si.WEIGHTS_FILE, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
    del text
    argv = ["import-hf", str(hf), "--out", str(tmp_path / "out"), "--maxtext-config", "base.yml"]
    res = subprocess.run(
        [sys.executable, str(HERE / "hostile_child.py"), str(address_space_cap()),
         json.dumps([{"cli": argv}])],
        capture_output=True, text=True, timeout=600, env=child_env(),
    )  # fmt: skip
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert res.returncode == 0 and len(lines) == 2, res.stderr[-3000:]
    started, got = lines
    assert got["rc"] == 1 and "Traceback" not in got["stderr"], got
    assert f"{si.WEIGHTS_FILE}: the header is not a safetensors header" in got["stderr"], got
    grew = (got["peak_rss_kib"] - started["peak_rss_kib"]) << 10
    assert grew < 3 * 100_000_000, (grew >> 20, got)
    assert not (tmp_path / "out").exists()
