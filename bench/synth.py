"""Builds a synthetic Tunix-layout step of a chosen size (used by the benchmark and tests).

The tree is what google-tunix writes for a scanned MaxText decoder behind the RL
adapter: bf16 weights, fp32 Adam ``mu``/``nu`` inside ``inject_hyperparams(chain(clip,
adamw))``, stacked RNG counts and typed keys, every leaf under a ``value`` level.
Arrays are saved with stock Orbax, OCDBT, like the real writer.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from realsize_steps import unflat_tree  # {path tuple: leaf} -> nested dicts

LAYERS = 4


def _shapes(emb: int, layers: int = LAYERS) -> dict[tuple[str, ...], tuple[int, ...]]:
    mlp, vocab = 4 * emb, 8 * emb
    return {
        ("token_embedder", "embedding"): (vocab, emb),
        ("decoder", "decoder_norm", "scale"): (emb,),
        ("decoder", "logits_dense", "kernel"): (emb, vocab),
        ("decoder", "layers", "mlp", "wi_0", "kernel"): (emb, layers, mlp),
        ("decoder", "layers", "mlp", "wi_1", "kernel"): (emb, layers, mlp),
        ("decoder", "layers", "mlp", "wo", "kernel"): (mlp, layers, emb),
        ("decoder", "layers", "self_attention", "query", "kernel"): (emb, layers, emb),
        ("decoder", "layers", "self_attention", "key", "kernel"): (emb, layers, emb),
        ("decoder", "layers", "self_attention", "value", "kernel"): (emb, layers, emb),
        ("decoder", "layers", "self_attention", "out", "kernel"): (emb, layers, emb),
        ("decoder", "layers", "pre_self_attention_layer_norm", "scale"): (emb, layers),
    }


def emb_for_size(total_bytes: int, layers: int = LAYERS) -> int:
    """The embedding width whose step (bf16 weights + fp32 mu, nu) is about ``total_bytes``."""
    # Per emb^2: embed 8 + logits 8 + L*(3*4 + 4) = 16 + 16L elements; 2 + 4 + 4 bytes each.
    per = (16 + 16 * layers) * 10
    return max(8, int(math.sqrt(total_bytes / per)) // 8 * 8)


def make_step(
    root: Path,
    step: int,
    size_bytes: int,
    *,
    seed: int = 0,
    layers: int = LAYERS,
    use_ocdbt: bool = True,
) -> Path:
    """Writes ``<root>/actor/<step>`` of about ``size_bytes``; returns the step dir.

    ``use_ocdbt=False`` writes the Pathways style (one zarr directory per array).
    """
    emb = emb_for_size(size_bytes, layers)
    rng = np.random.default_rng(seed)
    shapes = _shapes(emb, layers)
    params = {
        ("base", *p, "value"): jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)
        for p, s in shapes.items()
    }
    for stream in ("params", "dropout"):
        base = ("base", "decoder", "layers", "rngs", stream)
        params[(*base, "count", "value")] = jnp.arange(layers, dtype=jnp.uint32)
        params[(*base, "key", "value")] = jax.random.split(jax.random.key(seed), layers)
        params[("base", "decoder", "rngs", stream, "count", "value")] = jnp.uint32(1)
        params[("base", "decoder", "rngs", stream, "key", "value")] = jax.random.key(seed + 1)
    inner = ("opt_state", "inner_state", "1", "0")
    opt = {(*inner, "count", "value"): jnp.int32(step)}
    for m in ("mu", "nu"):
        for p, s in shapes.items():
            opt[(*inner, m, "base", *p, "value")] = jnp.asarray(rng.standard_normal(s, np.float32))
    opt[("opt_state", "count", "value")] = jnp.int32(step)
    opt[("opt_state", "hyperparams", "learning_rate", "value")] = jnp.float32(1e-4)
    opt[("opt_state", "hyperparams_states", "learning_rate", "count", "value")] = jnp.int32(step)
    opt[("step", "value")] = jnp.uint32(step)

    directory = epath.Path(root).resolve() / "actor"
    mngr = ocp.CheckpointManager(
        directory,
        item_handlers={
            n: ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt)
            for n in ("model_params", "optimizer_state")
        },
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
    )
    mngr.save(
        step,
        args=ocp.args.Composite(
            model_params=ocp.args.PyTreeSave(unflat_tree(params)),
            optimizer_state=ocp.args.PyTreeSave(unflat_tree(opt)),
        ),
        custom_metadata={"global_step": step, "role": "actor"},
        force=True,
    )
    mngr.wait_until_finished()
    mngr.close()
    return Path(directory) / str(step)


def converted_copy(src: Path, dst: Path) -> Path:
    """``dst``: a copy of the Tunix step ``src`` converted to MaxText's layout (``convert_step``
    with ``copy=True``), its legacy items removed: a stock manager's source, a target's."""
    import shutil

    from orbax_maxtext_layout import convert_step

    shutil.copytree(src, dst)
    convert_step(dst, target_for(src), copy=True)
    for legacy in ("model_params", "optimizer_state"):
        shutil.rmtree(dst / legacy)
    return dst


def target_for(step_dir: Path):
    """The MaxText-layout `Target` of the same model (RL optimizer kept, no adapter level)."""
    from orbax_maxtext_layout import Target, read_specs

    items = {}
    for p, s in read_specs(epath.Path(step_dir) / "model_params").items():
        model = p[1:-1]  # drop "base" and "value"
        root = ("nnx_aux", "model") if "rngs" in model else ("params", "params")
        items[root + model] = s.abstract()
    for p, s in read_specs(epath.Path(step_dir) / "optimizer_state").items():
        p = tuple(k for k in p[:-1] if k != "base")
        items[p] = jax.ShapeDtypeStruct(s.shape, np.int32) if p == ("step",) else s.abstract()
    return Target.from_items(unflat_tree(items))


def target_from_env():
    """``--target bench.synth:target_from_env``: the target for ``$OMTL_SYNTH_STEP``."""
    import os

    return target_for(Path(os.environ["OMTL_SYNTH_STEP"]))
