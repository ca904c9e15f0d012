"""Files cut short or deleted while they are read (issue 58, item 2): a restore, a conversion
and the reads of an import of a Hugging Face directory each end in a named error or the
right values, never a signal.

Each campaign runs in a child (tests/truncation_child.py, its docstring says how): it times
the operation on an untouched copy, then cuts the files it reads (to 0 bytes, to half, one
byte short, or unlinked) at points spread over that time, and earlier and later. Data read
through a mapping of a file cut meanwhile raised SIGBUS and ended the process; read with
``os.preadv`` the cut is a short read, which is reported. Every case must be the pristine
values or a `CheckpointReadError` (``HfInputError`` on the Hugging Face side, one of them)
whose message names the file; the child must exit 0 (an exit by SIGBUS is named as such).

``import-hf`` itself (MaxText's mapping, and its work directory gone after the error) is
tests/interop/test_import_hf_truncation.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
import truncation_child as T

ROOT = Path(__file__).resolve().parents[1]
CUTS = ("zero", "half", "tail", "delete")


def _cases(points: int) -> list[dict]:
    """``points`` cut times from before the operation starts to past its end, each with
    the next cut of `CUTS` in turn."""
    ats = [1.3 * i / (points - 1) for i in range(points)]
    return [{"at": round(a, 3), "cut": CUTS[i % len(CUTS)]} for i, a in enumerate(ats)]


def _campaign(op: str, pristine: Path, work: Path, points: int) -> list[dict]:
    work.mkdir()
    job = {
        "op": op,
        "pristine": str(pristine),
        "work": str(work),
        "cases": _cases(points),
        "bench": str(ROOT / "bench"),
    }
    got = T.run(job, ROOT, timeout=600)
    assert len(got) == points
    for g in got:
        if g["outcome"] == "ok":
            assert g["correct"], f"{op}: other values, no error: {g}"
        else:
            assert g["read_error"] and g["named"], f"{op}: {g}"
    return got


def _save_restore_step(path: Path) -> Path:
    """`truncation_child.tree` as a MaxText step's item, saved with stock Orbax: arrays
    ``a`` and ``b`` in one chunk, ``c`` and ``d`` in zarr3 shards of 2 MiB inner chunks."""
    tree = T.tree()
    small = ocp.SaveArgs(chunk_byte_size=2 << 20)
    args = {"params": {"params": {k: (small if k in "cd" else ocp.SaveArgs()) for k in T.SHAPES}}}
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True))
    ckptr.save(path / "items", args=ocp.args.PyTreeSave(tree, save_args=args))
    ckptr.close()
    return path


def _save_hf_dir(d: Path) -> Path:
    """`truncation_child.hf_tensors` in two shards with their index, and a config."""
    from safetensors.numpy import save_file

    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))
    tensors, weight_map = T.hf_tensors(), {}
    for i, part in enumerate((("t0", "t1", "t2"), ("t3", "t4", "t5"))):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(d / shard))
        weight_map |= dict.fromkeys(part, shard)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def _errors(got: list[dict]) -> int:
    return sum(g["outcome"] == "error" for g in got)


def test_a_restore_survives_its_data_files_cut_at_any_point(tmp_path):
    got = _campaign("restore", _save_restore_step(tmp_path / "step"), tmp_path / "work", 24)
    # the campaign hit both sides: cuts before or during the reads, and after them
    assert 0 < _errors(got) < len(got)


def test_the_hf_reads_of_an_import_survive_a_shard_cut_at_any_point(tmp_path):
    got = _campaign("hf", _save_hf_dir(tmp_path / "hf"), tmp_path / "work", 24)
    assert 0 < _errors(got) < len(got)


def test_a_conversion_survives_its_source_cut_at_any_point(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import synth
    finally:
        sys.path.remove(str(ROOT / "bench"))
    step = synth.make_step(tmp_path / "run", 10, 24 << 20)
    got = _campaign("convert", step, tmp_path / "work", 12)
    assert _errors(got) > 0


@pytest.mark.slow  # the slow pass (.ci/run): many more cut points
@pytest.mark.parametrize("op", ["restore", "hf"])
def test_the_long_truncation_campaign(tmp_path, op):
    make = _save_restore_step if op == "restore" else _save_hf_dir
    _campaign(op, make(tmp_path / "src"), tmp_path / "work", 120)


def test_an_untouched_copy_reads_the_pristine_values(tmp_path):
    """The campaign's oracle: the child reads the saved step as stock Orbax does."""
    step = _save_restore_step(tmp_path / "step")
    got = ocp.PyTreeCheckpointer().restore(step / "items")
    for k, want in T.tree()["params"]["params"].items():
        assert np.array_equal(np.asarray(got["params"]["params"][k]), want)


def test_a_tensorstore_read_of_a_cut_item_names_its_data_files(tmp_path):
    """A read that fails inside tensorstore (its message may name only the key, or say
    "Invalid JSON": the export campaign of tests/interop met that) names the data files
    the item's B-tree references that are now missing or short."""
    import shutil

    from etils import epath

    from orbax_maxtext_layout.errors import CheckpointReadError
    from orbax_maxtext_layout.orbax_io.reader import ItemReader

    pristine = _save_restore_step(tmp_path / "step") / "items"
    for cut in ("delete", "half"):
        items = shutil.copytree(pristine, tmp_path / cut)
        reader = ItemReader.open(epath.Path(items))  # opened whole, then cut: as in a campaign
        files = sorted((items / "d").iterdir())
        T._cut(files, cut)
        with pytest.raises(CheckpointReadError) as got:
            reader.read_array(("params", "params", "a"))
        msg = str(got.value)
        assert "damaged data files" in msg, msg
        assert any(f.name in msg.split("damaged data files")[1] for f in files), msg


def test_a_chunk_read_whole_from_a_file_cut_meanwhile_names_the_file(tmp_path):
    """A read racing another process's truncation can copy the cut pages as zeros instead of
    returning short (the long campaign met it: 1 case in 120); the chunk then fails to decode.
    The error says the data file was cut, naming it; a chunk that fails to decode in an
    intact file names its data file too."""
    import zstandard as zstd

    from orbax_maxtext_layout.errors import CheckpointReadError
    from orbax_maxtext_layout.orbax_io import chunks
    from orbax_maxtext_layout.orbax_io.stored_values import FileValue

    data = tmp_path / "d" / "cafe01"
    data.parent.mkdir()
    data.write_bytes(bytes(100))
    where = "items: cannot read params.w: chunk 0.0 at (0, 0)"
    with FileValue(str(data), 0, 200) as cut:  # the B-tree places the chunk up to byte 200
        with pytest.raises(CheckpointReadError) as e:
            with chunks._decoding(where, None, cut):
                raise zstd.ZstdError("zstd decompress error: Data corruption detected")
    assert str(e.value).startswith(where) and str(data) in str(e.value)
    assert "ends at byte 100" in str(e.value) and "cut short" in str(e.value)
    with FileValue(str(data), 0, 100) as whole:
        with pytest.raises(CheckpointReadError) as e:
            with chunks._decoding(where, None, whole):
                raise zstd.ZstdError("zstd decompress error: Data corruption detected")
    assert f"in data file {data}: zstd decompress error" in str(e.value)
    assert "cut short" not in str(e.value)
