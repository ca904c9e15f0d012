"""Interop (issue 43): ``import-hf`` writes the step MaxText 0.2.5's own ``to_maxtext`` writes.

Inputs (import_hf_support.HF): tiny checkpoints written by ``transformers`` 5 ``save_pretrained``
in the hf venv (``OMTL_HF_PYTHON``; the module skips without it): llama3.1 in float32 and in
bfloat16 (and the bfloat16 one sharded, with ``model.safetensors.index.json``), qwen3 with tied
embeddings (no ``lm_head.weight``), mixtral and qwen3-moe (one tensor per expert, as
transformers 5 saves them) and gemma3 text (``Gemma3ForCausalLM``), every tensor seeded random.

The reference (import_hf_support.REFS, its docstring says how each is made) is to_maxtext run
stock in a process of its own per (model, scan form; forked from the suite's MaxText fork
server, hf_export_support.run), with MaxText's HF config resized to the MaxText config first;
scanned mixtral is its unscanned output stacked on ``param_scan_axis`` (to_maxtext crashes on
it), and gemma3's is to_maxtext on the same tensors under the names its mapping expects. References are made once per run of this module (under its pytest tmp dir),
two processes at a time, and only those the selected tests need (``-k mixtral`` runs
mixtral's alone). gemma3 is imported twice: from the ``Gemma3ForCausalLM`` files as written,
and from the renamed copy the reference reads (``gemma3-renamed-…``), so that a naming gap and
a value difference tell apart.

1. ``test_hf_checkpoints``: the inputs are what the cases claim (tied, per-expert, sharded;
   llama_bf16 is llama_f32 rounded to nearest even, as to_maxtext rounds with torch).
2. ``test_reference_stacking``: for llama3.1 and qwen3-moe, stacking to_maxtext's unscanned
   output gives its scanned output bit for bit (the rule scanned mixtral's reference uses).
3. ``test_stacked_mixtral_reads_back``: MaxText's ``to_huggingface`` reads the stacked mixtral
   reference (saved with stock Orbax) and gives back the original tensors, exactly.
4. ``test_comparison_catches``: the comparison reports two swapped layers and a dropped hook.
5. ``test_import_matches_reference[case]``: ``python -m orbax_maxtext_layout import-hf HF_DIR
   --out OUT --save-dtype D --maxtext-config <base.yml> KEY=VALUE... scan_layers=…`` in a
   process of its own (forked from the same server, this checkout's library on its path);
   ``OUT/0`` restored with stock Orbax equals the reference: the same tree paths and value
   types, every params leaf with the same dtype, shape and bytes, the same ``step`` (int64 0)
   and custom_metadata ``scan_layers``.
6. ``test_to_huggingface_reads_import[case]``: MaxText's ``to_huggingface`` reads the import and
   gives back the original HF tensors: exact, except llama's ``q_proj`` (the query is scaled by
   1/sqrt(head_dim) on the way in and back on the way out): ≤ 1 ulp in float32.

Case ids start with the family: ``-k llama31``, ``-k qwen3tied``, ``-k qwen3moe``,
``-k mixtral``, ``-k gemma3``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import import_hf_support as H
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    not H.hf_python(),
    reason=f"{H.HF_PYTHON_ENV} is not set: it names the hf venv's python (transformers + CPU "
    "torch, Python 3.11, constraints/hf.txt), which .ci/interop.sh builds and sets",
)

CASES = {c.id: c for c in H.CASES}
STACKED = {"llama31": ("llama_f32_unscanned", "llama_f32_scanned"),
           "qwen3moe": ("qwen3moe_unscanned", "qwen3moe_scanned")}  # fmt: skip
ROUND_TRIPS = ["llama31-f32-scanned", "mixtral-f32-scanned"]
Q_PROJ = ".self_attn.q_proj.weight"


# tests that use a reference without a parameter naming it
FIXED_REFS = {
    "test_stacked_mixtral_reads_back": {"mixtral_unscanned"},
    "test_comparison_catches": {"llama_f32_scanned"},
}
IMPORTING = ("test_import_matches_reference", "test_to_huggingface_reads_import")


def _wanted(request) -> tuple[set[str], list[H.Case]]:
    """The references and the import cases the selected tests of this module use (all made
    at once, two processes at a time; ``-k`` leaves out what it deselects)."""
    refs: set[str] = set()
    cases: list[H.Case] = []
    for item in request.session.items:
        if item.module.__name__ != __name__:
            continue
        refs |= FIXED_REFS.get(item.originalname, set())
        params = item.callspec.params if hasattr(item, "callspec") else {}
        value = params.get("case_id", params.get("family"))
        if value in CASES:
            refs.add(CASES[value].ref)
            if item.originalname in IMPORTING and CASES[value] not in cases:
                cases.append(CASES[value])
        elif value in STACKED:
            refs |= set(STACKED[value])
    refs |= {H.REFS[n].stack_of for n in refs if H.REFS[n].stack_of}
    return refs, cases


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("import_hf")


@pytest.fixture(scope="module")
def hf_dirs(work, tmp_path_factory) -> dict[str, Path]:
    """Every HF checkpoint (import_hf_support.hf_checkpoints: one hf-venv child, seconds, once
    per pytest run), plus ``gemma3_renamed`` (this module's)."""
    dirs = H.hf_checkpoints(tmp_path_factory, list(H.HF))
    dirs["gemma3_renamed"] = H.rename_gemma3(dirs["gemma3"], work / "gemma3_renamed")
    return dirs


@dataclasses.dataclass
class References:
    """Reference name -> ``Step`` (read with stock Orbax), made on first use."""

    work: Path
    hf_dirs: dict[str, Path]
    procs: dict = dataclasses.field(default_factory=dict)
    steps: dict = dataclasses.field(default_factory=dict)

    def source(self, name: str) -> Path:
        hf = H.REFS[name].hf
        return self.hf_dirs["gemma3_renamed" if hf == "gemma3" else hf]

    def out(self, name: str) -> Path:
        return self.work / "reference" / name

    def make(self, names: set[str]) -> None:
        """Runs the to_maxtext references ``names`` not made yet, two at a time."""
        todo = sorted(n for n in names if not H.REFS[n].stack_of and n not in self.procs)
        procs = H.run_all([H.reference_job(n, self.source(n), self.out(n)) for n in todo])
        for n in todo:
            self.procs[n] = procs[f"to_maxtext_{n}"]
        times = {n: round(p.seconds, 1) for n, p in self.procs.items()}
        (self.work / "reference_seconds.json").write_text(json.dumps(times, indent=1))

    def __getitem__(self, name: str) -> H.Step:
        if name not in self.steps:
            r = H.REFS[name]
            if r.stack_of:
                self.steps[name] = H.stack_layers(self[r.stack_of])
            else:
                self.make({name})
                proc = self.procs[name]
                assert proc.returncode == 0, proc.why()
                self.steps[name] = H.read_step(self.out(name) / "0")
        return self.steps[name]


@pytest.fixture(scope="module")
def references(request, work, hf_dirs) -> References:
    refs = References(work, hf_dirs)
    refs.make(_wanted(request)[0])
    return refs


@pytest.fixture(scope="module")
def imports(request, work, hf_dirs) -> dict[str, tuple[object, Path]]:
    """Case id -> (its ``import-hf`` process, ``--out``), every selected case, two at a time."""
    cases = _wanted(request)[1]
    outs = {c.id: work / "import" / c.id / "out" for c in cases}
    jobs = [H.import_job(c, hf_dirs[c.source or c.hf], outs[c.id]) for c in cases]
    procs = H.run_all(jobs)
    return {c.id: (procs[f"import_hf_{c.id}"], outs[c.id]) for c in cases}


def imported(imports, case_id: str) -> H.Step:
    """The import's step, read with stock Orbax; ``--out`` holds ``0`` alone, and nothing is
    left beside it (no work directory)."""
    proc, out = imports[case_id]
    assert proc.returncode == 0, proc.why()
    assert sorted(p.name for p in out.iterdir()) == ["0"], sorted(out.iterdir())
    beside = sorted(p.name for p in out.parent.iterdir())
    assert beside == [f"{proc.name}.log", "out"], beside
    step_dir = out / "0"
    assert (step_dir / "_CHECKPOINT_METADATA").is_file()
    assert (step_dir / "items" / "_METADATA").is_file()
    return H.read_step(step_dir)


# ----------------------------------------------------------------------------- the inputs


def test_hf_checkpoints(hf_dirs):
    t = {n: H.read_hf(d) for n, d in hf_dirs.items()}
    assert "lm_head.weight" not in t["qwen3_tied"] and "lm_head.weight" in t["llama_f32"]
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in t["mixtral"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in t["qwen3moe"]
    assert not any("gate_up_proj" in k or k.endswith("experts.down_proj") for k in t["qwen3moe"])
    assert "model.norm.weight" in t["gemma3"] and len(t["gemma3"]) == 2 + 14 * 13
    sharded = hf_dirs["llama_bf16_sharded"]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert H.S.hf_diff(t["llama_bf16_sharded"], t["llama_bf16"]) == []
    # llama_bf16 is llama_f32 rounded to nearest even (ml_dtypes astype, as to_maxtext with torch)
    rounded = {k: v.astype(t["llama_bf16"][k].dtype) for k, v in t["llama_f32"].items()}
    assert {str(v.dtype) for v in t["llama_bf16"].values()} == {"bfloat16"}
    assert H.S.hf_diff(rounded, t["llama_bf16"]) == []
    renamed = {
        k.replace("model.language_model.", "model.", 1): v for k, v in t["gemma3_renamed"].items()
    }
    assert H.S.hf_diff(renamed, t["gemma3"]) == []


# ----------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("family", sorted(STACKED))
def test_reference_stacking(references, family):
    unscanned, scanned = STACKED[family]
    assert H.step_diff(H.stack_layers(references[unscanned]), references[scanned]) == []


def test_stacked_mixtral_reads_back(references, hf_dirs, work):
    stacked = references["mixtral_scanned"]
    assert stacked.params["decoder", "layers", "MoeBlock_0", "wi_0"].shape == (4, 2, 32, 64)
    assert stacked.params["decoder", "layers", "MoeBlock_0", "gate", "kernel"].shape == (32, 2, 4)
    step = H.write_step(stacked, work / "mixtral_stacked")
    out = work / "mixtral_stacked_hf"
    job = H.to_huggingface_job("to_hf_mixtral_stacked", step / "items", out, "mixtral", True)
    proc = H.run_all([job])[job.name]
    assert proc.returncode == 0, proc.why()
    assert H.S.hf_diff(H.read_hf(out), H.read_hf(hf_dirs["mixtral"])) == []


def test_comparison_catches(references):
    want = references["llama_f32_scanned"]
    assert H.step_diff(want, want) == []
    q = ("decoder", "layers", "self_attention", "query", "kernel")
    swapped = dict(want.params)
    swapped[q] = want.params[q][:, [1, 0, 2]]  # layers 0 and 1
    diff = H.step_diff(dataclasses.replace(want, params=swapped), want)
    assert len(diff) == 1 and diff[0].startswith("decoder/layers/self_attention/query/kernel:")
    unscaled = dict(want.params)  # the query hook's 1/sqrt(head_dim) left out
    unscaled[q] = (want.params[q] * np.float32(np.sqrt(8))).astype(np.float32)
    assert len(H.step_diff(dataclasses.replace(want, params=unscaled), want)) == 1
    assert H.step_diff(dataclasses.replace(want, custom={"scan_layers": False}), want)


# ----------------------------------------------------------------------------- ours


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_reference(imports, references, case_id):
    case = CASES[case_id]
    diff = H.step_diff(imported(imports, case_id), references[case.ref])
    assert diff == [], f"{case_id}: {len(diff)} differences from {case.ref}:\n" + "\n".join(diff)


@pytest.mark.parametrize("case_id", ROUND_TRIPS)
def test_to_huggingface_reads_import(imports, hf_dirs, work, case_id):
    case = CASES[case_id]
    imported(imports, case_id)
    _, out = imports[case_id]
    hf_out = work / "to_hf" / case_id
    job = H.to_huggingface_job(
        f"to_hf_{case_id}", out / "0" / "items", hf_out, case.family, case.scan_layers
    )
    proc = H.run_all([job])[job.name]
    assert proc.returncode == 0, proc.why()
    got, want = H.read_hf(hf_out), H.read_hf(hf_dirs[case.hf])
    exact = {k: v for k, v in got.items() if not (case.family == "llama3.1" and k.endswith(Q_PROJ))}
    assert H.S.hf_diff(exact, {k: want[k] for k in exact if k in want}) == []
    assert sorted(got) == sorted(want)
    for k in sorted(set(got) - set(exact)):
        assert got[k].dtype == want[k].dtype == np.float32 and got[k].shape == want[k].shape, k
        assert int(H.ulps_f32(got[k], want[k]).max()) <= 1, k
