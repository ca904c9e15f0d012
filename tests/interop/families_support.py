"""Support for test_families.py: MaxText 0.2.5's model families, tiny, and synthetic Tunix
steps of them built from MaxText's own abstract model.

``FAMILIES`` holds, per family, the ``KEY=VALUE`` overrides of ``configs/base.yml`` that make
MaxText build a tiny model of it on CPU (FAMILIES_AND_SCALE), without ``scan_layers``:
a plain scan (llama3.1, qwen3-moe, mixtral, gemma2), block scans (gemma3 with a remainder,
gpt-oss, llama4) and DeepSeek's ``dense_layers``/``moe_layers``.

`write_synthetic_tunix_step` writes a Tunix-layout step (``model_params``, every leaf under a
``value`` level, as google-tunix 0.1.7's ``CheckpointManager`` saves ``nnx.state(model)``) of
the model MaxText builds for a config: every weight and RNG leaf of its abstract state, filled
with seeded random values (typed PRNG keys stay typed), so that a layer put in the wrong place
cannot pass for the right one.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_maxtext_layout.base.treepaths import flatten, unflatten
from orbax_maxtext_layout.model.maxtext_config import abstract_model
from orbax_maxtext_layout.orbax_io.spec import spec_of

_TINY = [
    "override_model_config=true",
    "base_emb_dim=32",
    "base_num_query_heads=2",
    "base_num_kv_heads=1",
    "head_dim=16",
    "base_mlp_dim=64",
    "vocab_size=64",
    "dtype=float32",
    "weight_dtype=float32",
]
_MOE = ["base_moe_mlp_dim=64", "num_experts=4", "num_experts_per_tok=2"]
FAMILIES: dict[str, list[str]] = {
    "llama3.1": ["model_name=llama3.1-8b", *_TINY, "base_num_decoder_layers=3"],
    "gemma2": ["model_name=gemma2-2b", *_TINY, "base_num_decoder_layers=4"],
    # 14 layers: two scan steps of gemma3's 6-layer attention pattern, and 2 remainder layers
    "gemma3": [
        "model_name=gemma3-4b",
        *_TINY,
        "base_num_decoder_layers=14",
        "use_multimodal=false",
    ],
    "mixtral": ["model_name=mixtral-8x7b", *_TINY, *_MOE, "base_num_decoder_layers=2"],
    "qwen3-moe": ["model_name=qwen3-30b-a3b", *_TINY, *_MOE, "base_num_decoder_layers=2"],
    "gpt-oss": ["model_name=gpt-oss-20b", *_TINY, *_MOE, "base_num_decoder_layers=4"],
    "llama4": [
        "model_name=llama4-17b-16e",
        *_TINY,
        *_MOE[:2],
        "num_experts_per_tok=1",
        "base_num_decoder_layers=4",
    ],
    "deepseek3": [
        "model_name=deepseek3-test",
        "override_model_config=true",
        "base_emb_dim=64",
        "base_num_query_heads=2",
        "base_num_kv_heads=2",
        "base_mlp_dim=64",
        "base_moe_mlp_dim=32",
        "base_num_decoder_layers=3",
        "first_num_dense_layers=1",
        "num_experts=4",
        "num_experts_per_tok=2",
        "q_lora_rank=16",
        "kv_lora_rank=16",
        "qk_nope_head_dim=8",
        "qk_rope_head_dim=8",
        "v_head_dim=8",
        "vocab_size=64",
        "dtype=float32",
        "weight_dtype=float32",
    ],
}


def base_yml() -> Path:
    import maxtext

    return Path(os.path.dirname(maxtext.__file__)) / "configs" / "base.yml"


def config(family: str, *, scan_layers: bool | None = None) -> list[str]:
    """``--maxtext-config`` of a family: base.yml and its keys (``scan_layers`` if given)."""
    keys = list(FAMILIES[family])
    if scan_layers is not None:
        keys.append(f"scan_layers={str(scan_layers).lower()}")
    return [str(base_yml()), *keys]


def _random(x: jax.ShapeDtypeStruct, rng: np.random.Generator):
    spec = spec_of(x)  # a typed key's stored form: uint32 data, its impl named
    if spec.key_impl:
        raw = rng.integers(0, 2**32, size=spec.shape, dtype=np.uint32)
        return jax.random.wrap_key_data(raw, impl=spec.key_impl)
    if np.issubdtype(x.dtype, np.integer):
        return rng.integers(0, 1000, size=x.shape).astype(x.dtype)
    return rng.standard_normal(x.shape).astype(x.dtype)


def model_state(
    family: str, *, scan_layers: bool, seed: int = 0, abstract: dict | None = None
) -> dict[tuple, object]:
    """``{model path: array}`` of every weight and nnx_aux leaf MaxText builds for the family,
    filled with seeded random values; ``abstract``: MaxText's flat abstract items of that
    model where the caller has them (`Target.abstract` of its config), else built here."""
    if abstract is None:
        items, _ = abstract_model(config(family, scan_layers=scan_layers))
        abstract = flatten(items, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    flat = abstract
    rng = np.random.default_rng(seed)
    out = {}
    for p, x in sorted(flat.items(), key=lambda kv: str(kv[0])):
        if p[:2] in (("params", "params"), ("nnx_aux", "model")):
            out[p[2:]] = _random(x, rng)
    return out


def write_tunix_step(root: Path, step: int, state: dict[tuple, object]) -> Path:
    """A model-only Tunix step (``model_params``, ``value`` levels) of ``state``."""
    tree = unflatten({(*p, "value"): v for p, v in state.items()})
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=False)
    manager = ocp.CheckpointManager(
        epath.Path(root).absolute(),
        item_handlers={"model_params": handler},
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
    )
    try:
        manager.save(step, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(tree)))
        manager.wait_until_finished()
    finally:
        manager.close()
    return Path(root) / str(step)
