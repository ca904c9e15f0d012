"""Interop (issue 30): ``export-hf`` of per-device chunks, piece by piece, equals MaxText's.

The steps (`chunked_step.py`, stock Orbax in a child process): a llama3.1 override (emb 256,
MLP 1024, 4 query and 2 KV heads of 64, 4 layers, vocab 512, bfloat16, scanned on axis 1),
the same seeded values saved three ways: by 8 CPU devices with each param cut on its largest
non-layer axis (``fsdp``: every chunk spans all 4 layers), on its last such axis (``tp``:
heads or MLP columns), and as one chunk per array (``one``, a single-host save). MaxText
0.2.5's own ``to_huggingface`` (Base mode, stock, a subprocess) exports the fsdp step; ours
exports each at ``--memory-budget 1MiB``, where every param goes piece by piece and a
one-chunk param of 2 MiB is streamed in pieces smaller than its chunk. Every tensor must be
MaxText's, byte for byte, and every stored chunk decoded exactly once (``io_counts``), none
layer by layer.
"""

from __future__ import annotations

import collections
import json
import struct
from pathlib import Path

import chunked_step
import hf_export_support as S
import maxtext_loop_support as L
import pytest

from orbax_maxtext_layout.hf.export_hf import export_hf
from orbax_maxtext_layout.orbax_io.orbax_files import io_counts

TOKENIZER = L.TESTS_DIR / "fixtures" / "hf_tokenizer"
KEYS = [
    "model_name=llama3.1-8b",
    "override_model_config=true",
    "base_emb_dim=256",
    "base_mlp_dim=1024",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=64",
    "base_num_decoder_layers=4",
    "vocab_size=512",
    "weight_dtype=bfloat16",
    "dtype=bfloat16",
    "param_scan_axis=1",
]


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chunked")
    out = {}
    for chunking in ("fsdp", "tp", "one"):
        out[chunking] = chunked_step.make(root / chunking, 0, chunking, [*KEYS, "scan_layers=true"])
    return out


@pytest.fixture(scope="module")
def maxtext(steps, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("maxtext") / "hf"
    job = S.export_job("maxtext", steps["fsdp"] / "items", out, TOKENIZER, keys=KEYS)
    proc = S.run(job)
    assert proc.returncode == 0, proc.why()
    return out


def _tensors(directory: Path) -> dict[str, tuple]:
    """Every tensor of an export: name -> (dtype, shape, bytes), from the files' headers."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        data = f.read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + n])
        for name, t in header.items():
            if name != "__metadata__":
                a, b = t["data_offsets"]
                out[name] = (t["dtype"], tuple(t["shape"]), data[8 + n + a : 8 + n + b])
    return out


@pytest.mark.parametrize("chunking", ["fsdp", "tp", "one"])
def test_piece_by_piece_export_is_maxtexts_decoding_each_chunk_once(
    chunking, steps, maxtext, tmp_path
):
    out = tmp_path / "hf"
    with io_counts() as counts:
        export_hf(
            steps[chunking],
            out,
            maxtext_config=[str(L.base_yml()), *KEYS],
            override_model_architecture=True,
            memory_budget=1 << 20,
        )
    want, got = _tensors(maxtext), _tensors(out)
    assert len(want) == 39 and set(got) == set(want)
    assert [n for n in want if got[n] != want[n]] == []
    kinds = collections.Counter(kind for kind, _ in counts)
    decodes = [n for (kind, _), n in counts.items() if kind == "chunk decoded"]
    assert kinds["layer decoded"] == kinds["array decoded"] == 0
    assert set(decodes) == {1}
    if chunking != "one":  # the large params' 8 per-device chunks, each once
        per_array = collections.Counter(
            k.rsplit("/c/", 1)[0] for (kind, k), _ in counts.items() if kind == "chunk decoded"
        )
        assert sorted(per_array.values())[-1] == 8, per_array


def test_the_largest_params_are_exported_first(steps, tmp_path):
    """The workers take params largest first: at 8B the plan's order left a 3.8 GB MLP
    kernel last, for one worker alone (14 s of a 47 s export on one core of two)."""
    from etils import epath

    from orbax_maxtext_layout.orbax_io import (
        item_writer,
    )
    from orbax_maxtext_layout.orbax_io.reader import ItemReader

    with io_counts() as counts:
        export_hf(
            steps["fsdp"],
            tmp_path / "hf",
            maxtext_config=[str(L.base_yml()), *KEYS],
            override_model_architecture=True,
            memory_budget=1 << 20,
        )
    decoded = [k for kind, k in counts if kind == "chunk decoded"]
    started = list(dict.fromkeys(k.rsplit("/c/", 1)[0].rsplit("/", 1)[1] for k in decoded))
    src = ItemReader.open(epath.Path(steps["fsdp"] / "items"), item_writer.ts_context())
    size = {name: src.layout(name).nbytes for name in started}
    # The three MLP kernels (2 MiB each, the largest) are taken first: the two workers take
    # two and start them at once; the first free one takes the third. Its first decode may
    # follow one smaller param's (the other worker's next, which may pass the budget's gate
    # first), never more; in the plan's order the largest came last.
    biggest = sorted(size, key=size.get, reverse=True)[:3]
    assert len(started) >= 6, started
    assert min(size[n] for n in biggest) > max(size[n] for n in started if n not in biggest)
    assert set(started[:2]) <= set(biggest), [(n, size[n]) for n in started]
    assert set(biggest) <= set(started[:4]), [(n, size[n]) for n in started]
