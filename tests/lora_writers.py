"""Test support: a llama-shaped MaxText base step and Tunix LoRA adapter steps, written by Orbax.

The base is written like MaxText's ``save_checkpoint`` (one ``items`` PyTree: params without
a ``value`` level, ``nnx_aux``, a Linen-form ``opt_state``, ``step``); the adapters like
Tunix's ``PeftTrainer`` with ``save_only_lora_params=True`` (``model_params`` holding only
qwix's ``<weight>_lora_a``/``_lora_b`` factors, each with a ``value`` level, and an
``optimizer_state`` with Adam moments over them). Shapes follow MaxText's llama decoder and
qwix (../LORA.md in the notes): per layer, ``lora_a`` is ``(prod(contracting dims), r)`` and
``lora_b`` ``(r, prod(other dims))``; scanned, each stacks its layers on the kernel's axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_maxtext_layout.base.treepaths import Path, unflatten

EMB, HEADS, HEAD_DIM, MLP, VOCAB = 16, 2, 8, 32, 64


def kernels(
    emb: int = EMB, heads: int = HEADS, head_dim: int = HEAD_DIM, mlp: int = MLP
) -> dict[str, tuple[tuple[int, ...], int]]:
    """weight -> (per-layer kernel shape, number of leading contracting dims)."""
    return {
        "self_attention/query": ((emb, heads, head_dim), 1),
        "self_attention/out": ((heads, head_dim, emb), 2),
        "mlp/wi_0": ((emb, mlp), 1),
        "mlp/wo": ((mlp, emb), 1),
    }


KERNELS = kernels()


def _stacked(shape: tuple[int, ...], layers: int, axis: int) -> tuple[int, ...]:
    return shape[:axis] + (layers,) + shape[axis:]


def base_params(
    *,
    layers: int = 3,
    axis: int | None = 1,
    dtype: Any = np.float32,
    seed: int = 0,
    shapes: dict | None = None,
) -> dict[Path, np.ndarray]:
    """Flat MaxText params (``decoder/...``, no ``params/params`` prefix); ``axis=None``:
    unscanned (``layers_<i>``); ``shapes``: `kernels` of other sizes."""
    shapes = shapes or KERNELS
    emb = shapes["mlp/wi_0"][0][0]
    rng = np.random.default_rng(seed)
    out: dict[Path, np.ndarray] = {
        ("token_embedder", "embedding"): rng.normal(size=(VOCAB, emb)),
        ("decoder", "decoder_norm", "scale"): rng.normal(size=(emb,)),
    }
    for name, (shape, _) in shapes.items():
        mod = tuple(name.split("/"))
        if axis is None:
            for i in range(layers):
                out[("decoder", f"layers_{i}", *mod, "kernel")] = rng.normal(size=shape)
        else:
            out[("decoder", "layers", *mod, "kernel")] = rng.normal(
                size=_stacked(shape, layers, axis)
            )
    norm = ("pre_self_attention_layer_norm", "scale")
    if axis is None:
        for i in range(layers):
            out[("decoder", f"layers_{i}", *norm)] = rng.normal(size=(emb,))
    else:
        out[("decoder", "layers", *norm)] = rng.normal(size=_stacked((emb,), layers, axis))
    return {p: np.asarray(v, dtype) for p, v in out.items()}


def lora_factors(
    *,
    layers: int = 3,
    axis: int | None = 1,
    rank: int = 4,
    scale: float = 0.1,
    seed: int = 1,
    modules: tuple[str, ...] = tuple(KERNELS),
    shapes: dict | None = None,
) -> dict[Path, np.ndarray]:
    """Flat qwix factors of ``modules`` (model paths, no ``value`` level), float32;
    ``shapes``: `kernels` of other sizes."""
    rng = np.random.default_rng(seed)
    out: dict[Path, np.ndarray] = {}
    for name in modules:
        shape, k = (shapes or KERNELS)[name]
        a2 = (math.prod(shape[:k]), rank)
        b2 = (rank, math.prod(shape[k:]))
        mod = tuple(name.split("/"))
        groups = [f"layers_{i}" for i in range(layers)] if axis is None else ["layers"]
        for g in groups:
            a_shape = a2 if axis is None else _stacked(a2, layers, axis)
            b_shape = b2 if axis is None else _stacked(b2, layers, axis)
            out[("decoder", g, *mod, "kernel_lora_a")] = scale * rng.normal(size=a_shape)
            out[("decoder", g, *mod, "kernel_lora_b")] = scale * rng.normal(size=b_shape)
    return {p: np.asarray(v, np.float32) for p, v in out.items()}


def expected_merge(
    base: Mapping[Path, np.ndarray],
    factors: Mapping[Path, np.ndarray],
    alpha: float,
    rank: int,
    axis: int | None,
) -> dict[Path, np.ndarray]:
    """The merged params, computed independently: per layer, in float32, cast once."""
    out = dict(base)
    for p, a in factors.items():
        if p[-1] != "kernel_lora_a":
            continue
        b = factors[p[:-1] + ("kernel_lora_b",)]
        kp = p[:-1] + ("kernel",)
        w = base[kp]
        if axis is None:
            out[kp] = _merge_one(w, a, b, alpha / rank)
            continue
        out[kp] = np.stack(
            [
                _merge_one(
                    np.take(w, i, axis), np.take(a, i, axis), np.take(b, i, axis), alpha / rank
                )
                for i in range(w.shape[axis])
            ],
            axis=axis,
        )
    return out


def _merge_one(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    delta = (a.astype(np.float32) @ b.astype(np.float32)).reshape(w.shape)
    return (w.astype(np.float32) + np.float32(scale) * delta).astype(w.dtype)


def _save(directory: epath.Path, step: int, items: dict[str, Any], custom: dict | None) -> None:
    manager = ocp.CheckpointManager(
        directory,
        item_handlers={
            n: ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=z)
            for n, (_, z) in items.items()
        },
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
    )
    try:
        args = {n: ocp.args.PyTreeSave(tree) for n, (tree, _) in items.items()}
        manager.save(step, args=ocp.args.Composite(**args), custom_metadata=custom, force=True)
        manager.wait_until_finished()
    finally:
        manager.close()


def write_base(
    root: Any, step: int, params: Mapping[Path, np.ndarray], *, custom: dict | None = None
) -> epath.Path:
    """A MaxText step: ``items`` = params, one RNG leaf in nnx_aux, an Adam moment, step."""
    root = epath.Path(root).absolute()
    items = {
        "params": {"params": unflatten(dict(params))},
        "nnx_aux": {
            "model": {"decoder": {"rngs": {"dropout": {"count": np.zeros((), np.uint32)}}}}
        },
        "opt_state": [{"count": np.int32(2), "mu": {"params": {"x": np.ones(3, np.float32)}}}],
        "step": np.int32(step + 1),
    }
    _save(root, step, {"items": (items, True)}, custom or {"scan_layers": True})
    return root / str(step)


def write_adapters(
    root: Any, step: int, factors: Mapping[Path, np.ndarray], *, custom: dict | None = None
) -> epath.Path:
    """A Tunix LoRA adapter step (zarr2, as google-tunix 0.1.7 writes): model_params holds
    only the factors, each under a ``value`` level; optimizer_state holds their moments."""
    root = epath.Path(root).absolute()
    model = unflatten({p + ("value",): v for p, v in factors.items()})
    moments = unflatten({p + ("value",): np.zeros_like(v) for p, v in factors.items()})
    opt = {
        "opt_state": {"1": {"0": {"count": {"value": np.int32(2)}, "mu": moments, "nu": moments}}},
        "step": {"value": np.uint32(step)},
    }
    _save(root, step, {"model_params": (model, False), "optimizer_state": (opt, False)}, custom)
    return root / str(step)
