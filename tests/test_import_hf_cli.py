"""`import-hf` refuses a hostile Hugging Face directory before anything else (no MaxText
needed: the directory is read, as metadata, first): exit 1, one ``error:`` line naming the
file and the tensor, nothing written under ``--out`` and nothing beside it, the directory
unchanged. The conversion itself runs MaxText's mapping: tests/interop/test_import_hf.py."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import tree_digest
from forked_cli import run_cli
from safetensors.numpy import save_file

from orbax_maxtext_layout import cli

CONFIG = {"model_type": "llama", "hidden_size": 4, "num_attention_heads": 1}


def _hf(root: Path) -> Path:
    """A small, valid sharded Hugging Face directory."""
    d = root / "hf"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(CONFIG))
    save_file({"a": np.ones((2, 4), np.float32)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b": np.zeros((4,), np.float32)}, str(d / "model-00002-of-00002.safetensors"))
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def _escape(d: Path) -> str:
    """An index entry naming a real, readable file outside the directory."""
    secret = d.parent / "secret.safetensors"
    save_file({"b": np.full((4,), 7, np.float32)}, str(secret))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["b"] = "../secret.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return "secret.safetensors"


def _overlap(d: Path) -> str:
    """Two tensors of one file sharing bytes."""
    header = {
        "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    raw = json.dumps(header).encode()
    body = struct.pack("<Q", len(raw)) + raw + bytes(12)
    (d / "model-00002-of-00002.safetensors").write_bytes(body)
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "x": "model-00002-of-00002.safetensors",
            "y": "model-00002-of-00002.safetensors",
        }
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return "model-00002-of-00002.safetensors"


def _huge_header(d: Path) -> str:
    """A header length far past the file (and past any memory)."""
    f = d / "model-00001-of-00002.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    return f.name


def _twice(d: Path) -> str:
    """Tensor ``a`` in both shards."""
    save_file(
        {"a": np.ones((2, 4), np.float32), "b": np.zeros((4,), np.float32)},
        str(d / "model-00002-of-00002.safetensors"),
    )
    return "'a'"


CASES = {"escape": _escape, "overlap": _overlap, "huge-header": _huge_header, "twice": _twice}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_directory_is_refused_and_nothing_is_written(tmp_path, capsys, case):
    hf = _hf(tmp_path)
    named = CASES[case](hf)
    before = tree_digest(tmp_path)
    out = tmp_path / "out"
    code = cli.main(
        [
            "import-hf",
            str(hf),
            "--out",
            str(out),
            "--maxtext-config",
            "base.yml",
            "model_name=llama3.1-8b",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert named in lines[0] and "Traceback" not in err
    assert not out.exists()
    assert tree_digest(tmp_path) == before  # the directory as it was, nothing beside it


def test_an_unknown_save_dtype_is_a_usage_error(tmp_path):
    hf = _hf(tmp_path)
    done = run_cli(  # forked from a warm interpreter, with python -m's exit code
        "import-hf", hf, "--out", tmp_path / "o", "--save-dtype", "float16",
        "--maxtext-config", "base.yml", cwd=os.getcwd(),
    )  # fmt: skip
    assert done.returncode == 2 and "--save-dtype" in done.stderr
    assert not (tmp_path / "o").exists()


def test_a_valid_directory_without_maxtext_says_what_to_install(tmp_path, capsys):
    """Past the directory's checks, the mapping is MaxText's: without it, exit 2 naming it."""
    pytest.importorskip("orbax_maxtext_layout")
    try:
        import maxtext  # noqa: F401

        pytest.skip("MaxText is installed here: the interop suite runs the import")
    except ImportError:
        pass
    hf = _hf(tmp_path)
    code = cli.main(
        ["import-hf", str(hf), "--out", str(tmp_path / "o"), "--maxtext-config", "base.yml"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "maxtext" in err.lower()
    assert not (tmp_path / "o").exists()


def test_a_slice_is_written_in_row_blocks_the_last_one_short(tmp_path):
    """A row block past the array's end (an 8B embedding: 128,256 rows in blocks of 8,192)
    is cut at the end: tensorstore refuses an out-of-range write, numpy would clip it."""
    import tensorstore as ts

    from orbax_maxtext_layout.hf.import_hf import _write_slice, chunk_shape

    spec = {"driver": "zarr3", "kvstore": f"file://{tmp_path}/a"}
    spec["metadata"] = {
        "shape": [10, 4],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 4]}},
    }
    arr = ts.open(spec, create=True, dtype=ts.float32).result()
    data = np.arange(40, dtype=np.float32).reshape(10, 4)
    _write_slice(arr, (), (), data, [4, 4])
    assert np.array_equal(arr.read().result(), data)
    assert chunk_shape([3, 1 << 20, 64], (0,), 2)[0] == 1  # one layer a chunk, rows cut


@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_a_slice_over_the_budget_is_written_by_the_pool(tmp_path, in_flight):
    """A slice over the budget runs alone and its row blocks are written by the pool's
    workers, ``in_flight`` at a time (`_run_slices`): every block lands once, in its place,
    from a transposed view (MaxText's ``reshape_kernel``) copied by each worker's buffer."""
    from concurrent.futures import ThreadPoolExecutor

    import tensorstore as ts

    from orbax_maxtext_layout.hf.import_hf import _write_slice

    spec = {"driver": "zarr3", "kvstore": f"file://{tmp_path}/a"}
    spec["metadata"] = {
        "shape": [2, 11, 6],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, 3, 6]}},
    }
    arr = ts.open(spec, create=True, dtype=ts.uint16).result()
    src = np.arange(11 * 6, dtype=np.uint16).reshape(6, 11)  # HF's [out, in]
    with ThreadPoolExecutor(4) as pool:
        _write_slice(arr, (0,), (1,), src.T, [1, 3, 6], pool=(pool, in_flight))
    got = arr.read().result()
    assert np.array_equal(got[1], src.T)
    assert not got[0].any()  # the other layer untouched


def test_row_blocks_divide_the_rows_where_they_can():
    """No edge chunks where a divisor of the rows is near the most a chunk holds: 8B llama's
    MLP kernels (4,096 and 14,336 rows), embedding (128,256) and logits (4,096 rows)."""
    from orbax_maxtext_layout.hf.import_hf import CHUNK_BYTES, chunk_shape

    for shape, axes, rows in [
        ((4096, 32, 14336), (1,), 2048),
        ((14336, 32, 4096), (1,), 7168),
        ((128256, 4096), (), 8016),
        ((4096, 128256), (), 256),
    ]:
        chunk = chunk_shape(shape, axes, 2)
        assert chunk[0] == rows and shape[0] % rows == 0
        assert math.prod(chunk) * 2 <= CHUNK_BYTES
    # a prime row count keeps the most rows a chunk holds (one edge chunk)
    assert chunk_shape((4099, 14336), (), 2)[0] == CHUNK_BYTES // (14336 * 2)


# why the compiled transposing copy's tests skip where it is missing
NOT_BUILT = (
    "the compiled transposing copy was not built here (no C compiler at install, or run from "
    "a source tree: python setup.py build_ext --inplace)"
)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_a_transposed_copy_is_the_transpose_whatever_its_shape(monkeypatch, compiled):
    """`_copy` of a transposed view (MaxText's ``reshape_kernel`` of an HF ``[out, in]``
    kernel) equals NumPy's own copy: 2-byte items by the compiled copy where it was built
    (`storage.transpose`), else, and for other sizes, in 8-byte words and strips of
    `WORD_STRIP` (rows that pack into words, several passes when a pass holds fewer rows than
    the block), in element strips otherwise; for 1-, 2- and 4-byte items, bfloat16 among them,
    widths and heights that are no multiple of a strip or of the compiled copy's 8 x 8
    blocks, and row blocks of a larger tensor (as `_write_blocks` cuts them)."""
    import ml_dtypes

    from orbax_maxtext_layout.hf import import_hf as ih
    from orbax_maxtext_layout.storage import transpose

    if compiled and transpose.native() is None:
        pytest.skip(NOT_BUILT)
    if not compiled:
        monkeypatch.setattr(transpose, "_native", None)
    monkeypatch.setattr(ih, "PACKED_BYTES", 4096)  # a few rows a pass: several passes
    rng = np.random.default_rng(0)
    shapes = [(64, 300), (60, 257), (63, 100), (8, 33), (40, ih.WORD_STRIP * 3), (9, 7), (1, 40)]
    for dtype in (np.uint8, np.uint16, ml_dtypes.bfloat16, np.float32):
        for rows, cols in shapes + [(136, 270)]:
            hf = rng.integers(0, 250, size=(cols, rows)).astype(dtype)  # HF [out, in]
            for src in (hf.T, hf.T[5 : rows - 3]):  # [in, out], rows of hf contiguous
                for scratch in (None, ih._SliceScratch()):
                    out = np.full(src.shape, 255, dtype)
                    ih._copy(out, src, scratch)
                    want = np.ascontiguousarray(src)
                    assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), (
                        dtype,
                        src.shape,
                    )


def test_the_compiled_transpose_refuses_what_it_cannot_copy():
    """`storage.transpose.transpose_into` copies only what its kernel can (False, nothing
    written, for anything else), and the kernel itself refuses a view that is not a
    transposed one rather than read outside it."""
    from orbax_maxtext_layout.storage import transpose

    native = transpose.native()
    if native is None:
        pytest.skip(NOT_BUILT)
    hf = np.arange(12 * 20, dtype=np.uint16).reshape(20, 12)
    out = np.zeros((12, 20), np.uint16)
    assert transpose.transpose_into(out, hf.T) and np.array_equal(out, hf.T)
    for bad_out, bad_src in [
        (np.zeros((12, 20), np.uint32), hf.T.astype(np.uint32).T.T),  # 4-byte items
        (np.zeros((20, 12), np.uint16), hf.T),  # shapes differ
        (np.zeros((20, 12), np.uint16).T, hf.T),  # out not C-contiguous
    ]:
        before = bad_out.copy()
        assert not transpose.transpose_into(bad_out, bad_src)
        assert np.array_equal(bad_out, before)
    for src in (hf, hf.T[::-1], hf.T[:, ::2][:, ::-1]):  # not a transposed view
        with pytest.raises(ValueError, match="must be a transposed view"):
            native.transpose(np.zeros(src.shape, np.uint16), src)


@pytest.mark.parametrize(
    "argv, named",
    [
        ([], "HF_DIR or --base"),
        (["HF", "--base", "step", "--adapter", "a"], "HF_DIR or --base"),
        (["--base", "step"], "--adapter"),
    ],
)
def test_the_base_is_hf_dir_or_a_step_with_an_adapter(tmp_path, capsys, argv, named):
    """``--base STEP`` (issue 60) takes the place of HF_DIR and merges an adapter: both, neither
    or no adapter is a usage error (exit 2) before anything is read or written."""
    argv = [str(tmp_path / "hf") if a == "HF" else a for a in argv]
    out = tmp_path / "o"
    code = cli.main(["import-hf", *argv, "--out", str(out), "--maxtext-config", "base.yml"])
    err = capsys.readouterr().err
    assert code == 2 and named in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    "extra", [["--base", "step"], ["--save-dtype", "bfloat16"], []], ids=["base", "dtype", "none"]
)
def test_as_lora_usage_is_checked_before_anything_is_read(tmp_path, capsys, extra):
    """``--as-lora`` (issue 60) reaches the import: with ``--base`` or a ``--save-dtype``
    other than float32 it is a usage error (exit 2) naming ``--as-lora``, before the adapter
    or MaxText is touched; without ``--adapter`` too (the flag alone)."""
    adapter = [] if not extra else ["--adapter", str(tmp_path / "absent")]
    code = cli.main(
        ["import-hf", *adapter, "--as-lora", *extra, "--out", str(tmp_path / "o"),
         "--maxtext-config", "base.yml"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--as-lora" in err, err
    assert not (tmp_path / "o").exists()
