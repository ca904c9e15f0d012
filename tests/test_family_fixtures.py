"""Real checkpoints of two more MaxText 0.2.5 model families (tests/fixtures/maxtext025).

A tiny gemma3-4b (block-scanned: ``decoder/layers/layers_0 .. layers_5`` plus
``decoder/layers_remainder``) and a tiny mixtral-8x7b (mixture of experts:
``decoder/layers/MoeBlock_0``), written by MaxText's own pre-training loop and its Tunix-based
SFT trainer, with and without qwix LoRA (tests/fixtures/generators/gen_maxtext025.py,
``--only gemma3`` and ``--only mixtral``; facts in the fixture's README). These tests need no
MaxText: stock Orbax/JAX/numpy and the package's public API only, and they read the fixtures
from copies in tmp_path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

import orbax_maxtext_layout as oml

FIXTURE = Path(__file__).parent / "fixtures" / "maxtext025"
UPDATES = 2
RANK = 4
V0_PYTREE_HANDLER = (
    "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
)
V1_PYTREE_HANDLER = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"
pytestmark = pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")


def _scanned(shape: tuple[int, ...], length: int) -> tuple[int, ...]:
    """MaxText's ``param_scan_axis=1``: the layer axis is inserted at 1 (a scale (E,) -> (E, L))."""
    return (shape[0], length, *shape[1:])


# -- gemma3-4b, tiny: emb 32, 2 query heads and 1 kv head of 16, mlp 64, vocab 64, tied logits --
GEMMA3_TOP = {"decoder/decoder_norm/scale": (32,), "token_embedder/embedding": (64, 32)}
# One decoder layer's 13 weights, unscanned.
GEMMA3_LAYER = {
    "mlp/wi_0/kernel": (32, 64),
    "mlp/wi_1/kernel": (32, 64),
    "mlp/wo/kernel": (64, 32),
    "post_ffw_norm/scale": (32,),
    "post_self_attention_norm/scale": (32,),
    "pre_ffw_norm/scale": (32,),
    "pre_self_attention_norm/scale": (32,),
    "self_attention/key/kernel": (32, 1, 16),
    "self_attention/key_norm/scale": (16,),
    "self_attention/out/kernel": (2, 16, 32),
    "self_attention/query/kernel": (32, 2, 16),
    "self_attention/query_norm/scale": (16,),
    "self_attention/value/kernel": (32, 1, 16),
}


def _gemma3_scanned(n_layers: int) -> dict[str, tuple[int, ...]]:
    """The block scan: layers_k (k < 6) over n // 6 repetitions, then layers_remainder/layers_j."""
    out = dict(GEMMA3_TOP)
    for k in range(6):
        for name, shape in GEMMA3_LAYER.items():
            out[f"decoder/layers/layers_{k}/{name}"] = _scanned(shape, n_layers // 6)
    for j in range(n_layers % 6):
        for name, shape in GEMMA3_LAYER.items():
            out[f"decoder/layers_remainder/layers_{j}/{name}"] = shape
    return out


GEMMA3_WEIGHTS = _gemma3_scanned(12)  # 80
GEMMA3_REMAINDER_WEIGHTS = _gemma3_scanned(8)  # 106
GEMMA3_UNSCANNED_WEIGHTS = {  # 158
    **GEMMA3_TOP,
    **{f"decoder/layers_{i}/{n}": s for i in range(12) for n, s in GEMMA3_LAYER.items()},
}

# -- mixtral-8x7b, tiny: emb 32, 2 query heads and 1 kv head of 16, 4 experts of mlp 64, 2 layers --
MIXTRAL_TOP = {
    "decoder/decoder_norm/scale": (32,),
    "decoder/logits_dense/kernel": (32, 64),
    "token_embedder/embedding": (64, 32),
}
MIXTRAL_LAYER = {
    "MoeBlock_0/gate/kernel": (32, 4),
    # Expert weights are Params of MoeBlock_0 itself (no kernel level): (experts, emb, mlp).
    "MoeBlock_0/wi_0": (4, 32, 64),
    "MoeBlock_0/wi_1": (4, 32, 64),
    "MoeBlock_0/wo": (4, 64, 32),
    "post_self_attention_layer_norm/scale": (32,),
    "pre_self_attention_layer_norm/scale": (32,),
    "self_attention/key/kernel": (32, 1, 16),
    "self_attention/out/kernel": (2, 16, 32),
    "self_attention/query/kernel": (32, 2, 16),
    "self_attention/value/kernel": (32, 1, 16),
}
MIXTRAL_WEIGHTS = {  # 13; the expert weights scanned (experts, layers, ...)
    **MIXTRAL_TOP,
    **{f"decoder/layers/{n}": _scanned(s, 2) for n, s in MIXTRAL_LAYER.items()},
}
MIXTRAL_UNSCANNED_WEIGHTS = {  # 23
    **MIXTRAL_TOP,
    **{f"decoder/layers_{i}/{n}": s for i in range(2) for n, s in MIXTRAL_LAYER.items()},
}


def _rngs(groups: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """RNG leaves of MaxText's Rngs objects ``{group: batch shape}``; unsafe_rbg keys are (4,)."""
    return {
        f"{group}/{stream}/{leaf}": batch + ((4,) if leaf == "key" else ())
        for group, batch in groups.items()
        for stream in ("aqt", "dropout", "params")
        for leaf in ("count", "key")
    }


# Where each model keeps its RNG state (12 leaves scanned, 6 unscanned): no decoder/rngs in gemma3.
GEMMA3_RNGS = _rngs({"decoder/layers/layers_0/rngs": (2,), "decoder/layers_remainder/rngs": ()})
GEMMA3_REMAINDER_RNGS = _rngs(
    {"decoder/layers/layers_0/rngs": (1,), "decoder/layers_remainder/layers_0/rngs": ()}
)
GEMMA3_UNSCANNED_RNGS = _rngs({"decoder/layers_0/rngs": ()})
MIXTRAL_RNGS = _rngs({"decoder/rngs": (), "decoder/layers/MoeBlock_0/rngs": (2,)})
MIXTRAL_UNSCANNED_RNGS = _rngs({"decoder/layers_0/MoeBlock_0/rngs": ()})

# run -> (weights, RNG leaves, scan_layers)
PRETRAIN_RUNS = {
    "gemma3_pretrain_run": (GEMMA3_WEIGHTS, GEMMA3_RNGS, True),
    "gemma3_pretrain_unscanned_run": (GEMMA3_UNSCANNED_WEIGHTS, GEMMA3_UNSCANNED_RNGS, False),
    "mixtral_pretrain_run": (MIXTRAL_WEIGHTS, MIXTRAL_RNGS, True),
    "mixtral_pretrain_unscanned_run": (MIXTRAL_UNSCANNED_WEIGHTS, MIXTRAL_UNSCANNED_RNGS, False),
}
# run -> (weights, RNG leaves, the pre-training run it started from, or None)
SFT_RUNS = {
    "gemma3_sft_run": (GEMMA3_WEIGHTS, GEMMA3_RNGS, "gemma3_pretrain_run"),
    "gemma3_sft_unscanned_run": (
        GEMMA3_UNSCANNED_WEIGHTS,
        GEMMA3_UNSCANNED_RNGS,
        "gemma3_pretrain_unscanned_run",
    ),
    "gemma3_remainder_sft_run": (GEMMA3_REMAINDER_WEIGHTS, GEMMA3_REMAINDER_RNGS, None),
    "mixtral_sft_run": (MIXTRAL_WEIGHTS, MIXTRAL_RNGS, "mixtral_pretrain_run"),
    "mixtral_sft_unscanned_run": (
        MIXTRAL_UNSCANNED_WEIGHTS,
        MIXTRAL_UNSCANNED_RNGS,
        "mixtral_pretrain_unscanned_run",
    ),
}

# qwix LoRA factors, rank 4: kernel_lora_a = (contracting dims, L, r), kernel_lora_b = (r, L, rest).
ATTENTION_LORA = {
    "self_attention/query/kernel": ((32, 2, 4), (4, 2, 32)),
    "self_attention/key/kernel": ((32, 2, 4), (4, 2, 16)),
    "self_attention/value/kernel": ((32, 2, 4), (4, 2, 16)),
    "self_attention/out/kernel": ((32, 2, 4), (4, 2, 32)),
}
GEMMA3_LORA = {  # 84: 7 modules in each of layers_0 .. layers_5, nothing in layers_remainder
    f"decoder/layers/layers_{k}/{weight}_lora_{ab}": shape
    for k in range(6)
    for weight, shapes in {
        **ATTENTION_LORA,
        "mlp/wi_0/kernel": ((32, 2, 4), (4, 2, 64)),
        "mlp/wi_1/kernel": ((32, 2, 4), (4, 2, 64)),
        "mlp/wo/kernel": ((64, 2, 4), (4, 2, 32)),
    }.items()
    for ab, shape in zip("ab", shapes, strict=True)
}
MIXTRAL_LORA = {  # 16: attention, the router gate and the three expert weights
    f"decoder/layers/{weight}_lora_{ab}": shape
    for weight, shapes in {
        **ATTENTION_LORA,
        "MoeBlock_0/gate/kernel": ((32, 2, 4), (4, 2, 4)),
        # einsum "BSM,EMH->BSEH" -> "BSM,Mr,rEH->BSEH": A shared by the experts, B per expert.
        "MoeBlock_0/wi_0": ((32, 2, 4), (4, 2, 4, 64)),
        "MoeBlock_0/wi_1": ((32, 2, 4), (4, 2, 4, 64)),
        # einsum "BSEH,EHM->BSEM" -> "BSEH,EHr,rM->BSEM": A per expert, B shared.
        "MoeBlock_0/wo": ((4, 2, 64, 4), (4, 2, 32)),
    }.items()
    for ab, shape in zip("ab", shapes, strict=True)
}
LORA_RUNS = {"gemma3_lora_run": GEMMA3_LORA, "mixtral_lora_run": MIXTRAL_LORA}
TUNIX_RUNS = (*SFT_RUNS, *LORA_RUNS)


# -- helpers: stock Orbax only ------------------------------------------------------------------
def _copy(tmp_path: Path, *runs: str) -> Path:
    """A writable copy of some runs of the fixture."""
    out = tmp_path / "maxtext025"
    for run in runs:
        shutil.copytree(FIXTURE / run, out / run)
    for root, dirs, files in os.walk(out):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return out


def _key(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    raise TypeError(k)


def _flat(tree) -> dict[str, object]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {"/".join(_key(k) for k in path): leaf for path, leaf in leaves}


def _metadata(item: Path) -> dict[str, object]:
    return _flat(ocp.PyTreeCheckpointHandler().metadata(epath.Path(item)).tree)


def _restore(item: Path) -> dict[str, object]:
    return _flat(ocp.PyTreeCheckpointHandler().restore(epath.Path(item)))


def _step_metadata(step: Path) -> dict:
    return json.loads((step / "_CHECKPOINT_METADATA").read_text())


def _shapes(flat: dict[str, object], prefix: str = "", suffix: str = "") -> dict[str, tuple]:
    return {
        p.removeprefix(prefix).removesuffix(suffix): tuple(m.shape)
        for p, m in flat.items()
        if p.startswith(prefix)
    }


def _check_rng_specs(item: Path, want: dict[str, tuple], prefix: str, suffix: str) -> None:
    specs = {"/".join(map(str, p)): s for p, s in oml.read_specs(item).items()}
    rngs = {
        p.removeprefix(prefix).removesuffix(suffix): s for p, s in specs.items() if "/rngs/" in p
    }
    assert {p: s.shape for p, s in rngs.items()} == want
    for path, spec in rngs.items():
        assert spec.dtype == np.uint32, path
        assert spec.key_impl == ("unsafe_rbg" if path.endswith("/key") else None), path


# -- the MaxText pre-training steps ----------------------------------------------------------------
@pytest.mark.parametrize("run", sorted(PRETRAIN_RUNS))
def test_pretrain_step_is_one_maxtext_step_after_one_update(run, tmp_path):
    weights, rngs, scan_layers = PRETRAIN_RUNS[run]
    fx = _copy(tmp_path, run)
    steps = oml.find_steps(fx / run / "checkpoints")
    assert [(s.step, s.layout, s.role) for s in steps] == [(0, oml.Layout.MAXTEXT, None)]
    step = fx / run / "checkpoints" / "0"
    assert oml.detect_layout(step) is oml.Layout.MAXTEXT
    meta = _step_metadata(step)
    assert meta["custom_metadata"] == {"scan_layers": scan_layers}
    assert meta["item_handlers"] == {"items": V1_PYTREE_HANDLER}
    assert sorted(p.name for p in step.iterdir() if p.is_dir()) == ["items"]

    flat = _metadata(step / "items")
    n = len(weights)
    assert len(flat) == n + len(rngs) + (2 * n + 2) + 1
    assert _shapes(flat, "params/params/") == weights
    assert _shapes(flat, "nnx_aux/model/") == rngs
    for moment in ("mu", "nu"):
        assert _shapes(flat, f"opt_state/0/{moment}/params/") == weights
    assert all(flat[f"params/params/{p}"].dtype == np.float32 for p in weights)
    _check_rng_specs(step / "items", rngs, "nnx_aux/model/", "")

    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(step / "items")).tree
    opt = tree["opt_state"]  # Linen form: [{count, mu: {params}, nu: {params}}, None, {count}]
    assert isinstance(opt, list) and len(opt) == 3 and opt[1] is None
    restored = _restore(step / "items")
    assert restored["step"].dtype == np.int32
    # MaxText saves after the update: directory 0 holds items/step == 1.
    assert int(restored["step"]) == int(restored["opt_state/0/count"]) == 1
    assert int(restored["opt_state/2/count"]) == 1


# -- the Tunix steps (SFT and LoRA) ----------------------------------------------------------------
@pytest.mark.parametrize("run", TUNIX_RUNS)
def test_tunix_step_is_found_where_tunix_writes_it(run, tmp_path):
    fx = _copy(tmp_path, run)
    step = fx / run / "checkpoints" / str(UPDATES)
    assert oml.detect_layout(step) is oml.Layout.TUNIX
    assert [(s.step, s.layout, s.role) for s in oml.find_steps(fx / run / "checkpoints")] == [
        (UPDATES, oml.Layout.TUNIX, None)
    ]
    meta = _step_metadata(step)
    # Tunix records neither scan_layers nor (for LoRA) rank or alpha.
    assert meta["custom_metadata"] == {}
    assert meta["item_handlers"] == {
        "model_params": V0_PYTREE_HANDLER,
        "optimizer_state": V0_PYTREE_HANDLER,
    }
    assert sorted(p.name for p in step.iterdir() if p.is_dir()) == [
        "model_params",
        "optimizer_state",
    ]


@pytest.mark.parametrize("run", sorted(SFT_RUNS))
def test_sft_model_params_hold_the_model_and_its_rng_state(run, tmp_path):
    weights, rngs, _ = SFT_RUNS[run]
    fx = _copy(tmp_path, run)
    item = fx / run / "checkpoints" / str(UPDATES) / "model_params"
    flat = _metadata(item)
    assert len(flat) == len(weights) + len(rngs)
    assert all(p.endswith("/value") for p in flat)
    assert _shapes({p: m for p, m in flat.items() if "/rngs/" not in p}, suffix="/value") == weights
    _check_rng_specs(item, rngs, "", "/value")

    # A stock restore without a target gives typed unsafe_rbg keys (one per scanned layer).
    restored = _restore(item)
    for path, shape in rngs.items():
        x = restored[f"{path}/value"]
        if path.endswith("/key"):
            assert str(jax.random.key_impl(x)) == "unsafe_rbg"
            assert x.shape == shape[:-1]
        else:
            assert x.dtype == np.uint32 and x.shape == shape


@pytest.mark.parametrize("run", sorted(r for r, v in SFT_RUNS.items() if v[2]))
def test_sft_step_started_from_its_pretraining_step(run, tmp_path):
    base = SFT_RUNS[run][2]
    fx = _copy(tmp_path, run, base)
    sft = _restore(fx / run / "checkpoints" / str(UPDATES) / "model_params")
    pre = _restore(fx / base / "checkpoints" / "0" / "items")
    for path in SFT_RUNS[run][0]:
        a, b = np.asarray(sft[f"{path}/value"]), np.asarray(pre[f"params/params/{path}"])
        # 2 updates at lr 2e-5 after the base's own: close, but moved.
        assert np.max(np.abs(a - b)) < 1e-4, path
    assert any(
        not np.array_equal(sft[f"{p}/value"], pre[f"params/params/{p}"]) for p in SFT_RUNS[run][0]
    )


@pytest.mark.parametrize("run", sorted(SFT_RUNS) + sorted(LORA_RUNS))
def test_tunix_optimizer_state_tree(run, tmp_path):
    trained = LORA_RUNS[run] if run in LORA_RUNS else SFT_RUNS[run][0]
    fx = _copy(tmp_path, run)
    item = fx / run / "checkpoints" / str(UPDATES) / "optimizer_state"
    flat = _metadata(item)
    # chain(clip_by_global_norm, chain(adam, decay, schedule)); clip's EmptyState is omitted.
    assert len(flat) == 2 * len(trained) + 3
    assert sorted(p for p in flat if "/mu/" not in p and "/nu/" not in p) == [
        "opt_state/1/0/count/value",
        "opt_state/1/2/count/value",
        "step/value",
    ]
    for moment in ("mu", "nu"):
        assert _shapes(flat, f"opt_state/1/0/{moment}/", "/value") == trained
    values = _restore(item)
    assert {p: int(v) for p, v in values.items() if np.ndim(v) == 0} == {
        "opt_state/1/0/count/value": UPDATES,
        "opt_state/1/2/count/value": UPDATES,
        "step/value": UPDATES,
    }
    assert values["step/value"].dtype == np.uint32


# -- LoRA: qwix adapters on gemma3's block-scanned layers and on mixtral's experts -----------------
@pytest.mark.parametrize("run", sorted(LORA_RUNS))
def test_lora_step_holds_only_the_adapters(run, tmp_path):
    fx = _copy(tmp_path, run)
    item = fx / run / "checkpoints" / str(UPDATES) / "model_params"
    flat = _metadata(item)
    assert _shapes(flat, suffix="/value") == LORA_RUNS[run]
    assert all(p.endswith("/value") and "/rngs/" not in p for p in flat)
    values = _restore(item)
    for path, x in values.items():
        x = np.asarray(x)
        assert x.dtype == np.float32, path
        if "_lora_b/" in path:
            # B starts at zero; 2 updates move every entry, but only a little.
            assert np.all(x != 0) and np.max(np.abs(x)) < 1e-4, path
        else:
            assert np.max(np.abs(x)) > 0.1, path


def test_gemma3_lora_factors_have_the_scan_length_on_axis_1(tmp_path):
    fx = _copy(tmp_path, "gemma3_lora_run", "gemma3_pretrain_run")
    lora = _metadata(fx / "gemma3_lora_run/checkpoints/2/model_params")
    base = _metadata(fx / "gemma3_pretrain_run/checkpoints/0/items")
    for k in range(6):
        for module in ("self_attention/query", "self_attention/out", "mlp/wo"):
            kernel = base[f"params/params/decoder/layers/layers_{k}/{module}/kernel"].shape
            a = lora[f"decoder/layers/layers_{k}/{module}/kernel_lora_a/value"].shape
            b = lora[f"decoder/layers/layers_{k}/{module}/kernel_lora_b/value"].shape
            assert kernel[1] == a[1] == b[1] == 2
            assert a[-1] == b[0] == RANK


def test_mixtral_expert_adapters_follow_the_expert_einsums(tmp_path):
    """wi_0/wi_1: A (emb, L, r) shared, B (r, L, experts, mlp); wo: A (experts, L, mlp, r), B shared."""
    fx = _copy(tmp_path, "mixtral_lora_run", "mixtral_pretrain_run")
    lora = _metadata(fx / "mixtral_lora_run/checkpoints/2/model_params")
    base = _metadata(fx / "mixtral_pretrain_run/checkpoints/0/items")
    experts, layers, emb, mlp = base["params/params/decoder/layers/MoeBlock_0/wi_0"].shape
    for w in ("wi_0", "wi_1"):
        assert lora[f"decoder/layers/MoeBlock_0/{w}_lora_a/value"].shape == (emb, layers, RANK)
        assert lora[f"decoder/layers/MoeBlock_0/{w}_lora_b/value"].shape == (
            RANK,
            layers,
            experts,
            mlp,
        )
    assert base["params/params/decoder/layers/MoeBlock_0/wo"].shape == (experts, layers, mlp, emb)
    assert lora["decoder/layers/MoeBlock_0/wo_lora_a/value"].shape == (experts, layers, mlp, RANK)
    assert lora["decoder/layers/MoeBlock_0/wo_lora_b/value"].shape == (RANK, layers, emb)
    # The expert adapters are named after the Param itself (no kernel level).
    assert not any("MoeBlock_0/wi_0/" in p or "MoeBlock_0/wo/" in p for p in lora)


# -- the same model, scanned and unscanned -----------------------------------------------------------
@pytest.mark.parametrize(
    ("scanned", "unscanned"),
    [
        (GEMMA3_WEIGHTS, GEMMA3_UNSCANNED_WEIGHTS),
        (MIXTRAL_WEIGHTS, MIXTRAL_UNSCANNED_WEIGHTS),
    ],
)
def test_scanned_weights_are_the_unscanned_ones_stacked_on_axis_1(scanned, unscanned):
    """The tables above, as MaxText's trees: every scanned weight stacks its layers on axis 1."""
    pattern = 6 if any("/layers_5/" in p for p in scanned) else 1
    stacked = {}
    for path, shape in unscanned.items():
        if not path.startswith("decoder/layers_"):
            stacked[path] = shape
            continue
        index, name = path.removeprefix("decoder/layers_").split("/", 1)
        group = f"layers/layers_{int(index) % pattern}" if pattern > 1 else "layers"
        n = sum(1 for p in unscanned if p.endswith(f"/{name}") and p.startswith("decoder/layers_"))
        stacked[f"decoder/{group}/{name}"] = _scanned(shape, n // pattern)
    assert stacked == scanned
