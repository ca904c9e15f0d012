"""Stored values read through read-only mappings of their data files (`storage.mapped`):
the same bytes as ``os.preadv`` reads, each piece's pages out of the process once the next
is read, and a data file cut short read the old way, which reports it."""

from __future__ import annotations

import os

import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import NOT_MAPPED, files_are_mapped
from etils import epath

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.errors import CheckpointReadError
from orbax_maxtext_layout.orbax_io import values
from orbax_maxtext_layout.orbax_io.reader import ItemReader
from orbax_maxtext_layout.storage import mapped
from orbax_maxtext_layout.storage.mapped import MappedFiles

NAME = "params.params.w"
linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's smaps")

needs_mapping = pytest.mark.skipif(not files_are_mapped(), reason=NOT_MAPPED)


def _save(path: epath.Path) -> np.ndarray:
    """A MaxText item of one float32 param of 32 MiB, one chunk, random bytes (zstd keeps
    it about as large)."""
    x = np.random.default_rng(0).standard_normal((2048, 4096), np.float32)
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True))
    ckptr.save(path, args=ocp.args.PyTreeSave({"params": {"params": {"w": x}}}))
    ckptr.close()
    return x


def _value(reader: ItemReader):
    lay = reader.layout(NAME)
    return reader.stored_value(f"{NAME}/{lay.key((0,) * len(lay.shape))}")


def _mapped_rss_kib(path: str) -> int:
    """Resident KiB of this process's mappings of ``path`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and fields[-1] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@linux_only
@needs_mapping
def test_a_local_value_is_read_mapped_and_its_pages_leave_the_process(tmp_path):
    path = epath.Path(tmp_path) / "ckpt"
    _save(path)
    reader = ItemReader.open(path)
    value = _value(reader)
    assert isinstance(value, values.FileValue) and value.mapping is not None
    with open(value.path, "rb") as f:
        want = f.read()[value.pos : value.end]
    assert len(want) > 3 * values.PIECE  # several pieces
    got = []
    with value:
        while piece := value.read():
            got.append(bytes(piece))
            # at most the piece just given (and the page on either side) is in the process
            assert _mapped_rss_kib(value.path) <= len(piece) // 1024 + 8
    assert b"".join(got) == want
    assert _mapped_rss_kib(value.path) == 0  # the last piece left with the value

    unmapped = values.FileValue(value.path, value.end - len(want), value.end)  # preadv
    with unmapped:
        assert b"".join(bytes(p) for p in iter(unmapped.read, b"")) == want


@linux_only
def test_a_restore_reads_mapped_bytes_bit_for_bit(tmp_path):
    path = epath.Path(tmp_path) / "ckpt"
    x = _save(path)
    got = oml.load_params_from_path(path, {"params": {"w": np.zeros(x.shape, x.dtype)}})
    assert np.array_equal(np.asarray(got["params"]["w"]), x)


@needs_mapping
def test_a_data_file_cut_short_is_not_mapped_and_the_read_names_the_array(tmp_path):
    path = epath.Path(tmp_path) / "ckpt"
    x = _save(path)
    value = _value(ItemReader.open(path))
    with open(value.path, "r+b") as f:
        f.truncate(value.end - 1000)
    assert MappedFiles().covering(value.path, value.end) is None
    assert MappedFiles().covering(value.path, value.end - 1000) is not None
    assert _value(ItemReader.open(path)).mapping is None
    with pytest.raises(CheckpointReadError, match="w"):
        oml.load_params_from_path(path, {"params": {"w": np.zeros(x.shape, x.dtype)}})


@linux_only
@needs_mapping
def test_the_inner_chunks_of_a_shard_leave_no_mapped_pages_behind(tmp_path):
    """A zarr3 shard's inner chunks are read as parts of its value: each part's pages leave
    the process too, so a reader kept open holds none once an array is read."""
    path = epath.Path(tmp_path) / "ckpt"
    x = np.random.default_rng(1).standard_normal((2048, 4096), np.float32)
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True))
    tree, args = {"params": {"params": {"w": x}}}, ocp.SaveArgs(chunk_byte_size=4 << 20)
    ckptr.save(path, args=ocp.args.PyTreeSave(tree, save_args={"params": {"params": {"w": args}}}))
    ckptr.close()
    reader = ItemReader.open(path)
    lay = reader.layout(NAME)
    assert lay.shard is not None  # 8 shards, each value read as a part (its inner chunk)
    assert np.array_equal(reader.read_whole(NAME), x)
    files = {w[0] for w in reader._value_files.values() if not isinstance(w, bytes)}
    assert files and reader._mapped._maps  # read mapped, the mappings still open
    # None of the 4 MiB parts stays. A page or a few may: two threads that share a page at
    # a boundary can release it under each other, and the refault maps its neighbours
    # (the kernel's fault-around, 64 KiB).
    assert sum(_mapped_rss_kib(os.fspath(path / f)) for f in files) < 1024


def test_no_file_is_mapped_where_the_kernel_cannot_populate_a_range(tmp_path, monkeypatch):
    """Where ``MADV_POPULATE_READ`` is refused (Linux before 5.14, gVisor: there a released
    range stayed in the process), values are read with ``os.preadv``, bit for bit."""
    monkeypatch.setattr(mapped, "_POPULATES", False)
    path = epath.Path(tmp_path) / "ckpt"
    x = _save(path)
    assert _value(ItemReader.open(path)).mapping is None
    got = oml.load_params_from_path(path, {"params": {"w": np.zeros(x.shape, x.dtype)}})
    assert np.array_equal(np.asarray(got["params"]["w"]), x)
