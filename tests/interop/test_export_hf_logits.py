"""Interop (issue 24): transformers' model on `export-hf`'s output gives MaxText's logits.

Three steps of MaxText 0.2.5's own tiny models (tests/fixtures/maxtext025, read-only, copied
first):

- ``llama_maxtext``: ``pretrain_run/checkpoints/1``, a scanned MaxText step (llama3.1 override,
  3 layers, untied ``logits_dense``);
- ``llama_tunix``: ``sft_run/checkpoints/2``, a Tunix step of the same model (``train_sft``);
- ``qwen3_tunix``: ``qwen3_sft_run/checkpoints/2``, a Tunix step of a tiny qwen3-0.6b (2 layers,
  q/k norms, 1 kv head, logits tied to the embedding).

Each is exported by this library's CLI (``export-hf STEP --out OUT
--override-model-architecture --maxtext-config <base.yml> <model keys>``). Then, on one fixed
token batch:

- **MaxText's logits**: a child of the interop venv (``child_main`` below, as in
  test_lora.py; forked from the suite's MaxText fork server) builds each model with MaxText's
  own ``model_creation_utils.from_pretrained`` from the step itself
  (``load_parameters_path=<step>/items`` for the MaxText step, ``<step>/model_params`` for the
  Tunix ones, which 0.2.5's ``from_pretrained`` reads as an NNX tree: no code of this library
  is on that path) and runs it with ``enable_dropout=False``. The child also returns the
  weights the model holds, which must be the step's, bit for bit (so a silently kept init
  could not pass).
- **transformers' logits**: a child of the **hf venv** (``OMTL_HF_PYTHON``: Python 3.11 with
  the CPU build of torch 2.13.0 and transformers 5.24.0, constraints/hf.txt; .ci/interop.sh
  builds it and sets the variable) runs hf_logits_child.py:
  ``AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)``, ``eval()``, no cache.
  transformers must report no missing, unexpected or mismatched tensor.

The token batch is 2 x 64 tokens (``tokens()``): 64 positions reach llama3.1's scaled RoPE
frequency. What holds, in float32, with MaxText's default ``matmul_precision`` (no setting
changed; on CPU that is full float32):

- **llama (untied)**: max |transformers - MaxText| < 1e-4 (measured 2.1e-6 and 2.4e-6).
- **qwen3 (tied)**: MaxText 0.2.5 computes tied logits with the embedding table **rounded to
  bfloat16** (``layers/embeddings.py: attend_on_embedding`` casts it with
  ``jnp.asarray(embedding_table, jnp.bfloat16)``, whatever ``dtype``/``weight_dtype`` say;
  no config key turns it off). transformers multiplies by the float32 table, so the plain
  logits differ by 3.4e-2 (logits up to ~20). With the same rounding applied to the output
  head on the transformers side (``bf16_head``; the exported float32 tensors are unchanged)
  the difference is < 1e-4 (measured 7.2e-6): everything else matches. The plain difference
  is asserted to stay in (1e-4, 0.1), so a change of this MaxText behaviour is noticed.

The checks cannot pass vacuously (each measured once, asserted with a margin):

- transformers on the export of the other llama step (2 updates apart at lr ~2e-5) misses the
  MaxText logits by 1.8e-3 (asserted > 10x the tolerance);
- the llama head rounded to bfloat16 misses by 8.2e-3 (> 10x): the rounding that explains
  qwen3's difference is visible at this tolerance and matches only where MaxText rounds;
- q/k rows left in the interleaved RoPE order (the permutation MaxText's hooks apply,
  undone) miss by 2.6, and plain RoPE in place of config.json's llama3 scaling by 5.7e-2
  (asserted > 100x).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hf_export_support as S
import maxtext_loop_support as L
import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
HF_PYTHON_ENV = "OMTL_HF_PYTHON"
HF_PYTHON = os.environ.get(HF_PYTHON_ENV, "")
pytestmark = pytest.mark.skipif(
    not HF_PYTHON,
    reason=f"{HF_PYTHON_ENV} is not set: it names the hf venv's python (transformers + CPU torch, "
    "Python 3.11, constraints/hf.txt), which .ci/interop.sh builds and sets",
)

TOLERANCE = 1e-4  # max abs logit difference, float32
CHILD_TIMEOUT_S = 600
BATCH, LENGTH = 2, 64
GEN = L.generator()


@dataclasses.dataclass(frozen=True)
class Model:
    step: Path  # the fixture step
    item: str  # what MaxText loads: the step's items (MaxText) or model_params (Tunix)
    keys: tuple[str, ...]  # the model's MaxText config keys (export-hf's; no scan_layers)
    tied: bool  # logits tied to the embedding (``logits_via_embedding``)
    hf_class: str

    @property
    def maxtext_keys(self) -> list[str]:
        """MaxText's side initializes with another seed than the fixtures' (weights it did
        not load would not pass for loaded ones)."""
        keys = [k for k in self.keys if not k.startswith("init_weights_seed=")]
        return [*keys, f"init_weights_seed={L.INIT_SEED}"]


MODELS = {
    "llama_maxtext": Model(
        L.PRETRAIN_STEP, "items", tuple(S.model_keys()), False, "LlamaForCausalLM"
    ),
    "llama_tunix": Model(
        L.SFT_STEP, "model_params", tuple(S.model_keys()), False, "LlamaForCausalLM"
    ),
    "qwen3_tunix": Model(
        L.FIXTURE / "qwen3_sft_run" / "checkpoints" / "2",
        "model_params",
        tuple(k for k in GEN.QWEN3_MODEL_KEYS if not k.startswith("scan_layers=")),
        True,
        "Qwen3ForCausalLM",
    ),
}
UNTIED = [name for name, m in MODELS.items() if not m.tied]


def tokens() -> np.ndarray:
    return np.random.RandomState(0).randint(0, 64, (BATCH, LENGTH)).astype(np.int32)


# ----------------------------------------------------------------------------- the MaxText child


def _run_keys() -> list[str]:
    """The fixture generator's RUN_KEYS, ``max_target_length`` set to the batch's length."""
    keys = [k for k in GEN.RUN_KEYS if not k.startswith("max_target_length=")]
    return [*keys, f"max_target_length={LENGTH}"]


def child_main(jobs_path: str, out_path: str) -> None:
    """For each job: MaxText's model from the step (``from_pretrained``), its logits on
    ``tokens()`` and the weights it holds (``<name>::<param path>``)."""
    import jax
    from flax import nnx
    from flax.linen import partitioning as nn_partitioning
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils

    start = time.monotonic()
    print(f"imports: {start - T0:.1f} s", flush=True)
    jobs = json.loads(Path(jobs_path).read_text())
    out: dict[str, np.ndarray] = {}
    batch = tokens()
    positions = np.broadcast_to(np.arange(batch.shape[1], dtype=np.int32), batch.shape)
    for job in jobs:
        argv = [
            "logits",
            str(L.base_yml()),
            *job["keys"],
            *_run_keys(),
            "dataset_type=synthetic",
            "steps=1",
            f"base_output_directory={job['out']}",
            f"run_name={job['name']}",
            f"load_parameters_path={job['load']}",
        ]
        config = pyconfig.initialize_pydantic(argv)
        model, mesh = model_creation_utils.from_pretrained(config)
        loaded = time.monotonic()
        for path, x in jax.tree_util.tree_leaves_with_path(
            nnx.state(model, nnx.Param).to_pure_dict()
        ):
            out[f"{job['name']}::{L.path_str(path)}"] = np.array(x)
        with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
            logits = model(
                decoder_input_tokens=batch,
                decoder_positions=positions,
                decoder_segment_ids=np.ones_like(batch),
                enable_dropout=False,
            )
        out[job["name"]] = np.array(logits, dtype=np.float32)
        now = time.monotonic()
        print(
            f"maxtext logits {job['name']}: {out[job['name']].shape}; model {loaded - start:.1f} s,"
            f" forward {now - loaded:.1f} s",
            flush=True,
        )
        start = now
    np.savez(out_path, **out)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(
        {
            "JAX_PLATFORMS": "cpu",
            "PYTHONHASHSEED": "0",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **extra,
        }
    )
    return env


def _start(argv: list[str], work: Path, name: str, env: dict[str, str]) -> subprocess.Popen:
    with open(work / f"{name}.log", "wb") as log:  # the child holds its own copy
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _finish(proc: subprocess.Popen, work: Path, name: str, out: Path) -> dict[str, np.ndarray]:
    try:
        rc = proc.wait(timeout=CHILD_TIMEOUT_S)
    finally:
        _stop(proc)
    tail = "\n".join((work / f"{name}.log").read_text(errors="replace").splitlines()[-40:])
    assert rc == 0, f"{name} child: exit {rc}\n{tail}"
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export_hf_logits")


@pytest.fixture(scope="module")
def steps(work) -> dict[str, Path]:
    """Writable copies of the fixture steps (``.../checkpoints/<n>``)."""
    out = {}
    for name, m in MODELS.items():
        out[name] = L.copy_tree(m.step, work / "steps" / name / "checkpoints" / m.step.name)
    return out


@pytest.fixture(scope="module")
def results(work, steps) -> dict[str, Any]:
    """MaxText's child (started first, it runs while the exports are made), the exports
    (this library's CLI, in this process), then transformers' child on them."""
    assert Path(HF_PYTHON).is_file(), f"{HF_PYTHON_ENV}={HF_PYTHON}: no such file"
    root = work / "children"
    root.mkdir()
    jobs = [
        dict(
            name=name,
            keys=m.maxtext_keys,
            load=str(steps[name] / m.item),
            out=str(root / "maxtext_out"),
        )
        for name, m in MODELS.items()
    ]
    (root / "maxtext_jobs.json").write_text(json.dumps(jobs))
    mt_out = root / "maxtext.npz"
    # this file's `child_main`, forked from the suite's MaxText fork server (hf_export_support.run:
    # on CPU, offline, PYTHONHASHSEED=0, without the library), while the exports run here
    argv = (sys.executable, str(Path(__file__)), "logits", str(root / "maxtext_jobs.json"))
    job = S.Job("maxtext", root, (*argv, str(mt_out)), timeout=CHILD_TIMEOUT_S)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    maxtext = pool.submit(S.run, job)
    pool.shutdown(wait=False)
    try:
        # Imported here: the MaxText child runs this file without the library.
        from orbax_maxtext_layout import cli

        exports = {}
        for name, m in MODELS.items():
            out = work / "hf" / name
            argv = ["export-hf", str(steps[name]), "--out", str(out)]
            argv += [
                "--override-model-architecture",
                "--maxtext-config",
                str(L.base_yml()),
                *m.keys,
            ]
            assert cli.main(argv) == 0, argv
            exports[name] = out

        hf_jobs = [dict(name=n, dir=str(d), variant="plain") for n, d in exports.items()]
        hf_jobs += [
            dict(name=f"{n}::bf16_head", dir=str(d), variant="bf16_head")
            for n, d in exports.items()
        ]
        hf_jobs += [
            dict(name=f"llama_maxtext::{v}", dir=str(exports["llama_maxtext"]), variant=v)
            for v in ("qk_interleaved", "rope_default")
        ]
        spec = {"tokens": tokens().tolist(), "jobs": hf_jobs}
        (root / "hf_jobs.json").write_text(json.dumps(spec))
        hf_out = root / "hf.npz"
        hf = _start(
            [HF_PYTHON, str(HERE / "hf_logits_child.py"), str(root / "hf_jobs.json"), str(hf_out)],
            root,
            "hf",
            _env(OMP_NUM_THREADS="1"),
        )
        hf_logits = _finish(hf, root, "hf", hf_out)
    finally:
        done = maxtext.result()  # (it ends by itself, within its timeout)
    assert done.returncode == 0, done.why()
    with np.load(mt_out) as z:
        mt = {k: z[k] for k in z.files}
    info = {
        k.removesuffix("::info"): json.loads(str(v))
        for k, v in hf_logits.items()
        if k.endswith("::info")
    }
    hf_logits = {k: v for k, v in hf_logits.items() if not k.endswith("::info")}
    return {"maxtext": mt, "hf": hf_logits, "info": info, "exports": exports}


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape == (BATCH, LENGTH, 64), (a.shape, b.shape)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("name", MODELS)
def test_maxtext_model_holds_the_step_weights(name, results, steps):
    """MaxText's model is built from the step: every Param equals the stored weight, bit for
    bit (its init seed differs from the fixtures')."""
    prefix = f"{name}::"
    mt = results["maxtext"]
    got = {k.removeprefix(prefix): L.Leaf.of(v) for k, v in mt.items() if k.startswith(prefix)}
    raw = L.read_item(steps[name] / MODELS[name].item)
    if MODELS[name].item == "items":
        want = {k.removeprefix("params/params/"): v for k, v in L.weights(raw).items()}
    else:  # a Tunix model_params item: weights end in /value, RNG state is not a Param
        want = {k.removesuffix("/value"): v for k, v in raw.items() if "/rngs/" not in k}
    assert L.diff(got, want) == []


@pytest.mark.parametrize("name", MODELS)
def test_transformers_loads_every_exported_tensor(name, results):
    info = results["info"][name]
    assert info["class"] == MODELS[name].hf_class
    assert info["tie_word_embeddings"] is MODELS[name].tied
    assert info["param_dtypes"] == ["torch.float32"]
    assert {k: v for k, v in info["loading"].items() if v} == {}, info["loading"]


@pytest.mark.parametrize("name", UNTIED)
def test_untied_logits_match_maxtext(name, results):
    """llama: transformers' logits on the export are MaxText's, within 1e-4 in float32."""
    diff = max_diff(results["hf"][name], results["maxtext"][name])
    assert diff < TOLERANCE, f"{name}: max |transformers - MaxText| = {diff:.3g}"


def test_tied_logits_match_maxtext_with_its_bfloat16_table(results):
    """qwen3 (tied): within 1e-4 once the output head is rounded to bfloat16 as MaxText 0.2.5
    rounds its embedding table for the logits; 1e-4 < plain difference < 0.1 (that rounding)."""
    name = "qwen3_tunix"
    mt = results["maxtext"][name]
    check = results["info"][f"{name}::bf16_head"]["head_reproduces_logits"]
    assert check < 1e-5, f"hidden @ head.T is not transformers' logits: {check}"
    rounded = max_diff(results["hf"][f"{name}::bf16_head"], mt)
    assert rounded < TOLERANCE, f"max |transformers (bf16 head) - MaxText| = {rounded:.3g}"
    plain = max_diff(results["hf"][name], mt)
    assert TOLERANCE < plain < 0.1, f"max |transformers - MaxText| = {plain:.3g}"


@pytest.mark.parametrize("name", UNTIED)
def test_a_bf16_head_misses_untied_logits(name, results):
    """The untied llama head is a float32 ``logits_dense`` in MaxText, and rounding it to
    bfloat16 on the transformers side moves the logits off MaxText's by > 10x the tolerance:
    the rounding is visible at this tolerance, and matches only where MaxText does it."""
    assert results["info"][f"{name}::bf16_head"]["head_reproduces_logits"] < 1e-5
    diff = max_diff(results["hf"][f"{name}::bf16_head"], results["maxtext"][name])
    assert diff > 10 * TOLERANCE, diff


# ----------------------------------------------------------------------------- not vacuous


def test_another_steps_export_misses_the_logits(results):
    """The two llama steps are 2 updates (lr ~2e-5) apart: the test tells them apart."""
    hf, mt = results["hf"], results["maxtext"]
    for a, b in (("llama_tunix", "llama_maxtext"), ("llama_maxtext", "llama_tunix")):
        diff = max_diff(hf[a], mt[b])
        assert diff > 10 * TOLERANCE, f"transformers on {a} vs MaxText on {b}: {diff:.3g}"


def test_an_export_without_the_rope_permutation_misses_the_logits(results):
    info = results["info"]["llama_maxtext::qk_interleaved"]
    assert len(info["interleaved"]) == 2 * 3  # q_proj and k_proj of 3 layers
    diff = max_diff(
        results["hf"]["llama_maxtext::qk_interleaved"], results["maxtext"]["llama_maxtext"]
    )
    assert diff > 100 * TOLERANCE, diff


def test_a_config_without_llama3_rope_scaling_misses_the_logits(results):
    """The same tensors under plain RoPE (config.json's llama3 scaling dropped) miss: the
    batch's 64 positions reach the scaled frequency, so the config is checked too."""
    info = results["info"]["llama_maxtext::rope_default"]
    assert info["rope_parameters"]["rope_type"] == "default"
    diff = max_diff(
        results["hf"]["llama_maxtext::rope_default"], results["maxtext"]["llama_maxtext"]
    )
    assert diff > 100 * TOLERANCE, diff


if __name__ == "__main__":
    T0 = time.monotonic()
    if sys.argv[1:2] == ["logits"]:
        child_main(*sys.argv[2:4])
    else:
        sys.exit(f"usage: {sys.argv[0]} logits JOBS.json OUT.npz")
