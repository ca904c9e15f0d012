"""Interop: LoRA on a block-scanned family (gemma3) and on MoE experts (mixtral), merged by this
library and judged by MaxText 0.2.5's own LoRA model; and MaxText's training loop resuming each
family's Tunix SFT run through the runner.

The steps are the frozen fixtures of tests/fixtures/maxtext025 (their README, "gemma3 and
mixtral"), copied first:

- ``gemma3_lora_run/checkpoints/2``: ``train_sft`` with qwix LoRA (rank 4, alpha 8, MaxText's
  automatic gemma3 module path) on the 7 projections of each of the six block-scan groups
  ``decoder/layers/layers_<k>`` (scan length 2, axis 1), from ``gemma3_pretrain_run/checkpoints/0``;
- ``mixtral_lora_run/checkpoints/2``: the same on attention, the router ``MoeBlock_0/gate`` and
  the expert weights ``MoeBlock_0/{wi_0,wi_1,wo}`` (module path ``MIXTRAL_LORA_MODULE_PATH``),
  trained with ``sparse_matmul=false``: qwix adapts only the dense MoE path's einsums. An
  expert weight's factors are qwix's einsum factors (``wi_0 (experts, layers, emb, mlp)``:
  ``a (emb, layers, r)``, ``b (r, layers, experts, mlp)``; ``wo (experts, layers, mlp, emb)``:
  ``a (experts, layers, mlp, r)``, ``b (r, layers, emb)``), not reshapes of a matrix;
- ``gemma3_sft_run/checkpoints/2``, ``mixtral_sft_run/checkpoints/2``: Tunix SFT steps.

What proves what:

- *the merge is the LoRA model*: MaxText's plain model built from ``merge-lora``'s output gives
  the logits of MaxText's LoRA model, built as ``train_sft`` builds it (``from_pretrained`` on
  the base, ``lora_utils.apply_lora_to_model`` with the fixture's module path and MoE path,
  ``lora_utils.restore_lora_from_path``), within ``TOLERANCE``; with the trained adapters
  (which move the logits by only ~1e-3) and with random ones of real magnitude. It cannot pass
  vacuously: the LoRA model holds the step's factors bit for bit (mixtral's experts included),
  the plain base model misses by far more, and so does every wrong merge: a wrong scale (the
  library's own merge with alpha halved), for gemma3 each block-scan group's delta on the
  wrong scan step or on the next group, for mixtral the experts' delta laid out as a plain
  reshape of ``a @ b``, or left out. The LoRA models run in one child per family
  (lora_logits_support), the two side by side;
- *qwix's einsums*: the LoRA model records the einsum qwix rewrote for each expert weight; the
  merged kernels equal an independent numpy merge written from those einsums;
- *the MoE path*: the merged step gives the LoRA logits on MaxText's default MoE path too
  (what pre-training runs), while a LoRA model built on that path holds no expert adapters at
  all (``restore_lora_from_path`` silently leaves the step's expert factors out);
- *unrolled*: ``merge-lora --unroll`` of the gemma3 step gives the LoRA logits on MaxText's
  unscanned model;
- *export*: ``export-hf <lora step> --base`` equals ``export-hf`` of ``merge-lora``'s output
  byte for byte, and differs from the export of the base in the adapted projections only;
- *training resumes*: ``python -m orbax_maxtext_layout.maxtext maxtext.trainers.pre_train.train``
  on a run whose latest step is the family's Tunix SFT step resumes from it and trains a step;
  the probe (maxtext_loop_support) shows it started from the SFT step's state bit for bit.
  Stock MaxText fails on the same run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import hf_export_support as S
import lora_logits_support as LS
import maxtext_loop_support as L
import numpy as np
import pytest

from orbax_maxtext_layout import cli

GEN = L.generator()
RANK = GEN.LORA_RANK  # 4
ALPHA = float(GEN.LORA_ALPHA)  # 8
SCALE = ALPHA / RANK
TOLERANCE = 5e-5  # max abs logit difference, float32
RANDOM_SCALE = 0.1
LAYER_AXIS = 1  # param_scan_axis=1: kernels and factors stack their scan steps on axis 1


@dataclasses.dataclass(frozen=True)
class Family:
    keys: tuple[str, ...]  # the fixture runs' model keys
    lora_keys: tuple[str, ...]  # further keys the LoRA run was trained with
    module_path: str | None  # lora.lora_module_path of the LoRA run (None: MaxText's automatic)
    n_adapted: int  # adapted weights
    hf_adapted: tuple[str, ...]  # Hugging Face tensors of one layer the adapters change
    hf_layers: int
    hf_prefix: str

    @property
    def lora_model_keys(self) -> list[str]:
        return [*self.keys, *self.lora_keys]

    def hf_names(self) -> set[str]:
        return {
            f"{self.hf_prefix}layers.{i}.{n}.weight"
            for i in range(self.hf_layers)
            for n in self.hf_adapted
        }


_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
FAMILIES = {
    "gemma3": Family(
        keys=tuple(GEN.GEMMA3_MODEL_KEYS),
        lora_keys=(),
        module_path=None,  # MaxText's gemma3 entry of lora_module_path.yml
        n_adapted=42,  # 7 projections in each of layers_0 .. layers_5
        hf_adapted=(*_PROJ, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
        hf_layers=12,
        hf_prefix="model.language_model.",
    ),
    "mixtral": Family(
        keys=tuple(GEN.MIXTRAL_MODEL_KEYS),
        lora_keys=tuple(GEN.MIXTRAL_LORA_EXTRA_KEYS),  # sparse_matmul=false
        module_path=GEN.MIXTRAL_LORA_MODULE_PATH,
        n_adapted=8,  # q, k, v, out, the router gate, wi_0, wi_1, wo
        hf_adapted=(
            *_PROJ,
            "block_sparse_moe.gate",
            *(f"block_sparse_moe.experts.{e}.w{i}" for e in range(4) for i in (1, 2, 3)),
        ),
        hf_layers=2,
        hf_prefix="model.",
    ),
}
ADAPTERS = ("trained", "random")
# Wrong merges of the random adapters, per family; each must miss the LoRA logits by far.
WRONG = {
    "gemma3": ("half_alpha", "scan_steps_swapped", "blocks_rotated"),
    "mixtral": ("half_alpha", "experts_reshaped", "experts_left_out"),
}
GEMMA3_BLOCKS = 6

# MaxText's dense MoE einsums (layers/moe.py, sparse_matmul=false) and what qwix 0.1.8 makes of
# them (LoraProvider.einsum: the input's dims the weight shares go to a, the rest to b): the
# einsum qwix records for each expert weight (``<weight>_lora_einsum_str``), and the per-layer
# delta it amounts to, ``einsum(a, b) -> kernel`` in the kernel's own dim order.
QWIX_EINSUMS = {
    "wi_0": "BSM,Mr,rEH->BSEH",  # MaxText: BSM,EMH -> BSEH
    "wi_1": "BSM,Mr,rEH->BSEH",
    "wo": "BSEH,EHr,rM->BSEM",  # MaxText: BSEH,EHM -> BSEM
}
KERNEL_DIMS = {"wi_0": "EMH", "wi_1": "EMH", "wo": "EHM"}


def delta_einsum(weight: str) -> str | None:
    """``"a,b->kernel"`` of an expert weight's per-layer delta, from qwix's einsum."""
    if weight not in QWIX_EINSUMS:
        return None
    a, b = QWIX_EINSUMS[weight].split("->")[0].split(",")[1:]
    return f"{a},{b}->{KERNEL_DIMS[weight]}"


def fixture(family: str, run: str) -> Path:
    step = "0" if run.startswith("pretrain") else "2"
    return L.FIXTURE / f"{family}_{run}_run" / "checkpoints" / step


# ----------------------------------------------------------------------------- the reference


def factors(step: Path) -> dict[str, np.ndarray]:
    """``<module path>/<weight>_lora_{a,b}`` -> array, from the step's model_params."""
    return {
        p.removesuffix("/value"): x.array for p, x in L.read_item(step / "model_params").items()
    }


def adapted(ab: dict[str, np.ndarray]) -> dict[str, tuple[str, str]]:
    """``params/params/<weight path>`` -> (a, b) factor paths: ``m/kernel_lora_a`` adapts
    ``m/kernel``, an expert weight's ``MoeBlock_0/wi_0_lora_a`` adapts ``MoeBlock_0/wi_0``."""
    return {
        "params/params/" + p.removesuffix("_lora_a"): (p, p.removesuffix("_a") + "_b")
        for p in ab
        if p.endswith("_lora_a")
    }


def layer_delta(weight: str, a: np.ndarray, b: np.ndarray, shape, *, reshape: bool) -> np.ndarray:
    """One layer's ``a @ b`` over the rank, in the kernel's dim order: qwix's einsum for an
    expert weight; a reshape of the matrix product for a dense kernel (or, ``reshape``, for
    every weight: the wrong merge of an expert weight)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    spec = None if reshape else delta_einsum(weight)
    if spec is None:
        return (a.reshape(-1, RANK) @ b.reshape(RANK, -1)).reshape(shape)
    return np.einsum(spec, a, b)


def deltas(
    base: dict[str, np.ndarray], ab: dict[str, np.ndarray], *, reshape: bool = False
) -> dict[str, np.ndarray]:
    """``params/params/...`` -> the scanned delta (float64) of each adapted kernel, per layer."""
    out = {}
    for kernel, (pa, pb) in adapted(ab).items():
        w = base[kernel]
        name = kernel.rsplit("/", 1)[-1]
        shape = tuple(np.delete(w.shape, LAYER_AXIS))
        layers = [
            layer_delta(
                name,
                np.take(ab[pa], i, LAYER_AXIS),
                np.take(ab[pb], i, LAYER_AXIS),
                shape,
                reshape=reshape,
            )
            for i in range(w.shape[LAYER_AXIS])
        ]
        out[kernel] = np.stack(layers, LAYER_AXIS)
    return out


def with_deltas(base: dict[str, np.ndarray], d: dict[str, np.ndarray], scale: float = SCALE):
    out = dict(base)
    for kernel, delta in d.items():
        out[kernel] = (base[kernel].astype(np.float64) + scale * delta).astype(base[kernel].dtype)
    return out


def wrong_deltas(family: str, variant: str, base, ab) -> dict[str, np.ndarray]:
    """The deltas of a wrong merge (numpy-written variants)."""
    right = deltas(base, ab)
    if variant == "scan_steps_swapped":  # each group's scan steps get each other's delta
        return {k: np.flip(d, LAYER_AXIS) for k, d in right.items()}
    if variant == "blocks_rotated":  # layers_<k>'s delta on layers_<k+1>
        out = {}
        for k, d in right.items():
            block = int(k.split("/layers/layers_")[1].split("/")[0])
            nxt = (block + 1) % GEMMA3_BLOCKS
            out[k.replace(f"/layers_{block}/", f"/layers_{nxt}/")] = d
        return out
    if variant == "experts_reshaped":
        return deltas(base, ab, reshape=True)
    if variant == "experts_left_out":
        return {k: d for k, d in right.items() if k.rsplit("/", 1)[-1] not in QWIX_EINSUMS}
    raise AssertionError(variant)


def write_param_step(flat: dict[str, np.ndarray], dest: Path) -> Path:
    """A MaxText param-only step ``dest/0/items`` (``params/params/...``) of ``flat``."""
    import orbax.checkpoint as ocp
    from etils import epath

    tree: dict[str, Any] = {}
    for p, x in flat.items():
        *parents, leaf = p.split("/")
        node = tree
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = x
    manager = ocp.CheckpointManager(
        epath.Path(dest),
        item_handlers={"items": ocp.PyTreeCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
    )
    try:
        manager.save(0, args=ocp.args.Composite(items=ocp.args.PyTreeSave(tree)))
        manager.wait_until_finished()
    finally:
        manager.close()
    return dest / "0" / "items"


def arrays(item: Path) -> dict[str, np.ndarray]:
    return {p: x.array for p, x in L.weights(L.read_item(item)).items()}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families_lora")


@pytest.fixture(scope="module")
def site(work) -> Path:
    return L.probe_site_dir(work)


@pytest.fixture(scope="module")
def bases(work) -> dict[str, Path]:
    """Writable copies of the pre-training steps the LoRA runs started from."""
    return {f: L.copy_tree(fixture(f, "pretrain"), work / "bases" / f / "0") for f in FAMILIES}


@pytest.fixture(scope="module")
def adapter_steps(work) -> dict[tuple[str, str], Path]:
    """(family, "trained"|"random") -> a Tunix LoRA step ``.../checkpoints/2``: a copy of the
    fixture, or the same step with random factors of about ``RANDOM_SCALE``."""
    out = {}
    for i, family in enumerate(FAMILIES):
        step = fixture(family, "lora")
        out[family, "trained"] = L.copy_tree(step, work / f"{family}_trained" / "checkpoints" / "2")
        dst = work / f"{family}_random" / "checkpoints" / "2"
        LS.write_random_adapters(step, dst, seed=i, scale=RANDOM_SCALE)
        out[family, "random"] = dst
    return out


def merge_cli(*args: object) -> None:
    """``orbax-maxtext-layout merge-lora ARGS`` in-process; it must succeed."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["merge-lora", *map(str, args)])
    assert rc == 0, buf.getvalue()


@pytest.fixture(scope="module")
def merged(work, bases, adapter_steps) -> dict[str, Path]:
    """name -> ``<out>/0/items``: ``merge-lora <step> --base <base> --alpha 8`` of each
    ``<family>_<adapters>``; ``<family>_half_alpha`` (``--alpha 4``, random) and
    ``gemma3_unrolled`` (``--unroll``, random)."""
    out = {}
    for (family, adapters), step in adapter_steps.items():
        dest = work / "merged" / f"{family}_{adapters}"
        merge_cli(step, "--base", bases[family], "--alpha", f"{ALPHA:g}", "--out", dest)
        out[f"{family}_{adapters}"] = dest / "0" / "items"
    for family in FAMILIES:
        dest = work / "merged" / f"{family}_half_alpha"
        step = adapter_steps[family, "random"]
        merge_cli(step, "--base", bases[family], "--alpha", f"{ALPHA / 2:g}", "--out", dest)
        out[f"{family}_half_alpha"] = dest / "0" / "items"
    dest = work / "merged" / "gemma3_unrolled"
    step = adapter_steps["gemma3", "random"]
    merge_cli(step, "--base", bases["gemma3"], "--alpha", f"{ALPHA:g}", "--out", dest, "--unroll")
    out["gemma3_unrolled"] = dest / "0" / "items"
    return out


@pytest.fixture(scope="module")
def wrong(work, bases, adapter_steps, merged) -> dict[str, Path]:
    """``<family>_<variant>`` -> the items of each wrong merge of the random adapters."""
    out = {}
    for family, variants in WRONG.items():
        base = arrays(bases[family] / "items")
        ab = factors(adapter_steps[family, "random"])
        for variant in variants:
            name = f"{family}_{variant}"
            if variant == "half_alpha":
                out[name] = merged[name]
                continue
            flat = with_deltas(base, wrong_deltas(family, variant, base, ab))
            out[name] = write_param_step(flat, work / "wrong" / name)
    return out


def _jobs(family: str, root: Path, bases, adapter_steps, merged, wrong) -> list[dict]:
    """The models of one family's child (lora_logits_support.child_main)."""
    f = FAMILIES[family]
    keys, out = f.lora_model_keys, root / "out"
    base_items = bases[family] / "items"
    jobs = [LS.job("base", keys, base_items, out)]
    for adapters in ADAPTERS:
        restore = adapter_steps[family, adapters] / "model_params"
        lora = dict(rank=RANK, alpha=ALPHA, restore=str(restore), module_path=f.module_path)
        jobs.append(LS.job(f"lora_{adapters}", keys, base_items, out, lora=lora))
        jobs.append(LS.job(f"merged_{adapters}", keys, merged[f"{family}_{adapters}"], out))
    for variant in WRONG[family]:
        jobs.append(LS.job(variant, keys, wrong[f"{family}_{variant}"], out))
    if family == "gemma3":
        unscanned = list(GEN.GEMMA3_UNSCANNED_MODEL_KEYS)
        jobs.append(LS.job("unrolled", unscanned, merged["gemma3_unrolled"], out))
    if family == "mixtral":  # MaxText's default MoE path (sparse_matmul=true, megablox)
        restore = adapter_steps[family, "random"] / "model_params"
        lora = dict(rank=RANK, alpha=ALPHA, restore=str(restore), module_path=f.module_path)
        jobs.append(LS.job("lora_random_default_moe", f.keys, base_items, out, lora=lora))
        jobs.append(LS.job("merged_random_default_moe", f.keys, merged["mixtral_random"], out))
    return jobs


def _tunix_run(base: Path, family: str) -> None:
    """``<base>/run/checkpoints/2``: the family's Tunix SFT step as a run's latest step."""
    L.copy_tree(fixture(family, "sft"), base / "run" / "checkpoints" / str(L.UPDATES))


@dataclasses.dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


@pytest.fixture(scope="module")
def processes(work, site, bases, adapter_steps, merged, wrong) -> dict[str, Outcome]:
    """Every child process of the module, two at a time (2 cores), longest first:

    - ``logits_<family>``: the family's logits child;
    - ``runner_<family>``: the runner resumes the Tunix SFT run with ``steps=3`` (one update);
    - ``stock_<family>``: stock MaxText, the same command on the same run;
    - ``stock4_<family>``: stock MaxText on the same run with ``steps=4``.
    """
    tasks = {}
    for family in FAMILIES:
        root = work / f"logits_{family}"
        tasks[f"logits_{family}"] = (
            LS.run_child,
            root,
            _jobs(family, root, bases, adapter_steps, merged, wrong),
        )
    for family, f in FAMILIES.items():
        for name, steps, runner in (("runner", 3, True), ("stock", 3, False), ("stock4", 4, False)):
            name = f"{name}_{family}"
            base = work / name
            _tunix_run(base, family)
            spec = L.Spec(name, base, steps=steps, runner=runner, model_keys=f.keys)
            tasks[name] = (L.run, spec, site)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(fn, *args) for k, (fn, *args) in tasks.items()}
        out = {}
        for k, fut in futures.items():
            try:
                out[k] = Outcome(fut.result())
            except Exception as e:
                out[k] = Outcome(error=e)
    return out


def logits(processes, family: str) -> dict[str, np.ndarray]:
    return processes[f"logits_{family}"].get()


def miss(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape == (*LS.tokens().shape, LS.VOCAB)
    assert np.isfinite(got).all() and np.isfinite(want).all()
    return float(np.abs(got - want).max())


# ----------------------------------------------------------------------------- the merge


@pytest.mark.parametrize("adapters", ADAPTERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_merged_step_is_the_base_with_qwix_s_deltas(family, adapters, bases, adapter_steps, merged):
    """``<out>/0/items``: the base's weights, every unadapted one bit-identical, every adapted
    one ``W + (alpha/rank) * delta`` with the delta of the numpy reference (qwix's einsum for
    an expert weight, a reshape of ``a @ b`` for a dense kernel), to float32 rounding."""
    got = L.read_item(merged[f"{family}_{adapters}"])
    base = L.weights(L.read_item(bases[family] / "items"))
    assert set(got) == set(base)
    ab = factors(adapter_steps[family, adapters])
    kernels = adapted(ab)
    assert len(kernels) == FAMILIES[family].n_adapted
    assert [p for p in base if p not in kernels and got[p] != base[p]] == []
    base_arrays = {p: x.array for p, x in base.items()}
    want = with_deltas(base_arrays, deltas(base_arrays, ab))
    worst = max(float(np.abs(got[k].array - want[k]).max()) for k in kernels)
    assert worst < 1e-6, worst
    assert [k for k in kernels if got[k] == base[k]] == []


def test_expert_deltas_are_not_reshapes(bases, adapter_steps):
    """The einsum order matters for ``wi_0``/``wi_1`` (a plain reshape of ``a @ b`` puts the
    delta elsewhere), not for ``wo``, whose ``a``'s dims lead the kernel's own order."""
    base = arrays(bases["mixtral"] / "items")
    ab = factors(adapter_steps["mixtral", "random"])
    right, reshaped = deltas(base, ab), deltas(base, ab, reshape=True)
    far = {k.rsplit("/", 1)[-1] for k in right if np.abs(right[k] - reshaped[k]).max() > 1e-2}
    assert far == {"wi_0", "wi_1"}


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("adapters", ADAPTERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_model_holds_the_step_adapters(family, adapters, processes, adapter_steps):
    """MaxText's LoRA model holds the step's factors bit for bit (mixtral: its experts' too):
    the LoRA logits are those of these adapters."""
    prefix = f"lora_{adapters}::"
    got = logits(processes, family)
    got = {k.removeprefix(prefix): L.Leaf.of(v) for k, v in got.items() if k.startswith(prefix)}
    want = {p: L.Leaf.of(x) for p, x in factors(adapter_steps[family, adapters]).items()}
    assert len(want) == 2 * FAMILIES[family].n_adapted
    assert L.diff(got, want) == []


def test_qwix_einsums_of_the_expert_weights(processes):
    """The einsums qwix rewrote in MaxText's LoRA model, which the numpy reference's expert
    deltas are written from; gemma3's projections are all dot_generals (none recorded)."""
    for family, want in (("mixtral", QWIX_EINSUMS), ("gemma3", {})):
        for adapters in ADAPTERS:
            prefix = f"lora_{adapters}:einsum:decoder/layers/MoeBlock_0/"
            got = {
                k.removeprefix(prefix).removesuffix("_lora_einsum_str"): str(v)
                for k, v in logits(processes, family).items()
                if f"lora_{adapters}:einsum:" in k
            }
            assert got == want, (family, got)


@pytest.mark.parametrize("adapters", ADAPTERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_merged_plain_model_gives_the_lora_model_logits(family, adapters, processes):
    out = logits(processes, family)
    lora = out[f"lora_{adapters}"]
    assert miss(out[f"merged_{adapters}"], lora) < TOLERANCE
    # Not vacuous: without the adapters the logits are far off (trained: ~1e-3, random: ~1).
    base = miss(out["base"], lora)
    assert base > (1e-1 if adapters == "random" else 10 * TOLERANCE), base


@pytest.mark.parametrize(
    "family,variant", [(f, v) for f, variants in WRONG.items() for v in variants]
)
def test_a_wrong_merge_misses_the_lora_logits(family, variant, processes):
    out = logits(processes, family)
    got = miss(out[variant], out["lora_random"])
    assert got > 100 * TOLERANCE, got


def test_unrolled_merge_gives_the_lora_logits_on_the_unscanned_model(processes, merged):
    """``merge-lora --unroll`` of the block-scanned gemma3 step: MaxText's unscanned model
    (``decoder/layers_<i>``, 12 layers) built from it gives the scanned LoRA model's logits."""
    got = L.read_item(merged["gemma3_unrolled"])
    unscanned = L.weights(L.read_item(fixture("gemma3", "pretrain_unscanned") / "items"))
    assert {p: (x.dtype, x.shape) for p, x in got.items()} == {
        p: (x.dtype, x.shape) for p, x in unscanned.items()
    }
    out = logits(processes, "gemma3")
    assert miss(out["unrolled"], out["lora_random"]) < TOLERANCE


def test_merged_step_on_maxtext_s_default_moe_path(processes):
    """Pre-training runs MaxText's default MoE path (``sparse_matmul=true``, megablox): the
    merged step gives the LoRA logits there too. A LoRA model built on that path has no
    adapters on the experts (qwix does not see the megablox matmuls), so
    ``restore_lora_from_path`` restores only attention's and the router's factors and leaves
    the step's 6 expert factors out without a word: that model is the merge without the
    experts, not the LoRA run's model."""
    out = logits(processes, "mixtral")
    lora = out["lora_random"]
    assert miss(out["merged_random_default_moe"], lora) < TOLERANCE
    held = {k.split("::", 1)[1] for k in out if k.startswith("lora_random_default_moe::")}
    assert len(held) == 10
    assert not any(k.rsplit("/", 1)[-1].split("_lora_")[0] in QWIX_EINSUMS for k in held)
    default = out["lora_random_default_moe"]
    assert miss(default, out["experts_left_out"]) < TOLERANCE
    assert miss(default, lora) > 100 * TOLERANCE


# ----------------------------------------------------------------------------- export-hf


def export(*args: object) -> dict:
    """``orbax-maxtext-layout export-hf ARGS --json`` in-process: its report."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["export-hf", *map(str, args), "--json"])
    assert rc == 0, buf.getvalue()
    return json.loads(buf.getvalue())


@pytest.fixture(scope="module")
def exports(work, bases, adapter_steps, merged) -> dict[str, Path]:
    """``<family>_{lora,merged,base}``: ``export-hf`` of the trained LoRA step with ``--base``,
    of ``merge-lora``'s output step, and of the base step (``--override-model-architecture``,
    the family's keys without ``scan_layers``: read from each step)."""
    out = {}
    for family, f in FAMILIES.items():
        config = [
            "--override-model-architecture",
            "--maxtext-config",
            str(L.base_yml()),
            *(k for k in f.keys if not k.startswith("scan_layers=")),
        ]
        step = adapter_steps[family, "trained"]
        sources = {
            "lora": [step, "--base", bases[family], "--alpha", f"{ALPHA:g}"],
            "merged": [merged[f"{family}_trained"].parent],
            "base": [bases[family]],
        }
        for name, source in sources.items():
            dest = work / "hf" / f"{family}_{name}"
            report = export(*source, "--out", dest, *config)
            out[f"{family}_{name}"] = dest
            out[f"{family}_{name}_report"] = report
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_export_of_the_lora_step_equals_export_of_the_merge(family, exports):
    got = S.read_hf(exports[f"{family}_lora"])
    want = S.read_hf(exports[f"{family}_merged"])
    assert want and S.hf_diff(got, want) == []
    report = exports[f"{family}_lora_report"]
    assert report["source"] == "tunix-lora-merge"
    assert (report["merged"]["alpha"], report["merged"]["rank"]) == (ALPHA, RANK)
    assert S.hf_config(exports[f"{family}_lora"]) == S.hf_config(exports[f"{family}_merged"])


@pytest.mark.parametrize("family", FAMILIES)
def test_export_of_the_lora_step_differs_from_the_base_in_the_adapted_projections(family, exports):
    got = S.read_hf(exports[f"{family}_lora"])
    base = S.read_hf(exports[f"{family}_base"])
    differ = {d.split(":")[0] for d in S.hf_diff(got, base)}
    assert differ == FAMILIES[family].hf_names()
    for n in differ:
        assert (got[n].shape, got[n].dtype) == (base[n].shape, base[n].dtype)


# ----------------------------------------------------------------------------- training


def _run(processes, name: str) -> L.Run:
    return processes[name].get()


@pytest.mark.parametrize("family", FAMILIES)
def test_runner_resumes_the_family_s_tunix_run(family, processes):
    run = _run(processes, f"runner_{family}")
    assert run.returncode == 0, run.why()
    assert L.RUNNER_BANNER in run.log
    meta = run.probe_meta()
    assert meta["checkpoint_manager"] == L.LIBRARY_CHECKPOINTER
    # The library under test: this checkout's, not another installed copy.
    assert Path(meta["library_file"]).resolve().is_relative_to(L.REPO.resolve()), meta
    # Tunix directory 2 (the state after 2 updates) is MaxText's step 1; one more update.
    assert run.restored_from == [L.UPDATES - 1]
    assert run.probe()["step"].value() == L.UPDATES
    assert run.completed == [2]
    assert run.saved == [2]
    assert run.lost_saves == []
    assert L.step_dirs(run.checkpoints) == [1, 2]
    assert L.leftovers(run.checkpoints) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_runner_starts_from_the_sft_step_bit_for_bit(family, processes):
    """Weights, RNG counts and keys, Adam moments and counts, schedule count, step: the probe's
    state equals the Tunix SFT step read with stock Orbax (the run's init seed is 1, the
    fixture's 0, so an initialized leaf cannot pass for a restored one)."""
    got = _run(processes, f"runner_{family}").probe()
    want = L.expected_items(fixture(family, "sft"), "sft")
    assert L.diff(got, want, step_by_value=True) == []
    n = {"gemma3": 80, "mixtral": 13}[family]
    assert L.groups(got) == {
        "params/params": n,
        "nnx_aux/model": 12,
        "opt_state/0": 2 * n + 1,
        "opt_state/2": 1,
        "step": 1,
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_maxtext_cannot_resume_the_family_s_tunix_run(family, processes):
    """Stock MaxText lists Tunix directory 2 as its own step 2 (the state after 3 updates, by
    its numbering): with the runner's command (``steps=3``) it refuses to train at all; with
    ``steps=4`` it asks the Tunix step for MaxText's ``items`` and fails. Nothing is saved."""
    same, more = _run(processes, f"stock_{family}"), _run(processes, f"stock4_{family}")
    for run in (same, more):
        assert run.returncode != 0, run.why()
        assert L.RUNNER_BANNER not in run.log
        assert run.saved == []
        assert L.step_dirs(run.checkpoints) == [L.UPDATES]
    assert (
        "RuntimeError: Requested training up to step 3, but a checkpoint already exists at "
        "step 2 (which means 3 steps have been completed)." in same.log
    ), same.why()
    assert more.restored_from == [L.UPDATES]
    assert (
        "KeyError: \" Requested checkpointables: dict_keys(['items']) for loading were not "
        "found in the checkpoint. Available checkpointables: ['model_params', "
        "'optimizer_state']\"" in more.log
    ), more.why()
