"""Interop (issue 24): ``export-hf`` writes what MaxText 0.2.5's ``to_huggingface`` writes.

The steps are the frozen fixtures of tests/fixtures/maxtext025 (their README), copied first;
the tokenizer is tests/fixtures/hf_tokenizer, copied first. MaxText's exporter runs stock, as a
subprocess (hf_export_support: on CPU, offline, ``--override_model_architecture``, the tiny
model's keys without ``scan_layers``), in Base mode, two at a time, once per module. Ours runs
in-process through the CLI entry (``orbax_maxtext_layout.cli.main``), in the same offline mode
(the tokenizer's ``save_pretrained`` writes ``local_files_only`` from it).

1. Equal to Base mode, tensor by tensor (names, shapes, dtypes, bytes), for:

   - ``sft``: the Tunix SFT step (MaxText given ``<step>/model_params``; ours the step);
   - ``rl``: the Tunix RL actor step ``actor/2`` (the same);
   - ``pretrain``: MaxText's scanned pre-training step (MaxText given ``<step>/items``);
   - ``pretrain_unscanned``: the unscanned one (MaxText reads ``scan_layers=false`` from the
     step's metadata, as its log says; ours too);
   - ``qwen3``: a second model family, tiny qwen3-0.6b written by ``train_sft``.

   ``config.json`` is MaxText's except ``dtype`` (ours: the dtype written) and, for qwen3,
   ``layer_types`` (ours: one per layer; MaxText keeps the 28 of the full model, and
   ``transformers.AutoConfig`` refuses it); ``AutoConfig`` loads ours. The tokenizer files
   are MaxText's, byte for byte.
2. LoRA: ``export-hf <lora step> --base <base> --alpha 8`` equals Base mode on ``merge-lora``'s
   output of the same (``<M>/0/items``), and differs from the plain base's export exactly in the
   adapted projections; scanned and unscanned.
3. Refusals, each writing nothing beside or under ``--out``.
4. ``--dry-run --json``: from metadata, what the real export writes.
5. ``--max-shard-size``: shards, index and file metadata as MaxText's ``save_model_files``
   writes past its limit, with the single file's tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
from pathlib import Path

import hf_export_support as S
import maxtext_loop_support as L
import numpy as np
import pytest

from orbax_maxtext_layout import cli

FIX = L.FIXTURE
TOKENIZER = L.TESTS_DIR / "fixtures" / "hf_tokenizer"
LLAMA_KEYS = S.model_keys()  # no scan_layers: read from the step
QWEN3_KEYS = [k for k in L.generator().QWEN3_MODEL_KEYS if not k.startswith("scan_layers=")]
ALPHA = L.generator().LORA_ALPHA  # 8
WORK_SUFFIX = ".export-hf-tmp"  # where export-hf builds --out before its rename


@dataclasses.dataclass(frozen=True)
class Step:
    fixture: str  # the step under tests/fixtures/maxtext025
    maxtext_reads: str  # the item MaxText's exporter is given
    keys: list[str]
    layers: int
    tensors: int  # HF tensors of the model
    scan_layers: bool
    source: str  # the report's "source"


STEPS = {
    "sft": Step("sft_run/checkpoints/2", "model_params", LLAMA_KEYS, 3, 30, True, "tunix"),
    "rl": Step("rl_run/checkpoints/actor/2", "model_params", LLAMA_KEYS, 3, 30, True, "tunix"),
    "pretrain": Step("pretrain_run/checkpoints/1", "items", LLAMA_KEYS, 3, 30, True, "maxtext"),
    "pretrain_unscanned": Step(
        "pretrain_unscanned_run/checkpoints/0", "items", LLAMA_KEYS, 3, 30, False, "maxtext"
    ),
    # qwen3-0.6b: q/k norms per layer, no lm_head (tied): 2 + 11 per layer.
    "qwen3": Step("qwen3_sft_run/checkpoints/2", "model_params", QWEN3_KEYS, 2, 24, True, "tunix"),
}
# LoRA form -> (adapter step, its base: the STEPS entry the LoRA run started from)
LORAS = {
    "scanned": ("lora_run/checkpoints/2", "pretrain"),
    "unscanned": ("lora_unscanned_run/checkpoints/2", "pretrain_unscanned"),
}
# The LoRA runs adapt every projection (lora_module_path: q, k, v, out, wi_0, wi_1, wo).
ADAPTED = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# MaxText's HF config of llama3.1-8b against the tiny sizes, as its exporter names them.
SIZE_MISMATCHES = (
    "hidden_size (HF=4096 vs MaxText=16)",
    "intermediate_size (HF=14336 vs MaxText=32)",
    "num_attention_heads (HF=32 vs MaxText=2)",
    "num_hidden_layers (HF=32 vs MaxText=3)",
    "num_key_value_heads (HF=8 vs MaxText=2)",
    "vocab_size (HF=128256 vs MaxText=64)",
    "head_dim (HF=128 vs MaxText=8)",
)


def model_args(keys: list[str], *, override: bool = True) -> list[str]:
    flag = ["--override-model-architecture"] if override else []
    return [*flag, "--maxtext-config", str(L.base_yml()), *keys]


def export(*args: object) -> int:
    """``orbax-maxtext-layout export-hf ARGS`` in-process: the exit code."""
    return cli.main(["export-hf", *map(str, args)])


def export_json(*args: object) -> dict:
    """An export that must succeed, with ``--json``: its report (stdout is the JSON alone)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = export(*args, "--json")
    assert rc == 0, buf.getvalue()
    return json.loads(buf.getvalue())


def non_weight_files(directory: Path) -> dict[str, bytes]:
    return {
        f.name: f.read_bytes()
        for f in directory.iterdir()
        if not f.name.startswith("model") and f.name != "config.json"
    }


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export_hf")


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Hub offline for ours as for MaxText's children (hf_export_support.env): huggingface_hub
    reads the variable once, at import, so its constant is set too."""
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def fixtures(work) -> Path:
    """A writable copy of every step used, at the same relative paths."""
    root = work / "fixtures"
    for rel in [s.fixture for s in STEPS.values()] + [s for s, _ in LORAS.values()]:
        L.copy_tree(FIX / rel, root / rel)
    return root


@pytest.fixture(scope="module")
def tokenizer(work) -> Path:
    return L.copy_tree(TOKENIZER, work / "tokenizer")


def step_path(fixtures: Path, name: str) -> Path:
    return fixtures / STEPS[name].fixture


def lora_args(fixtures: Path, form: str) -> list[object]:
    step, base = LORAS[form]
    return [fixtures / step, "--base", step_path(fixtures, base), "--alpha", f"{ALPHA:g}"]


@pytest.fixture(scope="module")
def merged(work, fixtures) -> dict[str, Path]:
    """form -> ``<M>/0/items`` of ``merge-lora <lora step> --base <base> --alpha 8 --out M``."""
    out = {}
    for form in LORAS:
        dest = work / f"merged_{form}"
        rc = cli.main(["merge-lora", *map(str, lora_args(fixtures, form)), "--out", str(dest)])
        assert rc == 0
        out[form] = dest / "0" / "items"
        assert out[form].is_dir()
    return out


@pytest.fixture(scope="module")
def maxtext(work, fixtures, tokenizer, merged) -> dict[str, Path]:
    """name -> MaxText's Base-mode export (its exit code checked), two children at a time:
    every STEPS entry, and ``merged_<form>`` of the merge-lora outputs."""
    jobs = [
        S.export_job(
            name,
            step_path(fixtures, name) / s.maxtext_reads,
            work / "maxtext" / name,
            tokenizer,
            keys=s.keys,
        )
        for name, s in STEPS.items()
    ]
    jobs += [
        S.export_job(f"merged_{form}", items, work / "maxtext" / f"merged_{form}", tokenizer)
        for form, items in merged.items()
    ]
    procs = S.run_all(jobs, workers=2)
    for p in procs.values():
        assert p.returncode == 0, p.why()
        assert not any(a.startswith("scan_layers=") for a in p.argv)
    # MaxText took the unscanned form from the steps' metadata (no key on its command line).
    for name in ("pretrain_unscanned", "merged_unscanned"):
        assert S.SYNCED_FROM_METADATA.format(False) in procs[name].log, procs[name].why()
    assert "loaded from checkpoint metadata" not in procs["pretrain"].log
    return {name: p.cwd / name for name, p in procs.items()}


@dataclasses.dataclass(frozen=True)
class Ours:
    out: Path
    report: dict


@pytest.fixture(scope="module")
def ours(work, fixtures, tokenizer) -> dict[str, Ours]:
    """name -> our export (in-process, with its --json report): every STEPS entry from the
    step directory itself, and ``lora_<form>`` from the adapter step with --base and --alpha."""
    out: dict[str, Ours] = {}
    for name, s in STEPS.items():
        dest = work / "ours" / name
        report = export_json(
            step_path(fixtures, name),
            "--out",
            dest,
            "--hf-model-path",
            tokenizer,
            *model_args(s.keys),
        )
        out[name] = Ours(dest, report)
    for form in LORAS:
        dest = work / "ours" / f"lora_{form}"
        report = export_json(
            *lora_args(fixtures, form),
            "--out",
            dest,
            "--hf-model-path",
            tokenizer,
            *model_args(LLAMA_KEYS),
        )
        out[f"lora_{form}"] = Ours(dest, report)
    return out


# ----------------------------------------------------------------------------- 1. Base mode


@pytest.mark.parametrize("name", list(STEPS))
def test_export_equals_to_huggingface_base_mode(name, ours, maxtext):
    s = STEPS[name]
    got, want = S.read_hf(ours[name].out), S.read_hf(maxtext[name])
    assert len(want) == s.tensors
    assert {str(a.dtype) for a in want.values()} == {"float32"}  # weight_dtype
    assert S.hf_diff(got, want) == []
    assert sorted(p.name for p in ours[name].out.glob("*.safetensors")) == ["model.safetensors"]
    r = ours[name].report
    assert (r["status"], r["source"], r["scan_layers"]) == ("exported", s.source, s.scan_layers)
    assert (r["tensors"], r["bytes"]) == (len(got), sum(a.nbytes for a in got.values()))
    assert r["files"] == sorted(p.name for p in ours[name].out.iterdir())
    assert not (ours[name].out.parent / f"{name}{WORK_SUFFIX}").exists()


@pytest.mark.parametrize("name", list(STEPS))
def test_the_weights_file_is_maxtexts_byte_for_byte(name, ours, maxtext):
    """One file: the same header (tensor order, offsets, padding, ``{"format": "pt"}``
    metadata) as MaxText's ``save_file``, and the same bytes."""
    from safetensors import safe_open

    got, want = ours[name].out / "model.safetensors", maxtext[name] / "model.safetensors"
    for f in (got, want):
        with safe_open(str(f), framework="np") as st:
            assert st.metadata() == {"format": "pt"}
    assert got.read_bytes() == want.read_bytes()


def test_the_exports_are_of_their_steps(ours):
    """Non-vacuous: the llama steps are different weights, so their exports differ."""
    exports = {n: S.read_hf(ours[n].out) for n in STEPS if n != "qwen3"}
    names = list(exports)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert S.hf_diff(exports[a], exports[b]) != [], (a, b)


@pytest.mark.parametrize("name", list(STEPS))
def test_config_json_is_maxtexts_with_the_dtype_written(name, ours, maxtext):
    from transformers import AutoConfig

    s = STEPS[name]
    got, want = S.hf_config(ours[name].out), S.hf_config(maxtext[name])
    assert got["dtype"] == "float32"
    differ = {"dtype"}
    if name == "qwen3":
        # MaxText keeps the full model's 28 layer types for 2 layers; ours has one per layer.
        assert len(want["layer_types"]) == 28
        assert got["layer_types"] == want["layer_types"][: s.layers]
        assert want["dtype"] == "bfloat16"  # over float32 weights
        differ.add("layer_types")
    else:
        assert "dtype" not in want
    assert {k: v for k, v in got.items() if k not in differ} == {
        k: v for k, v in want.items() if k not in differ
    }
    assert (got["num_hidden_layers"], got["hidden_size"], got["vocab_size"]) == (s.layers, 16, 64)
    cfg = AutoConfig.from_pretrained(str(ours[name].out))
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (s.layers, 16)
    if name == "qwen3":
        assert len(cfg.layer_types) == s.layers
        with pytest.raises(Exception, match=r"`num_hidden_layers` \(2\).*`layer_types` \(28\)"):
            AutoConfig.from_pretrained(str(maxtext[name]))
    else:
        assert AutoConfig.from_pretrained(str(maxtext[name])).num_hidden_layers == s.layers


@pytest.mark.parametrize("name", list(STEPS))
def test_tokenizer_files_are_maxtexts(name, ours, maxtext):
    got, want = non_weight_files(ours[name].out), non_weight_files(maxtext[name])
    assert set(want) == {"tokenizer.json", "tokenizer_config.json"}
    assert got == want


@pytest.mark.parametrize(
    "name, given",
    [
        ("sft", "model_params"),
        ("rl", "model_params"),
        ("pretrain", "items"),
        ("merged_scanned", ""),
    ],
)
def test_export_takes_the_item_or_a_merge_lora_output(name, given, work, fixtures, merged, maxtext):
    """Where MaxText's exporter must be pointed (the item) works for ours too; so does a
    ``merge-lora`` output step (``<M>/0``), equal to MaxText's export of its ``items``."""
    step = merged["scanned"].parent if name == "merged_scanned" else step_path(fixtures, name)
    dest = work / "ours_given" / f"{name}_{given or 'step'}"
    r = export_json(step / given if given else step, "--out", dest, *model_args(LLAMA_KEYS))
    assert r["status"] == "exported"
    got, want = S.read_hf(dest), S.read_hf(maxtext[name])
    assert len(want) == 30
    assert S.hf_diff(got, want) == []


# ----------------------------------------------------------------------------- 2. LoRA


@pytest.mark.parametrize("form", list(LORAS))
def test_lora_step_equals_base_mode_on_merge_lora_output(form, ours, maxtext):
    got = S.read_hf(ours[f"lora_{form}"].out)
    want = S.read_hf(maxtext[f"merged_{form}"])
    assert len(want) == 30
    assert S.hf_diff(got, want) == []
    r = ours[f"lora_{form}"].report
    assert r["source"] == "tunix-lora-merge"
    assert r["scan_layers"] is (form == "scanned")
    assert (r["merged"]["alpha"], r["merged"]["rank"]) == (ALPHA, L.generator().LORA_RANK)
    # The projections of the scanned layers, or of each unscanned layer.
    assert len(r["merged"]["modules"]) == len(ADAPTED) * (1 if form == "scanned" else 3)
    assert S.hf_config(ours[f"lora_{form}"].out) == S.hf_config(ours[LORAS[form][1]].out)


@pytest.mark.parametrize("form", list(LORAS))
def test_lora_step_differs_from_its_base_in_the_adapted_projections(form, ours, maxtext):
    got = S.read_hf(ours[f"lora_{form}"].out)
    base = S.read_hf(maxtext[LORAS[form][1]])
    differ = {d.split(":")[0] for d in S.hf_diff(got, base)}
    assert differ == {f"model.layers.{i}.{p}.weight" for i in range(3) for p in ADAPTED}
    for n in differ:  # same shapes and dtypes; values moved by the merge
        assert (got[n].shape, got[n].dtype) == (base[n].shape, base[n].dtype)
        assert not np.array_equal(got[n], base[n])


# ----------------------------------------------------------------------------- 3. refusals


@pytest.fixture
def place(tmp_path) -> Path:
    """An empty directory to hold ``--out`` (``<place>/hf``)."""
    p = tmp_path / "place"
    p.mkdir()
    return p


def refused(capsys, place: Path, *args: object) -> tuple[int, str]:
    """Runs ``export-hf ... --out <place>/hf ARGS``: exit code and stderr; checks nothing
    was written under or beside --out (no ``hf``, no ``hf.export-hf-tmp``)."""
    out = place / "hf"
    before = {p.name: p.read_bytes() if p.is_file() else None for p in place.rglob("*")}
    capsys.readouterr()
    rc = export(*args[:1], "--out", out, *args[1:])
    err = capsys.readouterr().err
    after = {p.name: p.read_bytes() if p.is_file() else None for p in place.rglob("*")}
    assert after == before
    assert not (place / f"hf{WORK_SUFFIX}").exists()
    return rc, err


def test_refuses_an_adapter_step_without_base(capsys, place, fixtures, tokenizer):
    rc, err = refused(
        capsys,
        place,
        fixtures / LORAS["scanned"][0],
        "--hf-model-path",
        tokenizer,
        *model_args(LLAMA_KEYS),
    )
    assert rc == 1, err
    assert "--base" in err and "merge-lora" in err


def test_refuses_an_adapter_step_without_alpha(capsys, place, fixtures):
    from orbax_maxtext_layout.lora.merge_plan import adapter_item, read_adapters

    step, base = LORAS["scanned"]
    assert read_adapters(*adapter_item(fixtures / step)).alpha is None  # not recorded
    rc, err = refused(
        capsys,
        place,
        fixtures / step,
        "--base",
        step_path(fixtures, base),
        *model_args(LLAMA_KEYS),
    )
    assert rc == 2, err
    assert "--alpha" in err and "alpha" in err.split("error:", 1)[1]


@pytest.mark.parametrize(
    "case, step, keys, paths",
    [
        (
            "wider emb",
            "sft",
            [*LLAMA_KEYS, "base_emb_dim=32"],
            ["token_embedder/embedding", "decoder/layers/mlp/wi_0/kernel"],
        ),
        (
            "qwen3 keys on llama",
            "sft",
            QWEN3_KEYS,
            ["decoder/layers/self_attention/query_norm/scale", "decoder/logits_dense/kernel"],
        ),
        (
            "llama keys on qwen3",
            "qwen3",
            LLAMA_KEYS,
            ["decoder/layers/self_attention/key_norm/scale", "decoder/layers/mlp/wo/kernel"],
        ),
    ],
    ids=["wider-emb", "qwen3-keys-on-llama", "llama-keys-on-qwen3"],
)
def test_refuses_a_config_of_another_model(capsys, place, fixtures, case, step, keys, paths):
    rc, err = refused(capsys, place, step_path(fixtures, step), *model_args(keys))
    assert rc == 1, err
    for p in paths:
        assert p in err, (case, p)
    assert re.search(r"\(\d+ offending paths\)|\(\d+ mismatches\)", err), err


def test_refuses_a_model_maxtext_cannot_export(capsys, place, fixtures):
    """llama2-7b: a MaxText model config (the tiny overrides build it) that ``to_huggingface``
    refuses ("Unsupported model name": not in its HF_IDS); the tensors would fit llama's
    mapping, so only the model name is refused."""
    from maxtext.utils.globals import HF_IDS

    from orbax_maxtext_layout.hf import hf_mapping

    supported = hf_mapping.supported_models()
    assert "llama2-7b" not in HF_IDS and "llama2-7b" not in supported
    assert (L.base_yml().parent / "models" / "llama2-7b.yml").is_file()
    assert {"llama3.1-8b", "qwen3-0.6b"} <= set(supported)
    keys = [k if not k.startswith("model_name=") else "model_name=llama2-7b" for k in LLAMA_KEYS]
    rc, err = refused(capsys, place, step_path(fixtures, "sft"), *model_args(keys))
    assert rc == 1, err
    assert "llama2-7b" in err
    listed = set(re.findall(r"^\s*- (\S+)$", err, re.M))
    assert listed == set(supported)


def test_refuses_sizes_other_than_maxtexts_hf_config_without_override(capsys, place, fixtures):
    rc, err = refused(
        capsys, place, step_path(fixtures, "sft"), *model_args(LLAMA_KEYS, override=False)
    )
    assert rc == 1, err
    for m in SIZE_MISMATCHES:
        assert m in err
    assert "--override-model-architecture" in err


def test_refuses_an_out_holding_files(capsys, place, fixtures, tokenizer):
    out = place / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = refused(
        capsys,
        place,
        step_path(fixtures, "sft"),
        "--hf-model-path",
        tokenizer,
        *model_args(LLAMA_KEYS),
    )
    assert rc == 1, err
    assert str(out) in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


# ----------------------------------------------------------------------------- 4. dry run


def test_dry_run_reports_the_export_and_writes_nothing(place, fixtures, ours):
    out = place / "hf"
    r = export_json(step_path(fixtures, "sft"), "--out", out, "--dry-run", *model_args(LLAMA_KEYS))
    assert list(place.iterdir()) == []
    real = S.read_hf(ours["sft"].out)
    assert r["status"] == "dry-run"
    assert r["tensors"] == len(real) == 30
    assert r["bytes"] == sum(a.nbytes for a in real.values())
    weights = ours["sft"].out / "model.safetensors"
    assert r["shards"] == [
        {"name": "model.safetensors", "tensors": 30, "bytes": weights.stat().st_size, "process": 0}
    ]
    m = r["memory"]
    assert set(m) == {"budget", "largest_param", "largest_slice", "expected_peak"}
    assert m["largest_slice"] >= max(a.nbytes for a in real.values())
    assert m["largest_param"] >= m["largest_slice"] > 0
    assert m["expected_peak"] >= 3 * m["largest_slice"]
    assert r["files"] == []
    # The Tunix RNG state is reported as not exported.
    assert r["dropped"] and all("/rngs/" in d["leaf"] for d in r["dropped"])


# ----------------------------------------------------------------------------- 5. shards


def test_max_shard_size_splits_into_indexed_shards(place, fixtures, tokenizer, ours):
    from safetensors import safe_open

    out = place / "hf"
    args = [step_path(fixtures, "sft"), "--out", out, "--max-shard-size", "10KB"]
    dry = export_json(*args[:2], place / "dry", *args[3:], "--dry-run", *model_args(LLAMA_KEYS))
    r = export_json(*args, "--hf-model-path", tokenizer, *model_args(LLAMA_KEYS))
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n >= 4  # 39,360 bytes of tensors, at most 10,000 a file
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = S.read_hf(out)
    assert set(index["weight_map"]) == set(got)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in got.values())
    for f in files:
        with safe_open(str(out / f), framework="np") as st:
            assert st.metadata() == {"format": "pt"}
            keys = set(st.keys())
        assert keys == {k for k, v in index["weight_map"].items() if v == f}
        assert sum(got[k].nbytes for k in keys) <= 10_000
    assert S.hf_diff(got, S.read_hf(ours["sft"].out)) == []
    assert non_weight_files(out) == non_weight_files(ours["sft"].out)
    assert S.hf_config(out) == S.hf_config(ours["sft"].out)
    # The dry run said so: the same files, sizes and tensor counts.
    shards = [{k: s[k] for k in ("name", "tensors", "bytes")} for s in dry["shards"]]
    assert shards == [
        {
            "name": f,
            "tensors": sum(v == f for v in index["weight_map"].values()),
            "bytes": (out / f).stat().st_size,
        }
        for f in files
    ]
    assert (dry["tensors"], dry["bytes"]) == (r["tensors"], r["bytes"])
