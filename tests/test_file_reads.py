"""Stored values and safetensors tensors are read with ``os.preadv``, never through a mapping
of their files (issue 58): a mapped page of a file another process cut short meanwhile
raises SIGBUS, which ends the process (tests/test_truncation.py cuts files during reads).
Here: no data file or shard is mapped while it is read, the bytes are the file's, and a
file cut short is a `CheckpointReadError` naming the array and the file."""

from __future__ import annotations

import os

import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from safetensors.numpy import save_file

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.errors import CheckpointReadError
from orbax_maxtext_layout.formats.safetensors_reader import HfDir
from orbax_maxtext_layout.hf import import_hf
from orbax_maxtext_layout.orbax_io import stored_values
from orbax_maxtext_layout.orbax_io.reader import ItemReader

NAME = "params.params.w"
linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux's maps")


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


def _mapped(path: str) -> bool:
    """Whether this process maps ``path`` (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(" " + path) for line in f)


@linux_only
def test_a_stored_value_is_read_not_mapped(tmp_path):
    path = epath.Path(tmp_path) / "ckpt"
    x = _save(path)
    reader = ItemReader.open(path)
    value = _value(reader)
    assert isinstance(value, stored_values.FileValue)
    with open(value.path, "rb") as f:
        want = f.read()[value.pos : value.end]
    assert len(want) > 3 * stored_values.PIECE  # several pieces
    got = []
    with value:
        while piece := value.read():
            got.append(bytes(piece))
            assert not _mapped(value.path)
    assert b"".join(got) == want
    assert np.array_equal(reader.read_whole(NAME), x)  # the reader kept open maps nothing
    assert not _mapped(value.path)


@linux_only
def test_an_imported_tensor_is_read_not_mapped(tmp_path):
    """The import's read of a tensor (`import_hf._read`) copies it out of the shard."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    w = np.random.default_rng(1).standard_normal((512, 512), np.float32)
    save_file({"w": w}, str(hf / "model.safetensors"))
    with HfDir.open(hf) as d:
        got = import_hf._read(d, "w", import_hf._SliceScratch())
        assert np.array_equal(got, w)
        assert not _mapped(str((hf / "model.safetensors").resolve()))


def test_a_restore_reads_bit_for_bit(tmp_path):
    path = epath.Path(tmp_path) / "ckpt"
    x = _save(path)
    got = oml.load_params_from_path(path, {"params": {"w": np.zeros(x.shape, x.dtype)}})
    assert np.array_equal(np.asarray(got["params"]["w"]), x)


def test_a_data_file_cut_short_names_the_array_and_the_file(tmp_path):
    path = epath.Path(tmp_path) / "ckpt"
    x = _save(path)
    value = _value(ItemReader.open(path))
    with open(value.path, "r+b") as f:
        f.truncate(value.end - 1000)
    name = os.path.basename(value.path)
    with pytest.raises(CheckpointReadError, match=rf"params\.params\.w.*{name}.*cut short"):
        oml.load_params_from_path(path, {"params": {"w": np.zeros(x.shape, x.dtype)}})


def test_a_data_file_cut_short_while_a_value_is_open_is_reported_on_read(tmp_path):
    """The cut comes after the value was opened (the restore's case): the read that reaches
    the new end raises, earlier ones give the file's bytes."""
    path = epath.Path(tmp_path) / "ckpt"
    _save(path)
    value = _value(ItemReader.open(path))
    with value:
        first = bytes(value.read())
        os.truncate(value.path, value.pos + 10)
        with pytest.raises(CheckpointReadError, match=os.path.basename(value.path)):
            value.read()
    assert len(first) == stored_values.FILE_PIECE
