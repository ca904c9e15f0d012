"""Real checkpoints of four more MaxText 0.2.5 model families (tests/fixtures/maxtext025).

A tiny gemma3-4b (block-scanned: ``decoder/layers/layers_0 .. layers_5`` plus
``decoder/layers_remainder``) and a tiny mixtral-8x7b (mixture of experts:
``decoder/layers/MoeBlock_0``), written by MaxText's own pre-training loop and its Tunix-based
SFT trainer, with and without qwix LoRA (tests/fixtures/generators/gen_maxtext025.py,
``--only gemma3`` and ``--only mixtral``; facts in the fixture's README). Added later, the same
way (``--only qwen3moe`` and ``--only gptoss``): a tiny qwen3-30b-a3b (mixture of experts with
q/k norms: ``decoder/layers/moe_block``) and a tiny gpt-oss-20b (a block-scanned mixture of
experts: ``decoder/layers/layers_0`` and ``layers_1``, attention with biases and sinks, expert
biases); the conversions of these two (``convert``, ``--unroll``, ``--stack``, and MaxText's own
steps into ``--out``) are tested here too. These tests need no MaxText: stock Orbax/JAX/numpy
and the package's public API only, and they read the fixtures from copies in tmp_path.
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
from conftest import stock_restore, tree_digest
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

# -- qwen3-30b-a3b and gpt-oss-20b, tiny: emb 16, 2 query heads and 1 kv head of 8, 4 experts of
# mlp 8 (2 per token), vocab 64, untied logits --
MOE16_TOP = {
    "decoder/decoder_norm/scale": (16,),
    "decoder/logits_dense/kernel": (16, 64),
    "token_embedder/embedding": (64, 16),
}
QWEN3MOE_LAYER = {  # 12; the MoE module is moe_block (mixtral's is MoeBlock_0)
    "moe_block/gate/kernel": (16, 4),
    "moe_block/wi_0": (4, 16, 8),
    "moe_block/wi_1": (4, 16, 8),
    "moe_block/wo": (4, 8, 16),
    "post_self_attention_layer_norm/scale": (16,),
    "pre_self_attention_layer_norm/scale": (16,),
    "self_attention/key/kernel": (16, 1, 8),
    "self_attention/key_norm/scale": (8,),
    "self_attention/out/kernel": (2, 8, 16),
    "self_attention/query/kernel": (16, 2, 8),
    "self_attention/query_norm/scale": (8,),
    "self_attention/value/kernel": (16, 1, 8),
}
QWEN3MOE_WEIGHTS = {  # 15: 2 layers, one plain scan
    **MOE16_TOP,
    **{f"decoder/layers/{n}": _scanned(s, 2) for n, s in QWEN3MOE_LAYER.items()},
}
QWEN3MOE_UNSCANNED_WEIGHTS = {  # 27
    **MOE16_TOP,
    **{f"decoder/layers_{i}/{n}": s for i in range(2) for n, s in QWEN3MOE_LAYER.items()},
}
GPTOSS_LAYER = {  # 19: attention with biases and sinks, experts with biases, no q/k norms
    "GptOssAttention/key/bias": (1, 8),
    "GptOssAttention/key/kernel": (16, 1, 8),
    "GptOssAttention/out/bias": (16,),
    "GptOssAttention/out/kernel": (2, 8, 16),
    "GptOssAttention/query/bias": (2, 8),
    "GptOssAttention/query/kernel": (16, 2, 8),
    "GptOssAttention/sinks": (2,),
    "GptOssAttention/value/bias": (1, 8),
    "GptOssAttention/value/kernel": (16, 1, 8),
    "GptOssMlp/gate/bias": (4,),
    "GptOssMlp/gate/kernel": (16, 4),
    "GptOssMlp/wi_0": (4, 16, 8),
    "GptOssMlp/wi_0_bias": (4, 8),
    "GptOssMlp/wi_1": (4, 16, 8),
    "GptOssMlp/wi_1_bias": (4, 8),
    "GptOssMlp/wo": (4, 8, 16),
    "GptOssMlp/wo_bias": (4, 16),
    "post_self_attention_layer_norm/scale": (16,),
    "pre_self_attention_layer_norm/scale": (16,),
}
# 4 layers, block-scanned by inhomogeneous_layer_cycle_interval 2 (a sliding-window and a global
# attention layer): layers/layers_k (k = 0, 1) over 2 repetitions; unscanned layers_<2r+k>.
GPTOSS_WEIGHTS = {  # 41
    **MOE16_TOP,
    **{
        f"decoder/layers/layers_{k}/{n}": _scanned(s, 2)
        for k in range(2)
        for n, s in GPTOSS_LAYER.items()
    },
}
GPTOSS_UNSCANNED_WEIGHTS = {  # 79
    **MOE16_TOP,
    **{f"decoder/layers_{i}/{n}": s for i in range(4) for n, s in GPTOSS_LAYER.items()},
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
QWEN3MOE_RNGS = _rngs({"decoder/rngs": (), "decoder/layers/moe_block/rngs": (2,)})
QWEN3MOE_UNSCANNED_RNGS = _rngs({"decoder/layers_0/moe_block/rngs": ()})
# gpt-oss: a stream in the first block's attention only (none in layers_1).
GPTOSS_RNGS = _rngs({"decoder/rngs": (), "decoder/layers/layers_0/GptOssAttention/rngs": (2,)})
GPTOSS_UNSCANNED_RNGS = _rngs({"decoder/layers_0/GptOssAttention/rngs": ()})

# run -> (weights, RNG leaves, scan_layers)
PRETRAIN_RUNS = {
    "gemma3_pretrain_run": (GEMMA3_WEIGHTS, GEMMA3_RNGS, True),
    "gemma3_pretrain_unscanned_run": (GEMMA3_UNSCANNED_WEIGHTS, GEMMA3_UNSCANNED_RNGS, False),
    "mixtral_pretrain_run": (MIXTRAL_WEIGHTS, MIXTRAL_RNGS, True),
    "mixtral_pretrain_unscanned_run": (MIXTRAL_UNSCANNED_WEIGHTS, MIXTRAL_UNSCANNED_RNGS, False),
    "qwen3moe_pretrain_run": (QWEN3MOE_WEIGHTS, QWEN3MOE_RNGS, True),
    "qwen3moe_pretrain_unscanned_run": (
        QWEN3MOE_UNSCANNED_WEIGHTS,
        QWEN3MOE_UNSCANNED_RNGS,
        False,
    ),
    "gptoss_pretrain_run": (GPTOSS_WEIGHTS, GPTOSS_RNGS, True),
    "gptoss_pretrain_unscanned_run": (GPTOSS_UNSCANNED_WEIGHTS, GPTOSS_UNSCANNED_RNGS, False),
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
    "qwen3moe_sft_run": (QWEN3MOE_WEIGHTS, QWEN3MOE_RNGS, "qwen3moe_pretrain_run"),
    "qwen3moe_sft_unscanned_run": (
        QWEN3MOE_UNSCANNED_WEIGHTS,
        QWEN3MOE_UNSCANNED_RNGS,
        "qwen3moe_pretrain_unscanned_run",
    ),
    "gptoss_sft_run": (GPTOSS_WEIGHTS, GPTOSS_RNGS, "gptoss_pretrain_run"),
    "gptoss_sft_unscanned_run": (
        GPTOSS_UNSCANNED_WEIGHTS,
        GPTOSS_UNSCANNED_RNGS,
        "gptoss_pretrain_unscanned_run",
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
QWEN3MOE_LORA = {  # 16: as mixtral's, at emb 16, mlp 8, under moe_block
    f"decoder/layers/{weight}_lora_{ab}": shape
    for weight, shapes in {
        "self_attention/query/kernel": ((16, 2, 4), (4, 2, 16)),
        "self_attention/key/kernel": ((16, 2, 4), (4, 2, 8)),
        "self_attention/value/kernel": ((16, 2, 4), (4, 2, 8)),
        "self_attention/out/kernel": ((16, 2, 4), (4, 2, 16)),
        "moe_block/gate/kernel": ((16, 2, 4), (4, 2, 4)),
        "moe_block/wi_0": ((16, 2, 4), (4, 2, 4, 8)),
        "moe_block/wi_1": ((16, 2, 4), (4, 2, 4, 8)),
        "moe_block/wo": ((4, 2, 8, 4), (4, 2, 16)),
    }.items()
    for ab, shape in zip("ab", shapes, strict=True)
}
LORA_RUNS = {
    "gemma3_lora_run": GEMMA3_LORA,
    "mixtral_lora_run": MIXTRAL_LORA,
    "qwen3moe_lora_run": QWEN3MOE_LORA,
}
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
    return _flat(stock_restore(item))


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


@pytest.mark.parametrize(("family", "moe"), [("mixtral", "MoeBlock_0"), ("qwen3moe", "moe_block")])
def test_expert_adapters_follow_the_expert_einsums(tmp_path, family, moe):
    """wi_0/wi_1: A (emb, L, r) shared, B (r, L, experts, mlp); wo: A (experts, L, mlp, r), B shared."""
    fx = _copy(tmp_path, f"{family}_lora_run", f"{family}_pretrain_run")
    lora = _metadata(fx / f"{family}_lora_run/checkpoints/2/model_params")
    base = _metadata(fx / f"{family}_pretrain_run/checkpoints/0/items")
    experts, layers, emb, mlp = base[f"params/params/decoder/layers/{moe}/wi_0"].shape
    for w in ("wi_0", "wi_1"):
        assert lora[f"decoder/layers/{moe}/{w}_lora_a/value"].shape == (emb, layers, RANK)
        assert lora[f"decoder/layers/{moe}/{w}_lora_b/value"].shape == (
            RANK,
            layers,
            experts,
            mlp,
        )
    assert base[f"params/params/decoder/layers/{moe}/wo"].shape == (experts, layers, mlp, emb)
    assert lora[f"decoder/layers/{moe}/wo_lora_a/value"].shape == (experts, layers, mlp, RANK)
    assert lora[f"decoder/layers/{moe}/wo_lora_b/value"].shape == (RANK, layers, emb)
    # The expert adapters are named after the Param itself (no kernel level).
    assert not any(f"{moe}/wi_0/" in p or f"{moe}/wo/" in p for p in lora)


# -- the same model, scanned and unscanned -----------------------------------------------------------
@pytest.mark.parametrize(
    ("scanned", "unscanned"),
    [
        (GEMMA3_WEIGHTS, GEMMA3_UNSCANNED_WEIGHTS),
        (MIXTRAL_WEIGHTS, MIXTRAL_UNSCANNED_WEIGHTS),
        (QWEN3MOE_WEIGHTS, QWEN3MOE_UNSCANNED_WEIGHTS),
        (GPTOSS_WEIGHTS, GPTOSS_UNSCANNED_WEIGHTS),
    ],
)
def test_scanned_weights_are_the_unscanned_ones_stacked_on_axis_1(scanned, unscanned):
    """The tables above, as MaxText's trees: every scanned weight stacks its layers on axis 1."""
    # A block scan's layers/layers_<k> (gemma3: 6, gpt-oss: 2); a plain scan has none.
    pattern = len({p.split("/")[2] for p in scanned if p.startswith("decoder/layers/layers_")})
    pattern = pattern or 1
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


# -- qwen3-moe and gpt-oss: the real runs converted (the public API) -------------------------------
# family -> layers per scan step of a block (gpt-oss's inhomogeneous_layer_cycle_interval), 0 for
# a plain scan
CONVERTED_FAMILIES = {"qwen3moe": 0, "gptoss": 2}
# family -> (scanned weights, unscanned weights)
FAMILY_WEIGHTS = {
    "qwen3moe": (QWEN3MOE_WEIGHTS, QWEN3MOE_UNSCANNED_WEIGHTS),
    "gptoss": (GPTOSS_WEIGHTS, GPTOSS_UNSCANNED_WEIGHTS),
}


def _raw(x) -> np.ndarray:
    """The stored values; typed PRNG keys as their uint32 data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _unrolled(path: str, block: int, r: int) -> str:
    """MaxText's unscanned name of scan step ``r`` of a stacked leaf (any items path: params,
    nnx_aux or an Adam moment): ``decoder/layers/<rest>`` -> ``decoder/layers_<r>/<rest>``; a
    block's ``decoder/layers/layers_<k>/<rest>`` -> ``decoder/layers_<r*block+k>/<rest>``."""
    head, sep, rest = path.partition("decoder/layers/")
    assert sep, path
    if block:
        k, rest = rest.split("/", 1)
        return f"{head}decoder/layers_{r * block + int(k.removeprefix('layers_'))}/{rest}"
    return f"{head}decoder/layers_{r}/{rest}"


def _tunix_to_items(path: str) -> str:
    """A Tunix SFT leaf's MaxText items path (``value`` level dropped; Adam's state from
    ``opt_state/1/0`` to the Linen ``opt_state/0``)."""
    path = path.removesuffix("/value")
    for moment in ("mu", "nu"):
        if path.startswith(f"opt_state/1/0/{moment}/"):
            return f"opt_state/0/{moment}/params/" + path.removeprefix(f"opt_state/1/0/{moment}/")
    return ("nnx_aux/model/" if "/rngs/" in path else "params/params/") + path


def _tunix_as_items(step: Path) -> dict[str, np.ndarray]:
    """A Tunix step's weights, RNG state and Adam moments under their MaxText items names."""
    out = {}
    for item in ("model_params", "optimizer_state"):
        for path, x in _restore(step / item).items():
            if "/mu/" in path or "/nu/" in path or item == "model_params":
                out[_tunix_to_items(path)] = _raw(x)
    return out


def _check_unrolled(stacked: dict, flat: dict, block: int) -> set[str]:
    """Every leaf of ``flat`` (unscanned) that ``stacked`` holds, compared byte for byte: weights
    and moments sliced on axis 1 (``param_scan_axis``), RNG state on 0; returns those checked."""
    checked = set()
    for path, x in stacked.items():
        if "decoder/layers/" not in path:
            if path in flat:  # outside the layers: the same bytes
                assert _raw(flat[path]).tobytes() == _raw(x).tobytes(), path
                checked.add(path)
            continue
        axis = 0 if path.startswith("nnx_aux/") else 1
        for r in range(_raw(x).shape[axis]):
            q = _unrolled(path, block, r)
            if q in flat:  # MaxText's unscanned model keeps its one RNG stream at layers_0
                layer = np.take(_raw(x), r, axis=axis)
                assert _raw(flat[q]).tobytes() == layer.tobytes(), (path, r)
                checked.add(q)
    return checked


def _trained(flat: dict) -> set[str]:
    """The weights and Adam moments of an items tree (no RNG state, no counts)."""
    return {p for p in flat if p.startswith(("params/", "opt_state/0/mu/", "opt_state/0/nu/"))}


@pytest.mark.parametrize("run", [r for r in SFT_RUNS if r.startswith(tuple(CONVERTED_FAMILIES))])
def test_new_family_sft_step_converts_into_its_pretraining_step_s_layout(run, tmp_path):
    """``convert`` of the Tunix SFT step against MaxText's own step of the same form: exactly
    MaxText's tree, every weight, RNG leaf and Adam moment the Tunix step's bytes, ``verify``."""
    base = SFT_RUNS[run][2]
    fx = _copy(tmp_path, run, base)
    step = fx / run / "checkpoints" / str(UPDATES)
    target = fx / base / "checkpoints" / "0"
    report = oml.convert_step(step, oml.Target.from_checkpoint(target))
    assert report.status == "converted"
    assert oml.read_specs(step / "items") == oml.read_specs(target / "items")
    items = {p: _raw(x) for p, x in _restore(step / "items").items()}
    source = _tunix_as_items(step)
    assert set(source) == _trained(items) | {p for p in items if p.startswith("nnx_aux/")}
    for path, x in source.items():
        assert items[path].tobytes() == x.tobytes(), path
    assert int(items["step"]) == UPDATES
    assert oml.verify_step(step).ok


@pytest.mark.parametrize("family", CONVERTED_FAMILIES)
def test_new_family_unroll_is_maxtext_s_unscanned_step_and_stack_gives_it_back(family, tmp_path):
    """The scanned SFT step ``--unroll``-ed against MaxText's unscanned step: its tree exactly
    (gpt-oss: scan step r of ``layers/layers_k`` is ``layers_<2r+k>``), every weight and moment
    the source's slice; then MaxText-layout ``--stack --out`` back onto the scanned step: every
    weight and moment the Tunix step's, bit for bit."""
    block = CONVERTED_FAMILIES[family]
    run, scanned_run = f"{family}_sft_run", f"{family}_pretrain_run"
    unscanned_run = f"{family}_pretrain_unscanned_run"
    fx = _copy(tmp_path, run, scanned_run, unscanned_run)
    step = fx / run / "checkpoints" / str(UPDATES)
    scanned = fx / scanned_run / "checkpoints" / "0"
    unscanned = fx / unscanned_run / "checkpoints" / "0"

    report = oml.convert_step(step, oml.Target.from_checkpoint(unscanned), rescan="unroll")
    assert report.status == "converted"
    assert oml.read_specs(step / "items") == oml.read_specs(unscanned / "items")
    assert oml.converted_provenance(step)["scan"] == "unroll"
    assert oml.verify_step(step).ok
    source = _tunix_as_items(step)
    unrolled = _restore(step / "items")
    checked = _check_unrolled(source, unrolled, block)
    assert _trained(unrolled) <= checked, sorted(_trained(unrolled) - checked)[:5]
    assert len(_trained(unrolled)) == 3 * len(FAMILY_WEIGHTS[family][1])
    # The unscanned model's one RNG stream is scan step 0's (layers_0 is in the first block).
    assert {p for p in checked if p.startswith("nnx_aux/")} == {
        p for p in unrolled if p.startswith("nnx_aux/")
    }

    out = tmp_path / "stacked" / str(UPDATES)
    report = oml.convert_step(step, oml.Target.from_checkpoint(scanned), rescan="stack", out=out)
    assert report.status == "converted"
    assert oml.read_specs(out / "items") == oml.read_specs(scanned / "items")
    assert json.loads((out / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]["scan_layers"]
    assert oml.verify_step(out).ok
    back = _restore(out / "items")
    assert _trained(back) == {p for p in source if not p.startswith("nnx_aux/")}
    for path in _trained(back):
        assert _raw(back[path]).tobytes() == source[path].tobytes(), path


# gpt-oss's --stack of a MaxText-layout step into --out is the second half of the test above
# (2 s a gpt-oss conversion: its 246 unscanned leaves); MaxText's exporter judges both of its
# directions through the command line in tests/interop/test_families_real_rescan.py.
@pytest.mark.parametrize(
    ("family", "scan"), [("qwen3moe", "unroll"), ("qwen3moe", "stack"), ("gptoss", "unroll")]
)
def test_new_family_maxtext_step_changes_scan_form_into_out(family, scan, tmp_path):
    """MaxText's own pre-training step of one form, converted into ``--out`` against its step of
    the other (``convert STEP --unroll|--stack --target-from OTHER --out DIR``): that step's
    tree, ``scan_layers`` recorded, every weight and Adam moment the source's (sliced or
    stacked on its axis), ``verify``; the source untouched."""
    block = CONVERTED_FAMILIES[family]
    scanned_run, unscanned_run = f"{family}_pretrain_run", f"{family}_pretrain_unscanned_run"
    fx = _copy(tmp_path, scanned_run, unscanned_run)
    scanned = fx / scanned_run / "checkpoints" / "0"
    unscanned = fx / unscanned_run / "checkpoints" / "0"
    src, other = (scanned, unscanned) if scan == "unroll" else (unscanned, scanned)
    before = tree_digest(src)
    out = tmp_path / "out" / "0"
    report = oml.convert_step(src, oml.Target.from_checkpoint(other), rescan=scan, out=out)
    assert report.status == "converted"
    assert tree_digest(src) == before
    assert oml.read_specs(out / "items") == oml.read_specs(other / "items")
    meta = json.loads((out / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]
    assert meta["scan_layers"] is (scan == "stack")
    assert oml.converted_provenance(out)["scan"] == scan
    assert oml.verify_step(out).ok
    got = _restore(out / "items")
    stacked, flat = (
        (_restore(src / "items"), got) if scan == "unroll" else (got, _restore(src / "items"))
    )
    checked = _check_unrolled(stacked, flat, block)
    unscanned_trained = _trained(got if scan == "unroll" else flat)
    assert unscanned_trained <= checked, sorted(unscanned_trained - checked)[:5]
