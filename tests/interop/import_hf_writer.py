"""Child for test_import_hf.py, run in the hf venv (transformers 5, CPU torch; OMTL_HF_PYTHON):
writes tiny Hugging Face checkpoints with ``transformers`` ``save_pretrained``.

    python import_hf_writer.py SPEC_JSON

``SPEC_JSON`` is a JSON list of ``{"out": DIR, "family": NAME, "dtype": "float32"|"bfloat16",
"seed": INT, "max_shard_size": null|"20KB"}``. Each model is built from its config with
``AutoModelForCausalLM.from_config``, every parameter is then overwritten with seeded normal
values (so no two layers, experts or norms are alike, and a swap or a dropped ``+1`` shows),
cast to ``dtype``, and saved with ``save_pretrained`` (safetensors; a small ``max_shard_size``
writes ``model.safetensors.index.json`` and several shards). Prints one JSON line per model:
its tensor names, dtypes and shapes as read back from the files.

The sizes are the tiny MaxText keys of tests/fixtures/generators/gen_maxtext025.py
(MODEL_KEYS, QWEN3_MODEL_KEYS, MIXTRAL_MODEL_KEYS, QWEN3MOE_MODEL_KEYS, GEMMA3_MODEL_KEYS).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path


def _sizes(emb: int, mlp: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """The size arguments every family's config takes (vocab 64, as the MaxText keys)."""
    return {
        "vocab_size": 64,
        "hidden_size": emb,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    }


LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def _config(family: str):
    import transformers as T

    if family == "llama3.1":
        return T.LlamaConfig(
            **_sizes(16, 32, 3, 2, 2, 8),
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=LLAMA31_ROPE,
            tie_word_embeddings=False,
        )
    if family == "qwen3":  # qwen3-0.6b: tied embeddings, no lm_head.weight
        return T.Qwen3Config(**_sizes(16, 32, 2, 2, 1, 8), tie_word_embeddings=True)
    if family == "mixtral":
        return T.MixtralConfig(
            **_sizes(32, 64, 2, 2, 1, 16),
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        )
    if family == "qwen3-moe":
        # intermediate_size 16: what MaxText's own _validate_or_update_architecture sets it to
        # for qwen3 MoE (its mlp_dim, here 8, x num_experts_per_tok 2); no dense layer uses it
        # (decoder_sparse_step 1).
        return T.Qwen3MoeConfig(
            **_sizes(16, 16, 2, 2, 1, 8),
            moe_intermediate_size=8,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            tie_word_embeddings=False,
        )
    if family == "gemma3":  # Gemma3ForCausalLM, text only; 14 layers: 2 x 6 + a remainder of 2
        return T.Gemma3TextConfig(
            **_sizes(32, 64, 14, 2, 1, 16),
            query_pre_attn_scalar=16,
            sliding_window=16,
            tie_word_embeddings=True,
        )
    raise SystemExit(f"unknown family {family!r}")


def write(spec: dict) -> dict:
    import torch
    import transformers as T
    from safetensors import safe_open

    family, out = spec["family"], Path(spec["out"])
    cfg = _config(family)
    torch.manual_seed(spec["seed"])
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():
        for _name, p in model.named_parameters():  # tied weights once
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.5)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    model = model.to(dtype)
    kwargs = {}
    if spec.get("max_shard_size"):
        kwargs["max_shard_size"] = spec["max_shard_size"]
    model.save_pretrained(str(out), **kwargs)
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                t = st.get_slice(k)
                tensors[k] = [f.name, str(t.get_dtype()), list(t.get_shape())]
    return {
        "out": str(out),
        "family": family,
        "class": type(model).__name__,
        "files": sorted(p.name for p in out.iterdir()),
        "tensors": tensors,
    }


def main(argv: list[str]) -> None:
    specs = json.loads(argv[0])
    for spec in specs:
        print(json.dumps(write(spec)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
    gc.freeze()  # exit without walking the heap transformers left
