"""Interop (issue 60): ``import-hf --adapter`` merges a PEFT adapter into the import exactly as
PEFT's own ``merge_and_unload()`` merges it.

Inputs (peft_adapter_writer.py, in the hf venv, ``OMTL_HF_PYTHON``; the module skips without
it): per case, a tiny base saved by transformers 5, an adapter made by PEFT 0.21.2 itself
(``LoraConfig`` + ``get_peft_model``, every factor random and non-zero, ``save_pretrained``) and
PEFT's ``merge_and_unload()`` of it saved as a Hugging Face directory.

1. ``test_merged_equals_peft_merge[case]``: ``import_hf(base, adapter=ADAPTER)`` equals
   ``import_hf(merged)`` (PEFT's merge imported) leaf by leaf within 1e-6 in float32: the same
   tree, dtypes and shapes; and the adapter moved the reference (so a dropped merge fails).
   Cases: llama3.1 attention only, all linear, rsLoRA, rank and alpha patterns, a budget
   under every slice; qwen3 with tied embeddings; mixtral and qwen3-moe expert adapters
   (``target_parameters``, the fused names PEFT saves), scanned and unscanned. The imports of
   a case's base and of PEFT's merge, the references, are made once per module (`imported`)
   and shared by the tests below that compare with them.
2. ``test_refused[...]``: DoRA, another PEFT type, a config claiming another rank than the
   factors hold, a factor for a module the base lacks, an adapter of another model (qwen3's on
   llama), a factor whose partner is missing, ``lm_head`` on tied qwen3 (the base has no
   such tensor), an untargeted module: each a named ``AdapterRefusedError`` and nothing
   under ``--out``.
3. ``test_cli_refusal``: the command line's refusal is one line naming the setting, exit 1,
   no traceback, nothing written.
4. ``test_base_step_merged_equals_peft_merge[case]``: ``--base STEP`` (the base imported
   first) with the adapter equals the import of PEFT's merge within 1e-6, and every param
   the adapter leaves is the step's own; a step of another model is refused, nothing written.
5. ``test_logits_equal_peft[case]``: MaxText 0.2.5's own model restored from the merged step
   (``model_creation_utils.from_pretrained``, lora_logits_support's child) gives the logits of
   PEFT's ``PeftModel`` (base + adapter, peft_child.py) on a fixed batch, within 1e-5 (llama:
   MaxText and transformers differ by float32 rounding, 2.4e-6 on the plain export), where the
   adapter moves them by far more.
6. ``--as-lora`` (the adapter as the Tunix LoRA step ``train_sft`` resumes from):
   ``test_as_lora_logits_and_round_trip[case]``: MaxText's LoRA model (``train_sft``'s way:
   ``apply_lora_to_model`` and ``restore_lora_from_path`` with the rank, alpha and module path
   the import reports) over the imported base gives ``PeftModel``'s logits within 1e-5; then
   ``export-hf --adapter`` of the step, without ``--alpha`` (the step records it), gives an
   adapter whose every module's ``s·B@A`` is the original's (the factors up to the zero
   padding and the folded scale) and which PEFT loads to the same logits. Cases: rank and
   alpha patterns over all linear layers, scanned (padding and folding); rsLoRA on two
   attention projections, unscanned (a module path of the adapted modules alone).
   ``test_as_lora_refused[...]``: expert adapters, ``lm_head``, a ``lora.lora_rank`` under the
   adapter's, a ``lora.lora_module_path`` naming modules the adapter lacks: named, nothing
   written. ``test_train_sft_resumes_from_as_lora``: ``train_sft`` with
   ``lora.lora_restore_path=<out>/0/model_params`` runs an update from it, and the factors it
   saves are ours moved by the update (not a fresh initialization).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import import_hf_support as H
import maxtext_loop_support as L
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not H.hf_python(), reason="needs the hf venv (OMTL_HF_PYTHON)")

WRITER = H.HERE / "peft_adapter_writer.py"
TOLERANCE = 1e-6  # float32: numpy's and torch's B @ A add in another order
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    family: str
    seed: int
    lora: dict
    scan: bool = True
    budget: int | None = None


CASES = [
    Case("llama31-attention", "llama3.1", 11, {"r": 4, "lora_alpha": 8, "target_modules": ATTN}),
    Case("llama31-all-linear", "llama3.1", 12, {"r": 4, "lora_alpha": 16, "target_modules": "all-linear"}),
    Case("llama31-all-linear-unscanned", "llama3.1", 12, {"r": 4, "lora_alpha": 16, "target_modules": "all-linear"}, scan=False),
    Case("llama31-rslora", "llama3.1", 13, {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": "all-linear"}),
    Case("llama31-patterns", "llama3.1", 14, {
        "r": 4, "lora_alpha": 8, "target_modules": "all-linear",
        "rank_pattern": {"q_proj": 2, "layers.1.mlp.down_proj": 6},
        "alpha_pattern": {"o_proj": 3, r"layers\.2\.self_attn\.k_proj": 32},
    }),
    Case("llama31-tiny-budget", "llama3.1", 15, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}, budget=1024),
    Case("qwen3tied-all-linear", "qwen3", 16, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}),
    Case("mixtral-experts", "mixtral", 17, {"r": 2, "lora_alpha": 4, "target_modules": ATTN, "target_parameters": EXPERTS}),
    Case("mixtral-experts-unscanned", "mixtral", 17, {"r": 2, "lora_alpha": 4, "target_modules": ATTN, "target_parameters": EXPERTS}, scan=False),
    Case("qwen3moe-experts", "qwen3-moe", 18, {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "target_parameters": EXPERTS}),
    Case("qwen3moe-down-only", "qwen3-moe", 19, {"r": 3, "lora_alpha": 4, "target_modules": ["o_proj"], "target_parameters": ["mlp.experts.down_proj"]}),
    Case("gemma3-all-linear", "gemma3", 20, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}),
]  # fmt: skip
BY_ID = {c.id: c for c in CASES}
# adapters for the refusals (their bases are the cases')
MADE = {c.id: c for c in CASES} | {
    "llama31-dora": Case("llama31-dora", "llama3.1", 21, {"r": 4, "lora_alpha": 8, "target_modules": ATTN, "use_dora": True}),
    "qwen3-untied-attention": Case("qwen3-untied-attention", "qwen3", 22, {"r": 4, "lora_alpha": 8, "target_modules": ATTN}),
    "llama31-rslora-qv": Case("llama31-rslora-qv", "llama3.1", 23, {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj"]}, scan=False),
    "mixtral-attention": Case("mixtral-attention", "mixtral", 24, {"r": 2, "lora_alpha": 4, "target_modules": ATTN}),
}  # fmt: skip


def _keys(family: str, scan: bool) -> list[str]:
    return [str(L.base_yml()), *H.FAMILY_KEYS[family], H.scan_key(scan)]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Case id -> (its directory: base/, adapter/, merged/; the writer's report), every case
    and refusal's adapter, made by one hf-venv child."""
    root = tmp_path_factory.mktemp("peft")
    specs = [
        {"name": c.id, "family": c.family, "seed": c.seed, "lora": c.lora, "out": str(root / c.id)}
        for c in MADE.values()
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [H.hf_python(), str(WRITER), json.dumps(specs)],
        capture_output=True, text=True, env=env, timeout=H.CHILD_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = {r["name"]: r for r in map(json.loads, proc.stdout.splitlines())}
    return {n: (root / n, reports[n]) for n in MADE}


def _import(src: Path, out: Path, case: Case, **kw) -> H.Step:
    import orbax_maxtext_layout as oml

    oml.import_hf(
        src, out, maxtext_config=_keys(case.family, case.scan), save_dtype="float32",
        memory_budget=case.budget, **kw,
    )  # fmt: skip
    return H.read_step(out / "0")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """``imported(src, case) -> (--out, its step)``: `_import` of a fixed Hugging Face directory
    (a case's base, or PEFT's merge of its adapter: the references), made once per module for
    the tests that compare with it; read only."""
    root = tmp_path_factory.mktemp("imported")
    done: dict[tuple, tuple[Path, H.Step]] = {}

    def get(src: Path, case: Case) -> tuple[Path, H.Step]:
        key = (src, case.family, case.scan, case.budget)
        if key not in done:
            out = root / str(len(done))
            done[key] = (out, _import(src, out, case))
        return done[key]

    return get


def _max_diffs(got: H.Step, want: H.Step) -> dict[str, float]:
    assert got.tree == want.tree
    out = {}
    for p, w in want.params.items():
        g = got.params[p]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), p
        out["/".join(p)] = float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))))
    return out


@pytest.mark.parametrize("case_id", list(BY_ID))
def test_merged_equals_peft_merge(made, imported, tmp_path, case_id):
    case = BY_ID[case_id]
    d, report = made[case_id]
    assert report["moved"] > 0.05, report["moved"]  # the adapter changes the model
    if case.lora.get("target_parameters"):  # PEFT saved the experts under the fused names
        assert any(
            ".experts.lora_A" in k or ".experts.base_layer.lora_A" in k for k in report["tensors"]
        )
    ours = _import(d / "base", tmp_path / "ours", case, adapter=d / "adapter")
    want = imported(d / "merged", case)[1]
    base = imported(d / "base", case)[1]
    diffs = _max_diffs(ours, want)
    worst = max(diffs.values())
    moved = {p: v for p, v in _max_diffs(base, want).items() if v > 0}
    print(f"{case_id}: max |ours - import of merge_and_unload| {worst:.3g}; "
          f"{len(moved)} of {len(diffs)} params moved by the adapter, up to {max(moved.values()):.3g}")  # fmt: skip
    assert worst <= TOLERANCE, {p: v for p, v in diffs.items() if v > TOLERANCE}
    assert moved and max(moved.values()) > 0.05
    custom = json.loads((tmp_path / "ours" / "0" / "_CHECKPOINT_METADATA").read_text())
    recorded = custom["custom_metadata"]
    assert recorded.get("scan_layers") == case.scan


BASE_CASES = ["llama31-patterns", "llama31-all-linear-unscanned", "qwen3tied-all-linear",
              "mixtral-experts", "qwen3moe-experts"]  # fmt: skip


@pytest.mark.parametrize("case_id", BASE_CASES)
def test_base_step_merged_equals_peft_merge(made, imported, tmp_path, case_id):
    """``--base STEP``: the base imported first (a MaxText step), then the adapter merged
    into it: equal to the import of PEFT's merge within 1e-6, every param the adapter leaves
    the step's own bytes."""
    import orbax_maxtext_layout as oml

    case = BY_ID[case_id]
    d, _ = made[case_id]
    base_out, base = imported(d / "base", case)
    report = oml.import_hf(
        None, tmp_path / "ours", maxtext_config=_keys(case.family, case.scan),
        adapter=d / "adapter", base=base_out / "0", memory_budget=case.budget,
    )  # fmt: skip
    assert report.save_dtype == "float32" and report.adapter["tensors"] > 0
    ours = H.read_step(tmp_path / "ours" / "0")
    want = imported(d / "merged", case)[1]
    diffs = _max_diffs(ours, want)
    print(f"{case_id} --base: max |ours - import of merge_and_unload| {max(diffs.values()):.3g}")
    assert max(diffs.values()) <= TOLERANCE, {p: v for p, v in diffs.items() if v > TOLERANCE}
    kept = [p for p, v in _max_diffs(base, want).items() if v == 0]
    assert kept and all(
        np.array_equal(ours.params[tuple(p.split("/"))], base.params[tuple(p.split("/"))])
        for p in kept
    )


def test_base_step_of_another_model_is_refused(made, imported, tmp_path):
    import orbax_maxtext_layout as oml
    from orbax_maxtext_layout.errors import LayoutMismatchError

    qwen = BY_ID["qwen3tied-all-linear"]
    qwen_out, _ = imported(made[qwen.id][0] / "base", qwen)
    llama = BY_ID["llama31-attention"]
    with pytest.raises(LayoutMismatchError) as e:
        oml.import_hf(
            None, tmp_path / "out", maxtext_config=_keys(llama.family, llama.scan),
            adapter=made[llama.id][0] / "adapter", base=qwen_out / "0",
        )  # fmt: skip
    assert "not a MaxText step of the model" in str(e.value)
    assert not (tmp_path / "out").exists()


LOGITS = ["llama31-patterns", "llama31-rslora"]
LOGITS_TOLERANCE = 1e-5


@pytest.mark.parametrize("case_id", LOGITS)
def test_logits_equal_peft(made, imported, tmp_path, case_id):
    import lora_logits_support as G

    case = BY_ID[case_id]
    d, _ = made[case_id]
    _import(d / "base", tmp_path / "ours", case, adapter=d / "adapter")
    steps = {"ours": tmp_path / "ours", "want": imported(d / "merged", case)[0]}
    keys = [*H.FAMILY_KEYS[case.family], H.scan_key(case.scan)]
    jobs = [G.job(n, keys, out / "0" / "items", tmp_path / "run") for n, out in steps.items()]
    got = G.run_child(tmp_path / "maxtext", jobs)
    maxtext = got["ours"]
    spec = {"tokens": G.tokens().tolist(),
            "jobs": [{"name": case_id, "base": str(d / "base"), "merged": str(d / "merged"),
                      "adapter": str(d / "adapter")}]}  # fmt: skip
    (tmp_path / "peft.json").write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [H.hf_python(), str(H.HERE / "peft_child.py"), str(tmp_path / "peft.json"),
         str(tmp_path / "peft.npz")],
        capture_output=True, text=True, env=env, timeout=H.CHILD_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(tmp_path / "peft.npz") as z:
        peft, base = z[f"{case_id}::peft"], z[f"{case_id}::base"]
    same = float(np.abs(maxtext - got["want"]).max())
    diff = float(np.abs(maxtext - peft).max())
    floor = float(np.abs(got["want"] - peft).max())
    moved = float(np.abs(peft - base).max())
    print(f"{case_id}: MaxText's logits of our step vs of PEFT's merge imported {same:.3g}; vs "
          f"PeftModel's {diff:.3g} (MaxText vs torch on PEFT's own merge: {floor:.3g}); the "
          f"adapter moves PEFT's logits by up to {moved:.3g}")  # fmt: skip
    # our step runs in MaxText as PEFT's merge does; against torch, float32 rounding grows
    # with the logits' size (up to 4.6 here): relative to it
    assert same <= 1e-6 and moved > 0.01, (same, moved)
    assert diff <= LOGITS_TOLERANCE * max(1.0, float(np.abs(peft).max())), diff


def _copy(made, case_id: str, dst: Path) -> Path:
    shutil.copytree(made[case_id][0] / "adapter", dst)
    return dst


def _edit_config(adapter: Path, **changes) -> None:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg.update(changes)
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))


def _retensor(adapter: Path, fn) -> None:
    from safetensors.numpy import load_file, save_file

    t = load_file(str(adapter / "adapter_model.safetensors"))
    save_file(fn(t), str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})


def _rename(t: dict, old: str, new: str) -> dict:
    return {k.replace(old, new): v for k, v in t.items()}


REFUSALS = {
    # id: (base case, adapter, how it is changed, what the error must name)
    "dora": ("llama31-attention", "llama31-dora", None, "use_dora"),
    "other-type": ("llama31-attention", "llama31-attention", {"peft_type": "IA3"}, "peft_type 'IA3'"),
    "rank-claim": ("llama31-attention", "llama31-attention", {"r": 8}, "rank 8"),
    "unknown-setting": ("llama31-attention", "llama31-attention", {"future_variant": {"x": 1}}, "future_variant"),
    "pissa": ("llama31-attention", "llama31-attention", {"init_lora_weights": "pissa"}, "init_lora_weights"),
    "unknown-module": ("llama31-attention", "llama31-attention",
                       lambda t: _rename(t, "layers.0.self_attn.q_proj", "layers.0.self_attn.qq_proj"),
                       "layers.0.self_attn.qq_proj"),
    "no-partner": ("llama31-attention", "llama31-attention",
                   lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.k_proj.lora_B" not in k},
                   "lora_A without lora_B"),
    "other-model": ("llama31-attention", "qwen3-untied-attention", None, "the base's"),
    "wrong-size": ("qwen3tied-all-linear", "llama31-all-linear", None, "needs lora_A"),
    "tied-lm-head": ("qwen3tied-all-linear", "qwen3tied-all-linear",
                     lambda t: t | {"base_model.model.lm_head.lora_A.weight": t[next(k for k in t if "q_proj.lora_A" in k)],
                                    "base_model.model.lm_head.lora_B.weight": np.ones((64, 4), np.float32)},
                     "lm_head"),
    "untargeted": ("llama31-attention", "llama31-attention", {"target_modules": ["q_proj"]}, "does not target"),
    "expert-rank": ("mixtral-experts", "mixtral-experts", {"rank_pattern": {"gate_up_proj": 3}}, "gate_up_proj"),
}  # fmt: skip


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_refused(made, tmp_path, refusal):
    from orbax_maxtext_layout.lora.peft_adapter import AdapterRefusedError

    base_case, adapter_case, change, named = REFUSALS[refusal]
    adapter = _copy(made, adapter_case, tmp_path / "adapter")
    if isinstance(change, dict):
        _edit_config(adapter, **change)
    elif change is not None:
        _retensor(adapter, change)
    out = tmp_path / "out"
    with pytest.raises(AdapterRefusedError) as e:
        _import(made[base_case][0] / "base", out, BY_ID[base_case], adapter=adapter)
    text = str(e.value)
    assert named in text, text
    assert not out.exists()


def test_cli_refusal(made, tmp_path):
    case = BY_ID["llama31-attention"]
    out = tmp_path / "out"
    proc = H.S.run_cli(
        "import-hf", made[case.id][0] / "base", "--out", out,
        "--adapter", made["llama31-dora"][0] / "adapter",
        "--save-dtype", "float32", "--maxtext-config", *_keys(case.family, case.scan),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "use_dora" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()


def test_dry_run_plans_the_adapter_from_metadata(made, tmp_path):
    import orbax_maxtext_layout as oml

    case = BY_ID["mixtral-experts"]
    d, _ = made[case.id]
    report = oml.import_hf(
        d / "base", tmp_path / "out", maxtext_config=_keys(case.family, case.scan),
        save_dtype="float32", adapter=d / "adapter", dry_run=True,
    )  # fmt: skip
    a = report.adapter
    # 2 layers: q, k, v, o and the two fused expert parameters each; 4 experts, 3 tensors each
    assert (a["modules"], a["tensors"], a["ranks"], a["scales"]) == (12, 2 * (4 + 12), [2], [2.0])
    assert "merged the PEFT adapter" in str(report) and json.loads(report.to_json())["adapter"]
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- --as-lora
def _as_lora(case: Case, adapter: Path, out: Path, *extra: str):
    import orbax_maxtext_layout as oml

    return oml.import_hf(
        None, out, maxtext_config=[*_keys(case.family, case.scan), *extra], adapter=adapter,
        as_lora=True,
    )  # fmt: skip


def _peft_child(work: Path, jobs: list[dict]) -> dict[str, np.ndarray]:
    """``PeftModel``'s logits of each job's base with its adapter (peft_child.py, hf venv)."""
    import lora_logits_support as G

    work.mkdir(parents=True, exist_ok=True)
    (work / "peft.json").write_text(json.dumps({"tokens": G.tokens().tolist(), "jobs": jobs}))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [H.hf_python(), str(H.HERE / "peft_child.py"), str(work / "peft.json"),
         str(work / "peft.npz")],
        capture_output=True, text=True, env=env, timeout=H.CHILD_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(work / "peft.npz") as z:
        return {k: z[k] for k in z.files}


def _products(adapter: Path) -> dict[str, np.ndarray]:
    """Each module's ``s · B @ A`` of an adapter directory, PEFT's scale per module."""
    from safetensors.numpy import load_file

    from orbax_maxtext_layout.lora import peft_adapter as P

    cfg = json.loads((adapter / P.CONFIG_FILE).read_text())
    s = P.settings(cfg, str(adapter))
    t = load_file(str(adapter / P.WEIGHTS_FILE))
    out = {}
    for name in t:
        if name.endswith(".lora_A.weight"):
            module = name[len(P.PREFIX) : -len(".lora_A.weight")]
            r, alpha = s.rank_alpha(module)
            b = t[name.replace("lora_A", "lora_B")].astype(np.float64)
            out[module] = s.scale(r, alpha) * b @ t[name].astype(np.float64)
    return out


# Families whose tiny MaxText model does not give the Hugging Face model's logits on the same
# weights (MaxText's plain model on the imported base, a bit-exact import: 0.18 off for qwen3
# tied, 1.24 for gemma3; llama3.1 and mixtral agree within 6e-6). Their LoRA model is judged
# against MaxText's plain model on the import of PEFT's merge_and_unload, not PeftModel.
HF_LOGITS_DIFFER = {"qwen3tied-all-linear", "gemma3-all-linear"}
# case -> scanned; the first scanned one is also resumed by train_sft
AS_LORA = {"llama31-patterns": True, "llama31-rslora-qv": False, "qwen3tied-all-linear": True,
           "mixtral-attention": True, "gemma3-all-linear": True}  # fmt: skip


@pytest.fixture(scope="module")
def as_lora(made, imported, tmp_path_factory) -> dict:
    """Every --as-lora run, once: each case's base imported (float32) and adapter written as a
    LoRA step, exported back with ``export-hf --adapter`` (no ``--alpha``); then, side by side
    (2 cores), one MaxText child building both LoRA models (as ``train_sft`` builds them), one
    PEFT child for both cases' original and exported adapters, and ``train_sft`` resuming
    from the scanned case's step for one update."""
    import concurrent.futures

    import hf_export_support as S
    import lora_logits_support as G

    import orbax_maxtext_layout as oml

    root = tmp_path_factory.mktemp("as-lora")
    runs, jobs, peft = {}, [], []
    for case_id, scan in AS_LORA.items():
        case = dataclasses.replace(MADE[case_id], scan=scan)
        d, work = made[case_id][0], root / case_id
        base = imported(d / "base", case)[0] / "0" / "items"
        report = _as_lora(case, d / "adapter", work / "step")
        lora = report.adapter["as_lora"]
        keys = [*H.FAMILY_KEYS[case.family], H.scan_key(scan)]
        step = work / "step" / "0"
        exported = oml.export_hf(
            step, work / "back", maxtext_config=[str(L.base_yml()), *keys], adapter=True,
            override_model_architecture=True,
        )  # fmt: skip
        restore = {"rank": lora["rank"], "alpha": lora["alpha"],
                   "restore": str(step / "model_params"), "module_path": lora["module_path"]}  # fmt: skip
        merged = imported(d / "merged", case)[0] / "0" / "items"  # PEFT's merge_and_unload
        jobs.append(G.job(case_id, keys, base, work / "run", lora=restore))
        jobs.append(G.job(f"{case_id}__base", keys, base, work / "run"))
        jobs.append(G.job(f"{case_id}__merged", keys, merged, work / "run"))
        peft += [{"name": f"{case_id}__{n}", "base": str(d / "base"), "merged": str(d / "base"),
                  "adapter": str(a)} for n, a in (("orig", d / "adapter"), ("back", work / "back"))]  # fmt: skip
        runs[case_id] = {"report": report, "step": step, "exported": exported, "work": work,
                         "base": base}  # fmt: skip
    scanned = next(c for c, scan in AS_LORA.items() if scan)
    lora = runs[scanned]["report"].adapter["as_lora"]
    params = runs[scanned]["step"] / "model_params"
    sft = S.train_sft_job(
        "train_sft", root / "sft", runs[scanned]["base"],
        "steps=1", "checkpoint_period=1", "lora.enable_lora=true", f"lora.lora_rank={lora['rank']}",
        f"lora.lora_alpha={lora['alpha']}", f"lora.lora_module_path={lora['module_path']}",
        f"lora.lora_restore_path={params}",
    )  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        maxtext = pool.submit(G.run_child, root / "maxtext", jobs)
        logits = pool.submit(_peft_child, root / "peft", peft)
        trained = pool.submit(S.run, sft)
        return {"runs": runs, "maxtext": maxtext.result(), "peft": logits.result(),
                "sft": trained.result(), "sft_dir": root / "sft", "params": params}  # fmt: skip


@pytest.mark.parametrize("case_id", list(AS_LORA))
def test_as_lora_logits_and_round_trip(made, as_lora, case_id):
    d, _ = made[case_id]
    run = as_lora["runs"][case_id]
    lora = run["report"].adapter["as_lora"]
    meta = json.loads((run["step"] / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]
    assert (meta["lora"]["lora_rank"], meta["lora"]["lora_alpha"]) == (lora["rank"], lora["alpha"])
    assert sorted(p.name for p in run["step"].iterdir() if p.is_dir()) == ["model_params"]
    assert (run["exported"].rank, run["exported"].alpha) == (lora["rank"], lora["alpha"])
    want, got = _products(d / "adapter"), _products(run["work"] / "back")
    assert sorted(got) == sorted(want)
    worst = max(float(np.abs(got[m] - want[m]).max() / np.abs(want[m]).max()) for m in want)
    p = as_lora["peft"]
    orig, back, base = (
        p[f"{case_id}__orig::peft"],
        p[f"{case_id}__back::peft"],
        p[f"{case_id}__orig::base"],
    )
    maxtext, mt = as_lora["maxtext"][case_id], as_lora["maxtext"]
    plain = float(np.abs(mt[f"{case_id}__base"] - base).max())
    merged = float(np.abs(maxtext - mt[f"{case_id}__merged"]).max())
    print(f"{case_id}: MaxText's plain model on the imported base vs the HF base {plain:.3g}; "
          f"its LoRA model vs its plain model on the imported merge_and_unload {merged:.3g}")  # fmt: skip
    top_mt = max(1.0, float(np.abs(maxtext).max()))
    assert merged <= LOGITS_TOLERANCE * top_mt, merged
    if case_id in HF_LOGITS_DIFFER:
        assert plain > LOGITS_TOLERANCE * top_mt, f"{case_id} agrees with HF now: {plain}"
    diff, trip = float(np.abs(maxtext - orig).max()), float(np.abs(back - orig).max())
    moved = float(np.abs(orig - base).max())
    print(f"{case_id} --as-lora (rank {lora['rank']}, alpha {lora['alpha']:g}, padded "
          f"{lora['padded_ranks']}, folded {lora['folded_ratios']}): MaxText's LoRA model vs "
          f"PeftModel {diff:.3g}; exported adapter's s·B@A vs the original's {worst:.3g} "
          f"(relative), its PEFT logits vs the original's {trip:.3g}; the adapter moves the "
          f"logits by {moved:.3g}")  # fmt: skip
    top = max(1.0, float(np.abs(orig).max()))
    assert moved > 0.01 and worst <= 1e-5, (moved, worst)
    assert trip <= LOGITS_TOLERANCE * top, trip
    if case_id not in HF_LOGITS_DIFFER:  # else MaxText's own model differs from HF's
        assert diff <= LOGITS_TOLERANCE * top, diff
    assert json.loads(str(p[f"{case_id}__back::info"]))["not_loaded"] == []


def test_train_sft_resumes_from_as_lora(as_lora):
    """MaxText's ``train_sft`` (scanned, its default) with ``lora.lora_restore_path`` at the
    step: one update, and the adapters it saves are ours moved by it, not fresh ones."""
    proc = as_lora["sft"]
    assert proc.returncode == 0, proc.why()
    saved = sorted((as_lora["sft_dir"] / "run" / "checkpoints").glob("*/model_params"))
    assert saved, proc.why()
    ours, theirs = L.read_item(as_lora["params"]), L.read_item(saved[-1])
    assert sorted(ours) == sorted(theirs)
    moved = {k: float(np.abs(theirs[k].array - ours[k].array).max()) for k in ours}
    print(f"train_sft from --as-lora: {len(ours)} factors restored, moved by the update up to "
          f"{max(moved.values()):.3g} (saved in {saved[-1].parent.name})")  # fmt: skip
    big = max(float(np.abs(ours[k].array).max()) for k in ours)
    assert 0 < max(moved.values()) < 0.01 < big, (moved, big)


AS_LORA_REFUSALS = {
    # id: (case, the adapter's change, extra config keys, what the error must name)
    "experts": ("mixtral-experts", None, (), "MoE experts"),
    "lm-head": ("llama31-attention",
                lambda t: t | {"base_model.model.lm_head.lora_A.weight": t[next(k for k in t if "q_proj.lora_A" in k)],
                               "base_model.model.lm_head.lora_B.weight": np.ones((64, 4), np.float32)},
                (), "decoder/logits_dense"),
    "rank-under": ("llama31-patterns", None, ("lora.lora_rank=4",), "lora.lora_rank 4"),
    "module-path": ("llama31-attention", None, ("lora.lora_module_path=decoder/layers/.*(self_attention/(query|key|value|out)|mlp/(wi_0|wi_1|wo))",),
                    "decoder/layers/mlp/wi_0"),
}  # fmt: skip


@pytest.mark.parametrize("refusal", list(AS_LORA_REFUSALS))
def test_as_lora_refused(made, tmp_path, refusal):
    from orbax_maxtext_layout.lora.peft_adapter import AdapterRefusedError

    case_id, change, extra, named = AS_LORA_REFUSALS[refusal]
    adapter = _copy(made, case_id, tmp_path / "adapter")
    if change is not None:
        _edit_config(adapter, target_modules=[*ATTN, "lm_head"])
        _retensor(adapter, change)
    out = tmp_path / "out"
    with pytest.raises(AdapterRefusedError) as e:
        _as_lora(BY_ID[case_id], adapter, out, *extra)
    assert named in str(e.value), str(e.value)
    assert not out.exists()


def test_as_lora_dry_run_plans_from_metadata(made, tmp_path):
    """``dry_run``: the step's rank, alpha, module path and factors from metadata alone."""
    import orbax_maxtext_layout as oml

    case = BY_ID["llama31-patterns"]
    report = oml.import_hf(
        None, tmp_path / "out", maxtext_config=_keys(case.family, case.scan),
        adapter=made[case.id][0] / "adapter", as_lora=True, dry_run=True,
    )  # fmt: skip
    lora = report.adapter["as_lora"]
    assert (lora["rank"], lora["alpha"], lora["padded_ranks"]) == (6, 12.0, [2, 4])
    assert report.params == 14 and "lora.lora_restore_path=" in str(report)
    # with HF_DIR (optional): its config checked, its tensors the base; the same plan
    given = oml.import_hf(
        made[case.id][0] / "base", tmp_path / "out", maxtext_config=_keys(case.family, case.scan),
        adapter=made[case.id][0] / "adapter", as_lora=True, dry_run=True,
    )  # fmt: skip
    assert given.adapter["as_lora"] == lora and given.params == report.params
    assert not (tmp_path / "out").exists()
