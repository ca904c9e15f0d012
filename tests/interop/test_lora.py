"""Interop: MaxText 0.2.5's own LoRA steps, merged by this library, read by MaxText's own code.

The LoRA steps are the frozen fixtures of tests/fixtures/maxtext025 (their README):
``lora_run/checkpoints/2`` (``train_sft`` with qwix LoRA, rank 4, alpha 8, scanned,
``param_scan_axis=1``, started from ``pretrain_run/checkpoints/1``) and
``lora_unscanned_run/checkpoints/2`` (the same unscanned, from
``pretrain_unscanned_run/checkpoints/0``). Each holds only the 7 adapted projections'
``kernel_lora_a``/``kernel_lora_b`` (Tunix layout, ``value`` level), no base weights.

What proves what:

- *the merge is the LoRA model*: MaxText's plain model, built by
  ``model_creation_utils.from_pretrained`` from the merged ``<out>/0/items``, gives the logits
  of MaxText's LoRA model, built the way ``train_sft`` builds it (``from_pretrained`` on the
  base step, ``lora_utils.apply_lora_to_model``, the adapters set from the LoRA step by
  MaxText's own ``lora_utils.restore_lora_from_path``), within 1e-4 on a fixed token batch.
  Once with the trained adapters, and once with adapters of real magnitude (a copy of the step
  whose factors are replaced by random values of about 0.1, written as a Tunix step by Orbax):
  the trained ones move the logits by only ~2e-3 (``lora_b`` starts at 0). The checks cannot
  pass vacuously: the LoRA model's adapters are read back and equal the step's, the plain base
  model misses the LoRA logits by far more than the tolerance, and so does a merge with the
  wrong scale. All of this runs in one child process (MaxText's PRNG is process-global);
- *MaxText trains from it*: its pre-training main starts from ``load_parameters_path=<out>/0/items``
  and runs a step; the probe of maxtext_loop_support shows the weights it started from are the
  merged ones, bit for bit;
- *the refusal*: the runner over a run whose latest step is the LoRA step exits 1 with this
  library's LoRA message, printed as one ``error: <message>`` without a traceback, and leaves
  the step as it was.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import lora_logits_support as LS
import maxtext_loop_support as L
import numpy as np
import pytest

import orbax_maxtext_layout as oml

STEPS = {
    "scanned": L.FIXTURE / "lora_run" / "checkpoints" / "2",
    "unscanned": L.FIXTURE / "lora_unscanned_run" / "checkpoints" / "2",
}
BASES = {
    "scanned": L.FIXTURE / "pretrain_run" / "checkpoints" / "1",
    "unscanned": L.FIXTURE / "pretrain_unscanned_run" / "checkpoints" / "0",
}
KINDS = tuple(STEPS)
ADAPTERS = ("random", "trained")
N_LAYERS = 3
MODULES = ("query", "key", "value", "out", "wi_0", "wi_1", "wo")
TOLERANCE = 1e-4  # max abs logit difference, float32
RANDOM_SCALE = 0.1


GEN = L.generator()
RANK = GEN.LORA_RANK
ALPHA = float(GEN.LORA_ALPHA)


def adapted_kernels(kind: str) -> list[str]:
    """``params/params/...`` paths of the kernels the step adapts (7 per layer group)."""
    layers = ["layers"] if kind == "scanned" else [f"layers_{i}" for i in range(N_LAYERS)]
    return [
        f"params/params/decoder/{layer}/{'self_attention' if m in MODULES[:4] else 'mlp'}/{m}/kernel"
        for layer in layers
        for m in MODULES
    ]


def factors(step: Path) -> dict[str, L.Leaf]:
    """``<module path>/kernel_lora_{a,b}`` -> leaf, from the step's model_params (stock Orbax)."""
    return {p.removesuffix("/value"): x for p, x in L.read_item(step / "model_params").items()}


class UnscannedSpec(L.Spec):
    """A MaxText run of the same tiny model with ``scan_layers=false``."""

    def argv(self) -> list[str]:
        return ["scan_layers=false" if a == "scan_layers=true" else a for a in super().argv()]


# ----------------------------------------------------------------------------- the child


def _model_keys(scanned: bool) -> list[str]:
    return list(GEN.MODEL_KEYS if scanned else GEN.UNSCANNED_MODEL_KEYS)


def _lora(restore: str, scanned: bool) -> dict[str, Any]:
    """qwix's settings of the fixture runs: the scanned run had the explicit llama3.1 module
    path, the unscanned one MaxText's automatic path."""
    module_path = None
    if scanned:
        import yaml

        paths = yaml.safe_load(
            (L.base_yml().parent / "post_train" / "lora_module_path.yml").read_text()
        )
        module_path = paths[GEN.LORA_MODULE_PATH_KEY]
    return dict(rank=RANK, alpha=ALPHA, restore=restore, module_path=module_path)


tokens = LS.tokens


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def bases(work) -> dict[str, Path]:
    """Writable copies of the base steps the LoRA runs started from."""
    return {
        kind: L.copy_tree(step, work / "bases" / kind / step.name) for kind, step in BASES.items()
    }


@pytest.fixture(scope="module")
def adapter_steps(work) -> dict[tuple[str, str], Path]:
    """(kind, "trained"|"random") -> a Tunix LoRA step directory ``.../checkpoints/2``."""
    out = {}
    for i, (kind, step) in enumerate(STEPS.items()):
        out[kind, "trained"] = L.copy_tree(step, work / f"{kind}_trained" / "checkpoints" / "2")
        dst = work / f"{kind}_random" / "checkpoints" / "2"
        LS.write_random_adapters(step, dst, seed=i, scale=RANDOM_SCALE)
        out[kind, "random"] = dst
    return out


@dataclasses.dataclass
class Merged:
    out: Path
    report: Any

    @property
    def items(self) -> Path:
        return self.out / "0" / "items"


@pytest.fixture(scope="module")
def merged(work, bases, adapter_steps) -> dict[str, Merged]:
    """``merge_lora`` of each adapter step onto its base (``<kind>_<adapters>``), plus two
    variants of the scanned random one: ``alpha`` halved (a wrong merge) and ``--unroll``."""
    out = {}
    for (kind, adapters), step in adapter_steps.items():
        # Both forms the contract allows, for the base (a step or its items) and for the
        # adapters (a step or its model_params).
        base = bases[kind] if kind == "scanned" else bases[kind] / "items"
        step = step if adapters == "random" else step / "model_params"
        dest = work / "merged" / f"{kind}_{adapters}"
        out[f"{kind}_{adapters}"] = Merged(dest, oml.merge_lora(step, base, alpha=ALPHA, out=dest))
    step = adapter_steps["scanned", "random"]
    dest = work / "merged" / "half_alpha"
    out["half_alpha"] = Merged(
        dest, oml.merge_lora(step, bases["scanned"], alpha=ALPHA / 2, out=dest)
    )
    dest = work / "merged" / "unrolled"
    out["unrolled"] = Merged(
        dest, oml.merge_lora(step, bases["scanned"], alpha=ALPHA, out=dest, scan="unroll")
    )
    return out


@pytest.fixture(scope="module")
def logits(work, bases, adapter_steps, merged) -> dict[str, np.ndarray]:
    """One child process: logits of the plain base, LoRA and merged models
    (lora_logits_support.child_main)."""
    root = work / "child"
    out = root / "out"
    jobs = []
    for kind in KINDS:
        scanned = kind == "scanned"
        keys = _model_keys(scanned)
        base_items = bases[kind] / "items"
        jobs.append(LS.job(f"base_{kind}", keys, base_items, out))
        for adapters in ADAPTERS:
            name = f"{kind}_{adapters}"
            lora = _lora(str(adapter_steps[kind, adapters] / "model_params"), scanned)
            jobs.append(LS.job(f"lora_{name}", keys, base_items, out, lora=lora))
            jobs.append(LS.job(f"merged_{name}", keys, merged[name].items, out))
    jobs.append(LS.job("merged_half_alpha", _model_keys(True), merged["half_alpha"].items, out))
    jobs.append(LS.job("merged_unrolled", _model_keys(False), merged["unrolled"].items, out))
    return LS.run_child(root, jobs)


@pytest.fixture(scope="module")
def site(work) -> Path:
    return L.probe_site_dir(work)


LORA_KEYS = ("lora.enable_lora=true", f"lora.lora_rank={RANK}", f"lora.lora_alpha={ALPHA:g}")


@pytest.fixture(scope="module")
def runs(work, site, merged) -> dict[str, L.Run]:
    """MaxText's pre-training main, two processes at a time:

    - ``train_<kind>``: stock, 1 step, ``load_parameters_path=<merged random>/0/items``;
    - ``refuse_plain`` / ``refuse_lora_keys``: the runner, resuming a run whose latest (only)
      step is the scanned LoRA step, without and with ``lora.*`` keys.
    """
    specs = []
    for kind in KINDS:
        spec = L.Spec if kind == "scanned" else UnscannedSpec
        extra = (f"load_parameters_path={merged[f'{kind}_random'].items}",)
        specs.append(
            spec(f"train_{kind}", work / f"train_{kind}", steps=1, runner=False, extra=extra)
        )
    for name, extra in (("refuse_plain", ()), ("refuse_lora_keys", LORA_KEYS)):
        base = work / name
        L.copy_tree(STEPS["scanned"], base / "run" / "checkpoints" / "2")
        specs.append(L.Spec(name, base, steps=3, runner=True, extra=extra))
    return L.run_all(specs, site)


# ----------------------------------------------------------------------------- the fixtures


@pytest.mark.parametrize("kind", KINDS)
def test_fixture_lora_step_holds_only_the_factors(kind):
    """The frozen steps are what the fixture README says: 7 modules x (a, b) per layer group,
    qwix's shapes (A: the kernel's contracting dims flattened, then rank; B: rank, then the
    other dims flattened; the layer axis 1 in both when scanned), float32, a ``value`` level,
    no rank or alpha recorded, the state after 2 updates."""
    step = STEPS[kind]
    scanned = kind == "scanned"
    assert L.step_metadata(step)["custom_metadata"] == {}
    base = L.weights(L.read_item(BASES[kind] / "items"))
    want = {}
    for kernel in adapted_kernels(kind):
        shape = list(base[kernel].shape)
        layer = (shape.pop(1),) if scanned else ()
        n_in = 2 if kernel.endswith("/out/kernel") else 1  # out contracts (heads, head_dim)
        a_in, b_out = int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))
        module = kernel.removeprefix("params/params/").removesuffix("/kernel")
        want[f"{module}/kernel_lora_a"] = ("float32", (a_in, *layer, RANK))
        want[f"{module}/kernel_lora_b"] = ("float32", (RANK, *layer, b_out))
    raw = L.read_item(step / "model_params")
    assert all(p.endswith("/value") for p in raw)
    assert {p: (x.dtype, x.shape) for p, x in factors(step).items()} == want
    assert len(want) == (14 if scanned else 14 * N_LAYERS)
    opt = L.read_item(step / "optimizer_state")
    assert opt["step/value"].value() == L.UPDATES


# ----------------------------------------------------------------------------- the merged step


@pytest.mark.parametrize("adapters", ADAPTERS)
@pytest.mark.parametrize("kind", KINDS)
def test_merged_step_is_the_base_with_merged_kernels(kind, adapters, merged):
    """``<out>/0/items`` holds only ``params/params``: the base's tree, shapes and dtypes; every
    leaf but the adapted kernels bit-identical to the base, and the kernels moved."""
    got = L.read_item(merged[f"{kind}_{adapters}"].items)
    base = L.weights(L.read_item(BASES[kind] / "items"))
    assert set(got) == set(base), sorted(set(got) ^ set(base))
    kernels = adapted_kernels(kind)
    assert set(kernels) <= set(base)
    assert [p for p in base if (got[p].dtype, got[p].shape) != (base[p].dtype, base[p].shape)] == []
    assert [p for p in base if p not in kernels and got[p] != base[p]] == []
    assert [p for p in kernels if got[p] == base[p]] == []


def expected_kernel(w: np.ndarray, a: np.ndarray, b: np.ndarray, *, scanned: bool) -> np.ndarray:
    """``W_l + (alpha/rank) * reshape(A_l @ B_l, W_l.shape)`` per layer, layers on axis 1."""
    if not scanned:
        delta = (a.reshape(-1, RANK).astype(np.float64) @ b.reshape(RANK, -1)).reshape(w.shape)
        return w + (ALPHA / RANK) * delta
    layers = [
        expected_kernel(
            np.take(w, i, axis=1), np.take(a, i, axis=1), np.take(b, i, axis=1), scanned=False
        )
        for i in range(w.shape[1])
    ]
    return np.stack(layers, axis=1)


@pytest.mark.parametrize("adapters", ADAPTERS)
@pytest.mark.parametrize("kind", KINDS)
def test_merged_kernels_follow_the_lora_formula(kind, adapters, merged, adapter_steps):
    got = L.read_item(merged[f"{kind}_{adapters}"].items)
    base = L.read_item(BASES[kind] / "items")
    ab = factors(adapter_steps[kind, adapters])
    worst = 0.0
    for kernel in adapted_kernels(kind):
        module = kernel.removeprefix("params/params/").removesuffix("/kernel")
        want = expected_kernel(
            base[kernel].array,
            ab[f"{module}/kernel_lora_a"].array,
            ab[f"{module}/kernel_lora_b"].array,
            scanned=kind == "scanned",
        )
        worst = max(worst, float(np.abs(got[kernel].array - want).max()))
    assert worst < 1e-5, worst


def test_unrolled_merge_is_the_unscanned_tree(merged):
    """``scan="unroll"``: the scanned adapters and base, written unscanned (``layers_<i>``)."""
    got = L.read_item(merged["unrolled"].items)
    unscanned_base = L.weights(L.read_item(BASES["unscanned"] / "items"))
    assert {p: (x.dtype, x.shape) for p, x in got.items()} == {
        p: (x.dtype, x.shape) for p, x in unscanned_base.items()
    }
    stacked = L.read_item(merged["scanned_random"].items)
    for i in range(N_LAYERS):
        for kernel in adapted_kernels("scanned"):
            layer = kernel.replace("/layers/", f"/layers_{i}/")
            assert np.array_equal(got[layer].array, np.take(stacked[kernel].array, i, axis=1))


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("adapters", ADAPTERS)
@pytest.mark.parametrize("kind", KINDS)
def test_lora_model_holds_the_step_adapters(kind, adapters, logits, adapter_steps):
    """MaxText's LoRA model (qwix, restore_lora_from_path) holds the step's factors, bit for bit:
    the LoRA logits below are those of these adapters, not of freshly initialized ones."""
    prefix = f"lora_{kind}_{adapters}::"
    got = {k.removeprefix(prefix): L.Leaf.of(v) for k, v in logits.items() if k.startswith(prefix)}
    assert L.diff(got, factors(adapter_steps[kind, adapters])) == []


@pytest.mark.parametrize("adapters", ADAPTERS)
@pytest.mark.parametrize("kind", KINDS)
def test_merged_plain_model_gives_the_lora_model_logits(kind, adapters, logits):
    lora, merged_ = logits[f"lora_{kind}_{adapters}"], logits[f"merged_{kind}_{adapters}"]
    assert lora.shape == merged_.shape == (*tokens().shape, 64)
    assert np.isfinite(lora).all()
    assert float(np.abs(merged_ - lora).max()) < TOLERANCE
    # Not vacuous: without the adapters the logits are far off (trained: ~2e-3, random: ~1).
    miss = float(np.abs(logits[f"base_{kind}"] - lora).max())
    assert miss > (1e-1 if adapters == "random" else 10 * TOLERANCE), miss


def test_a_wrong_merge_misses_the_lora_logits(logits):
    """alpha/2 instead of alpha: the same check fails by far."""
    lora = logits["lora_scanned_random"]
    assert float(np.abs(logits["merged_half_alpha"] - lora).max()) > 100 * TOLERANCE


def test_unrolled_merge_gives_the_lora_logits_on_the_unscanned_model(logits):
    lora = logits["lora_scanned_random"]
    assert float(np.abs(logits["merged_unrolled"] - lora).max()) < TOLERANCE


# ----------------------------------------------------------------------------- the CLI


def test_cli_merge_lora_writes_what_the_api_writes(work, bases, adapter_steps, merged):
    step, base = adapter_steps["scanned", "random"], bases["scanned"]
    dry = work / "cli_dry"
    args = ("merge-lora", str(step), "--base", str(base), "--alpha", f"{ALPHA:g}")
    L.cli(*args, "--out", str(dry), "--dry-run", "--json")
    assert not (dry / "0" / "items").exists()
    out = work / "cli_merged"
    proc = L.cli(*args, "--out", str(out), "--json")
    json.loads(proc.stdout)
    assert (
        L.diff(L.read_item(out / "0" / "items"), L.read_item(merged["scanned_random"].items)) == []
    )


# ----------------------------------------------------------------------------- MaxText trains


@pytest.mark.parametrize("kind", KINDS)
def test_maxtext_pretraining_starts_from_the_merged_step(kind, runs, merged):
    run = runs[f"train_{kind}"]
    assert run.returncode == 0, run.why()
    assert run.probe_meta()["library_imported"] is False  # stock MaxText reads it
    assert run.restored_from == []  # nothing in its run directory: a params-only start
    # The weights it started from are the merged ones (the run initializes with another seed).
    assert L.diff(L.weights(run.probe()), L.read_item(merged[f"{kind}_random"].items)) == []
    assert run.completed == [0]
    assert run.saved == [0]


# ----------------------------------------------------------------------------- refusals


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def assert_lora_refusal(message: str) -> None:
    assert "LoRA adapter step" in message
    assert "no base weights" in message
    assert "merge-lora" in message
    assert "lora.lora_restore_path" in message
    assert re.search(rf"rank\W*{RANK}\b", message), message
    missing = [m for m in MODULES if not re.search(rf"/{m}\b", message)]
    assert missing == [], message


@pytest.mark.parametrize("name", ("refuse_plain", "refuse_lora_keys"))
def test_runner_refuses_a_run_whose_latest_step_is_lora(name, runs):
    run = runs[name]
    assert run.returncode == 1, run.why()
    assert L.RUNNER_BANNER in run.log
    assert_lora_refusal(run.log)
    # One message, as the CLI prints it, and no traceback through MaxText's trainer.
    errors = [line for line in run.log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "LoRA adapter step" in errors[0], run.why()
    assert "Traceback" not in run.log, run.why()
    assert run.saved == []
    # The Tunix step is left at 2 (not renumbered to 1), untouched, and nothing was added.
    assert L.step_dirs(run.checkpoints) == [2]
    assert L.leftovers(run.checkpoints) == []
    assert _files(run.checkpoints / "2") == _files(STEPS["scanned"])


@pytest.mark.parametrize("kind", KINDS)
def test_converting_a_lora_step_is_refused(kind, work, bases):
    step = L.copy_tree(STEPS[kind], work / f"convert_{kind}" / "checkpoints" / "2")
    target = oml.Target.from_checkpoint(bases[kind])
    with pytest.raises(oml.LoraAdapterStepError) as e:
        oml.convert_step(step, target)
    assert isinstance(e.value, oml.OrbaxMaxTextLayoutError)
    assert_lora_refusal(str(e.value))
    assert _files(step) == _files(STEPS[kind])
