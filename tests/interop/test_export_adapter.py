"""Interop (issue 31): ``export-hf --adapter`` writes a PEFT adapter that PEFT itself loads,
and that adds in Hugging Face space what the merge adds.

The LoRA steps are the frozen fixtures of tests/fixtures/maxtext025 (their README), each
copied with its factors replaced by random ones of real magnitude (the trained ones move the
logits by ~2e-3 only; ``lora_logits_support.write_random_adapters``, written as Tunix
writes):

- ``scanned``: ``lora_run/checkpoints/2`` (llama3.1, scanned at axis 1, the 7 projections),
  from ``pretrain_run/checkpoints/1``;
- ``unscanned``: ``lora_unscanned_run/checkpoints/2``, from ``pretrain_unscanned_run/checkpoints/0``;
- ``gemma3``: ``gemma3_lora_run/checkpoints/2`` (block scans ``layers_<k>``), from
  ``gemma3_pretrain_run/checkpoints/0``;
- ``mixtral``: ``mixtral_lora_run/checkpoints/2`` (attention, the router and the experts, whose
  factors are qwix's einsum factors, one of each pair shared by all experts), from
  ``mixtral_pretrain_run/checkpoints/0``.

What proves what:

- *the values*: for every adapted module and layer, ``(alpha/r) * lora_B @ lora_A`` equals
  ``export-hf --base`` (the merge) minus ``export-hf`` of the base, in Hugging Face space, to
  float32 rounding; the other tensors of the two exports are equal. MaxText's own Adapter mode
  writes ``B @ A`` without the hooks: that misses the merge for ``q_proj``/``k_proj`` (the depth
  scaling and RoPE's row order), which this test also shows, so it cannot pass by accident;
- *PEFT* (the hf venv, ``OMTL_HF_PYTHON``; skipped without it): ``PeftModel.from_pretrained``
  on the base's export loads every tensor of the adapter as written (mixtral's per-expert
  factors as PEFT itself converts them for transformers 5's fused experts: LoRA on the 3-D
  parameters ``gate_up_proj`` and ``down_proj``), puts a LoRA layer on
  every ``target_modules`` entry of every layer, and gives transformers' logits of the
  merged export within 1e-5; ``merge_and_unload()`` gives the merged export's weights;
- *the contract*: ``--dry-run --json`` lists what the export writes and writes nothing; the
  step's ``model_params`` form writes the same files; every refusal exits as the issue says,
  writes nothing and leaves the step as it was. Expert factors that cannot be written per
  expert are refused too (tests/test_adapter_factors.py: no fixture holds them).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
from pathlib import Path

import hf_export_support as S
import lora_logits_support as LS
import maxtext_loop_support as L
import numpy as np
import pytest

from orbax_maxtext_layout import cli

GEN = L.generator()
FIX = L.FIXTURE
HERE = Path(__file__).resolve().parent
TOKENIZER = L.TESTS_DIR / "fixtures" / "hf_tokenizer"  # local: MaxText's exporter runs offline
ALPHA, RANK = GEN.LORA_ALPHA, GEN.LORA_RANK  # 8, 4
HF_PYTHON = os.environ.get("OMTL_HF_PYTHON", "")
LOGITS_TOLERANCE = 1e-5
FORMS = {  # form -> (LoRA step, its base, the model's keys (scan_layers read from the step))
    "scanned": ("lora_run/checkpoints/2", "pretrain_run/checkpoints/1", S.model_keys()),
    "unscanned": (
        "lora_unscanned_run/checkpoints/2",
        "pretrain_unscanned_run/checkpoints/0",
        S.model_keys(),
    ),
    "gemma3": (
        "gemma3_lora_run/checkpoints/2",
        "gemma3_pretrain_run/checkpoints/0",
        [k for k in GEN.GEMMA3_MODEL_KEYS if not k.startswith("scan_layers=")],
    ),
    "mixtral": (
        "mixtral_lora_run/checkpoints/2",
        "mixtral_pretrain_run/checkpoints/0",
        [k for k in GEN.MIXTRAL_MODEL_KEYS if not k.startswith("scan_layers=")],
    ),
}
# ``axis0``: the ``scanned`` form's base params and random factors with the layer axis moved
# from 1 to 0 (MaxText's ``param_scan_axis=0``), written by stock Orbax (`_axis0`).
AXIS0_KEYS = [k if k != "param_scan_axis=1" else "param_scan_axis=0" for k in S.model_keys()]
LLAMA_FORMS = ("scanned", "unscanned", "axis0")
PEFT_FORMS = (*LLAMA_FORMS, "gemma3", "mixtral")
# modules PEFT adapts: llama 3 layers x 7 projections; gemma3 12 layers x 7; mixtral 2 layers x
# (4 attention projections, the router's weight, the experts' gate_up_proj and down_proj)
ADAPTED = {"scanned": 21, "unscanned": 21, "axis0": 21, "gemma3": 84, "mixtral": 14}
EXPERTS = 4  # mixtral's
KEYS = {**{f: v[2] for f, v in FORMS.items()}, "axis0": AXIS0_KEYS}


def _export(*args: object) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["export-hf", *map(str, args)])
    return rc, out.getvalue() + err.getvalue()


def _config(keys: list[str]) -> list[str]:
    return ["--override-model-architecture", "--maxtext-config", str(L.base_yml()), *keys]


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export_adapter")


@pytest.fixture(scope="module")
def steps(work) -> dict[str, tuple[Path, Path]]:
    """form -> (the LoRA step with random factors, a copy of its base)."""
    out = {}
    for seed, (form, (lora, base, _)) in enumerate(FORMS.items()):
        src = L.copy_tree(FIX / lora, work / "src" / form / "checkpoints" / "2")
        dst = work / "steps" / form / "lora" / "checkpoints" / "2"
        LS.write_random_adapters(src, dst, seed=seed)
        out[form] = (dst, L.copy_tree(FIX / base, work / "steps" / form / "base" / Path(base).name))
    out["axis0"] = _axis0(*out["scanned"], work / "steps" / "axis0")
    return out


def _axis0(lora: Path, base: Path, root: Path) -> tuple[Path, Path]:
    """A LoRA step and its base at layer axis 0, from ``lora`` and ``base`` at axis 1: every
    scanned leaf (under ``decoder/layers``) with its axis 1 moved to 0. The base is written
    as a MaxText param-only step (``items`` holding ``params``), the adapters as a Tunix
    ``model_params`` (a ``value`` level on each factor), both by stock Orbax."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    def moved(path, x):
        keys = [str(getattr(k, "key", k)) for k in path]
        scanned = "decoder" in keys and "layers" in keys and np.ndim(x) >= 2
        return np.moveaxis(np.asarray(x), 1, 0) if scanned else np.asarray(x)

    handler = ocp.PyTreeCheckpointHandler()
    params = handler.restore(epath.Path(base / "items"))["params"]
    factors = handler.restore(epath.Path(lora / "model_params"))
    saved = {}
    for name, item, tree in (
        ("base", "items", {"params": jax.tree_util.tree_map_with_path(moved, params)}),
        ("lora", "model_params", jax.tree_util.tree_map_with_path(moved, factors)),
    ):
        manager = ocp.CheckpointManager(
            epath.Path(root / name / "checkpoints"),
            item_handlers={item: ocp.PyTreeCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False),
        )
        try:
            step = 1 if name == "base" else 2
            custom = {"scan_layers": True} if name == "base" else {}
            manager.save(
                step,
                args=ocp.args.Composite(**{item: ocp.args.PyTreeSave(tree)}),
                custom_metadata=custom,
                force=True,
            )
            manager.wait_until_finished()
        finally:
            manager.close()
        saved[name] = root / name / "checkpoints" / str(step)
    return saved["lora"], saved["base"]


@pytest.fixture(scope="module")
def exports(work, steps) -> dict[str, dict[str, Path]]:
    """form -> {"base", "merged", "adapter"}: the three exports of each form."""
    out = {}
    for form, (lora, base) in steps.items():
        keys = KEYS[form]
        d = {k: work / "hf" / form / k for k in ("base", "merged", "adapter")}
        runs = {
            "base": (base,),
            "merged": (lora, "--base", base, "--alpha", ALPHA),
            "adapter": (lora, "--adapter", "--alpha", ALPHA),
        }
        for k, args in runs.items():
            rc, text = _export(*args, "--out", d[k], *_config(keys))
            assert rc == 0, (form, k, text)
        out[form] = d
    return out


def _hf_module(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]


@pytest.mark.parametrize("form", list(KEYS))
def test_the_adapter_adds_what_the_merge_adds(form, exports):
    d = exports[form]
    base, merged, adapter = (S.read_hf(d[k]) for k in ("base", "merged", "adapter"))
    config = json.loads((d["adapter"] / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"]) == ("LORA", "CAUSAL_LM")
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert (config["lora_dropout"], config["bias"]) == (0.0, "none")
    modules = sorted({_hf_module(n) for n in adapter})
    assert modules and len(adapter) == 2 * len(modules)
    # target_modules selects exactly the adapted modules (PEFT fullmatches the string):
    # bare suffixes would also select gemma3's vision tower projections.
    pattern = config["target_modules"]
    assert isinstance(pattern, str) and all(re.fullmatch(pattern, m) for m in modules)
    others = {n.removesuffix(".weight") for n in base} - set(modules)
    assert not [n for n in others if re.fullmatch(pattern, n)]
    for m in modules:
        a = adapter[f"base_model.model.{m}.lora_A.weight"]
        b = adapter[f"base_model.model.{m}.lora_B.weight"]
        assert a.shape[0] == RANK and b.shape[1] == RANK and a.dtype == b.dtype, m
        got = (ALPHA / RANK) * (b.astype(np.float64) @ a.astype(np.float64))
        want = merged[f"{m}.weight"].astype(np.float64) - base[f"{m}.weight"]
        top = float(np.abs(want).max())
        assert top > 1e-2, m  # real adapters: the merge moves this weight
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * max(1.0, top), err_msg=m)
    unadapted = set(base) - {f"{m}.weight" for m in modules}
    assert unadapted and all(np.array_equal(base[n], merged[n]) for n in unadapted)


def _factors(step: Path) -> dict[str, np.ndarray]:
    """``{"<module path>/kernel_lora_{a,b}": array}`` of a Tunix LoRA step, by stock Orbax."""
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointHandler().restore(step / "model_params")
    out = {}

    def walk(node, path):
        if isinstance(node, dict) and set(node) == {"value"}:
            out["/".join(path)] = np.asarray(node["value"])
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, [*path, str(k)])

    walk(tree, [])
    return out


HF_OF = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "o_proj"}


@pytest.mark.parametrize("form", LLAMA_FORMS)
def test_without_the_hooks_q_and_k_would_be_wrong(form, steps, exports):
    """MaxText's Adapter mode writes each layer's factors as they are (``lora_A = a.T``,
    ``lora_B = b.T``, no hooks): that misses the merge for q_proj and k_proj (llama3.1's
    depth scaling and RoPE row order) and matches it for v_proj and o_proj. The carried
    adapter matches all four (`test_the_adapter_adds_what_the_merge_adds`)."""
    d = exports[form]
    base, merged = S.read_hf(d["base"]), S.read_hf(d["merged"])
    factors = _factors(steps[form][0])
    misses = {}
    for layer in range(3):
        for mod, hf in HF_OF.items():
            if form != "unscanned":  # the layer axis: 1, or 0 (axis0)
                at = (slice(None), layer) if form == "scanned" else (layer,)
                a = factors[f"decoder/layers/self_attention/{mod}/kernel_lora_a"][at]
                b = factors[f"decoder/layers/self_attention/{mod}/kernel_lora_b"][at]
            else:
                a = factors[f"decoder/layers_{layer}/self_attention/{mod}/kernel_lora_a"]
                b = factors[f"decoder/layers_{layer}/self_attention/{mod}/kernel_lora_b"]
            naive = (ALPHA / RANK) * (b.T.astype(np.float64) @ a.T.astype(np.float64))
            name = f"model.layers.{layer}.self_attn.{hf}.weight"
            want = merged[name].astype(np.float64) - base[name]
            misses.setdefault(hf, []).append(float(np.abs(naive - want).max()))
    assert max(misses["q_proj"]) > 1e-2 and max(misses["k_proj"]) > 1e-2, misses
    assert max(misses["v_proj"]) < 1e-5 and max(misses["o_proj"]) < 1e-5, misses


# MaxText's Adapter mode, run with its save given numpy arrays (its one crash, patched): the
# child imports the exporter, wraps that one call, and runs its main as its __main__ does.
PATCHED_ADAPTER_MODE = """
import sys
import numpy as np
from absl import app
import maxtext.checkpoint_conversion.to_huggingface as th
from maxtext.checkpoint_conversion.utils import utils
save = utils.numpy_save_file
utils.numpy_save_file = lambda w, path, *a, **k: save(
    {n: np.asarray(x) for n, x in w.items()}, path, *a, **k)
sys.argv = ["to_huggingface", *sys.argv[1:]]
app.run(th.main)
"""


def test_maxtext_adapter_mode_crashes_and_is_wrong_for_q_and_k(work, steps, exports):
    """MaxText 0.2.5's Adapter mode (``lora.lora_restore_path`` without
    ``load_parameters_path``) on the same step: it exits 1 on save (JAX arrays handed to
    safetensors' numpy writer); with that call patched, its ``q_proj``/``k_proj`` miss the
    merge by about the size of the change itself, while ``v_proj``/``o_proj`` agree (the
    figures docs/export-hf.md records). Ours agrees for all (`test_the_adapter_adds_...`)."""
    import sys

    lora, _ = steps["scanned"]
    argv = [
        str(L.base_yml()),
        *S.model_keys(scan_layers=True),
        "hardware=cpu",
        "skip_jax_distributed_system=true",
        f"lora.lora_restore_path={lora / 'model_params'}",
        f"lora.lora_rank={RANK}",
        f"lora.lora_alpha={ALPHA}",
        "--override_model_architecture",
        f"--hf_model_path={L.copy_tree(TOKENIZER, work / 'tokenizer')}",
    ]
    runs = {
        "stock": (sys.executable, "-m", S.EXPORT_MODULE),
        "patched": (sys.executable, "-c", PATCHED_ADAPTER_MODE),
    }
    jobs = [
        S.Job(k, work / "adapter_mode", (*cmd, *argv, f"base_output_directory={work / k}"))
        for k, cmd in runs.items()
    ]
    got = S.run_all(jobs)
    assert got["stock"].returncode != 0 and "ctypes" in got["stock"].log, got["stock"].why()
    assert got["patched"].returncode == 0, got["patched"].why()
    found = list((work / "patched").rglob("adapter_model.safetensors"))
    assert len(found) == 1, found
    theirs = S.read_hf(found[0].parent)
    d = exports["scanned"]
    base, merged = S.read_hf(d["base"]), S.read_hf(d["merged"])
    miss, size = {}, {}
    for layer in range(3):
        for hf in HF_OF.values():
            m = f"model.layers.{layer}.self_attn.{hf}"
            a = theirs[f"base_model.model.{m}.lora_A.weight"].astype(np.float64)
            b = theirs[f"base_model.model.{m}.lora_B.weight"].astype(np.float64)
            want = merged[f"{m}.weight"].astype(np.float64) - base[f"{m}.weight"]
            miss[hf] = max(miss.get(hf, 0.0), float(np.abs((ALPHA / RANK) * b @ a - want).max()))
            size[hf] = max(size.get(hf, 0.0), float(np.abs(want).max()))
    print(f"Adapter mode, max |(alpha/r) B@A - merge|: {miss}; max |merge|: {size}")
    assert miss["q_proj"] > 0.1 * size["q_proj"] and miss["k_proj"] > 0.1 * size["k_proj"]
    assert miss["v_proj"] < 1e-5 and miss["o_proj"] < 1e-5, miss


def test_dry_run_lists_what_is_written_and_writes_nothing(work, steps, exports):
    lora, _ = steps["scanned"]
    out = work / "dry"
    rc, text = _export(
        lora,
        "--adapter",
        "--alpha",
        ALPHA,
        "--out",
        out,
        "--dry-run",
        "--json",
        *_config(FORMS["scanned"][2]),
    )
    assert rc == 0, text
    report = json.loads(text[text.index("{") :])
    assert report["status"] == "dry-run" and not out.exists()
    written = S.read_hf(exports["scanned"]["adapter"])
    assert {t["name"]: tuple(t["shape"]) for t in report["tensor_list"]} == {
        n: x.shape for n, x in written.items()
    }
    config = json.loads((exports["scanned"]["adapter"] / "adapter_config.json").read_text())
    assert report["target_pattern"] == config["target_modules"]
    assert report["target_modules"] == sorted({_hf_module(n).rsplit(".", 1)[-1] for n in written})


@pytest.mark.parametrize("given", ["model_params", "actor"])
def test_the_other_forms_of_the_step_write_the_same_files(given, work, steps, exports):
    """The step's ``model_params``, and the step as Tunix's RL trainer places it
    (``checkpoints/actor/<n>``)."""
    lora, _ = steps["scanned"]
    out = work / f"from_{given}"
    if given == "actor":
        where = L.copy_tree(lora, work / "rl" / "checkpoints" / "actor" / lora.name)
    else:
        where = lora / "model_params"
    rc, text = _export(
        where,
        "--adapter",
        "--alpha",
        ALPHA,
        "--out",
        out,
        *_config(FORMS["scanned"][2]),
    )
    assert rc == 0, text
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out / name).read_bytes() == (exports["scanned"]["adapter"] / name).read_bytes()


def _refused(work: Path, name: str, step: Path, *args: object, keys=None) -> tuple[int, str]:
    out = work / "refused" / name
    before = _tree_hash(step.parent)
    rc, text = _export(step, *args, "--out", out, *_config(keys or S.model_keys()))
    assert not out.exists() and not out.parent.joinpath(out.name + ".export-hf-tmp").exists()
    assert _tree_hash(step.parent) == before, "the step was modified"
    return rc, text


def test_refusals_write_nothing(work, steps):
    lora, base = steps["scanned"]
    rc, text = _refused(work, "not_lora", base, "--adapter", "--alpha", ALPHA)
    assert rc == 2 and "without --adapter" in text, text
    rc, text = _refused(work, "with_base", lora, "--adapter", "--base", base, "--alpha", ALPHA)
    assert rc == 2 and "--base" in text, text
    rc, text = _refused(work, "no_alpha", lora, "--adapter")  # Tunix records no alpha
    assert rc == 2 and "--alpha" in text, text


def test_expert_adapters_are_written_per_expert(exports):
    """mixtral's experts carry qwix's einsum factors: ``wi_0``/``wi_1`` hold ``a (emb, r)``
    shared by all experts and ``b`` per expert, ``wo`` ``a`` per expert and ``b (r, emb)``
    shared. Each expert of each layer is written as its own PEFT module under the name of the
    base's export (``block_sparse_moe.experts.{e}.w1``), the shared factor repeated for each:
    the same rank r, exactly (`test_the_adapter_adds_what_the_merge_adds` for the values)."""
    written = S.read_hf(exports["mixtral"]["adapter"])

    def factor(layer: int, e: int, w: str, side: str) -> np.ndarray:
        base = f"base_model.model.model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
        return written[f"{base}.lora_{side}.weight"]

    for layer in range(2):
        for w, shared, own in (("w1", "A", "B"), ("w3", "A", "B"), ("w2", "B", "A")):
            first = factor(layer, 0, w, shared)
            assert RANK in first.shape, (w, first.shape)
            for e in range(1, EXPERTS):
                assert np.array_equal(factor(layer, e, w, shared), first), (layer, e, w)
                assert not np.array_equal(factor(layer, e, w, own), factor(layer, 0, w, own))
    experts = [n for n in written if ".experts." in n]
    assert len(experts) == 2 * EXPERTS * 3 * 2, len(experts)  # layers x experts x w1/w2/w3 x A/B


# ----------------------------------------------------------------------------- PEFT itself


@pytest.fixture(scope="module")
def peft(work, exports) -> dict[str, np.ndarray]:
    if not HF_PYTHON:
        pytest.skip(
            "OMTL_HF_PYTHON is not set: it names the hf venv's python (PEFT, "
            "transformers, CPU torch; constraints/hf.txt), which .ci/interop.sh sets"
        )
    jobs = [dict(name=f, **{k: str(v) for k, v in exports[f].items()}) for f in PEFT_FORMS]
    tokens = np.random.RandomState(0).randint(0, 64, (2, 16)).tolist()
    spec, out = work / "peft_jobs.json", work / "peft.npz"
    spec.write_text(json.dumps({"tokens": tokens, "jobs": jobs}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = subprocess.run(
        [HF_PYTHON, str(HERE / "peft_child.py"), str(spec), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("form", PEFT_FORMS)
def test_peft_loads_the_adapter_and_gives_the_merged_logits(form, peft):
    info = json.loads(str(peft[f"{form}::info"]))
    assert info["not_loaded"] == [], info["not_loaded"]
    # PEFT puts a LoRA layer on exactly the modules the file has factors for (gemma3: none on
    # its vision tower) and warns of no missing or unexpected adapter keys.
    adapted = [n.removeprefix("base_model.model.") for n in info["adapted"]]
    assert adapted == info["file_modules"], sorted(set(adapted) ^ set(info["file_modules"]))
    assert len(adapted) == ADAPTED[form], len(adapted)
    assert not [w for w in info["warnings"] if "adapter keys" in w], info["warnings"]
    if form == "mixtral":  # the experts' fused parameters and the router, each layer
        for name in ("experts.gate_up_proj", "experts.down_proj", "gate.weight"):
            assert f"model.layers.1.mlp.{name}" in info["merge_diff"], name
    got, want, base = (peft[f"{form}::{k}"] for k in ("peft", "merged", "base"))
    assert float(np.abs(got - base).max()) > 1e-2  # the adapters matter
    assert float(np.abs(got - want).max()) <= LOGITS_TOLERANCE
    assert max(info["merge_diff"].values()) <= 1e-6, info["merge_diff"]
