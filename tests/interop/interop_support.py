"""Support for the interop suite: real Tunix writes, this library converts, real MaxText reads.

Producer: ``tunix.sft.checkpoint_manager.CheckpointManager`` from google-tunix 0.1.7, with
its default options, exactly as ``PeftTrainer`` builds it (RL adds the ``actor`` level the
way ``tunix/rl/rl_cluster.py`` does: ``os.path.join(checkpoint_root_directory, "actor")``).
Models and optimizers are the tiny NNX ones of ``tests/writers.py`` (shared with the core
suite); LoRA adapters are added here as ``nnx.LoRAParam`` variables named the way qwix
names them (``kernel_lora_a``/``kernel_lora_b``).

Consumer: ``maxtext.common.checkpointing`` from maxtext 0.2.5.

Comparisons are bit-for-bit: raw bytes and dtype of every leaf, PRNG keys through their key
data, and the set of paths must be equal.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import writers as W  # noqa: E402  (tests/writers.py: the core suite's models and optimizers)
from tunix.sft import checkpoint_manager as tunix_ckpt  # noqa: E402

ADAPTER_KEY = "base"
LORA_RANK = 2


# ----------------------------------------------------------------------------- models


def add_lora(model: nnx.Module, *, rank: int = LORA_RANK, seed: int = 1) -> nnx.Module:
    """Attaches ``kernel_lora_a``/``kernel_lora_b`` LoRAParams to every MLP projection.

    qwix's LoRA provider creates exactly these ``nnx.LoRAParam`` names next to the kernel.
    For a scanned kernel ``(E, L, M)`` the adapters are ``(E, L, r)`` and ``(r, L, M)``.
    ``lora_b`` starts non-zero so that every byte of both adapters is checked.
    """
    key = jax.random.key(seed)
    decoder = W.get_decoder(model)
    layers = (
        [decoder.layers]
        if decoder.scanned
        else [getattr(decoder, f"layers_{i}") for i in range(decoder.num_layers)]
    )
    for layer in layers:
        for dense in (layer.mlp.wi, layer.mlp.wo):
            shape = dense.kernel.get_value().shape
            key, ka, kb = jax.random.split(key, 3)
            dense.kernel_lora_a = nnx.LoRAParam(
                jax.random.normal(ka, (*shape[:-1], rank), jnp.float32)
            )
            dense.kernel_lora_b = nnx.LoRAParam(
                0.1 * jax.random.normal(kb, (rank, *shape[1:]), jnp.float32)
            )
    return model


def make_model(*, scanned: bool, adapter: bool = False, lora: bool = False, seed: int = 0):
    model = W.make_model(scanned=scanned, adapter=False, seed=seed)
    if lora:
        add_lora(model)
    return W.TunixMaxTextAdapter(model) if adapter else model


def abstract_model(*, scanned: bool, lora: bool = False):
    """The bare (MaxText-side) model under ``nnx.eval_shape``: no adapter level."""
    return nnx.eval_shape(lambda: make_model(scanned=scanned, lora=lora))


def make_optimizer(model: nnx.Module, kind: str, *, lora: bool = False) -> nnx.Optimizer:
    return nnx.Optimizer(model, W.make_tx(kind), wrt=nnx.LoRAParam if lora else nnx.Param)


# --------------------------------------------------------------------------- producer


@dataclasses.dataclass
class TunixRun:
    """A run written by Tunix's CheckpointManager, plus the live objects that were saved."""

    name: str
    root: Path  # what MaxText's checkpoint manager is pointed at (incl. the role level)
    steps: dict[int, dict[str, Any]]  # step -> flat snapshots at save time
    scanned: bool
    adapter: bool
    lora: bool
    optimizer_kind: str | None
    custom_metadata: dict[int, dict[str, Any]]

    def step_dir(self, step: int | None = None) -> Path:
        return self.root / str(step if step is not None else max(self.steps))


def write_tunix_run(
    base_dir: Path,
    name: str,
    *,
    scanned: bool,
    adapter: bool = False,
    lora: bool = False,
    optimizer_kind: str | None = "sft",
    role: str | None = None,
    steps: tuple[int, ...] = (1,),
) -> TunixRun:
    """Trains a tiny model and saves it with google-tunix's ``CheckpointManager.save``.

    Each entry of ``steps`` is saved after that many real optimizer updates, with the
    custom metadata Tunix itself passes (RL: ``{"global_step", "role"}``, else none).
    """
    model = make_model(scanned=scanned, adapter=adapter, lora=lora)
    opt = make_optimizer(model, optimizer_kind, lora=lora) if optimizer_kind else None
    root = base_dir / name / "checkpoints"
    if role is not None:  # tunix/rl/rl_cluster.py: os.path.join(root, "actor")
        root = Path(os.path.join(root, role))
    manager = tunix_ckpt.CheckpointManager(str(root))  # default options, as PeftTrainer
    snapshots, metadata = {}, {}
    done = 0
    try:
        for step in steps:
            if opt is not None:
                W.train_steps(model, opt, step - done)
                done = step
            custom = {"global_step": step + 1, "role": role} if role else None
            saved = manager.save(
                step,
                model,
                opt,
                save_only_lora_params=lora,
                force=True,
                custom_metadata=custom,
            )
            assert saved, f"Tunix CheckpointManager.save refused step {step}"
            snapshots[step] = snapshot(model, opt, lora=lora)
            metadata[step] = custom or {}
    finally:
        manager.close()  # waits for Tunix's (default) async save to commit
    return TunixRun(name, root, snapshots, scanned, adapter, lora, optimizer_kind, metadata)


# ----------------------------------------------------------------------------- trees


def norm(k: Any) -> str:
    """A path key as a string: attribute, dict key, sequence index and digit string alike."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _leaf(x: Any) -> bool:
    return x is None or hasattr(x, "dtype")


def flat(tree: Any, *, drop_adapter: bool = False) -> dict[tuple[str, ...], Any]:
    """``{path: array}`` of a pytree, nnx.State or pure dict (``None`` leaves dropped)."""
    if isinstance(tree, nnx.State):
        tree = tree.to_pure_dict()
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_leaf)[0]
    out = {}
    for path, x in leaves:
        if x is None:
            continue
        p = tuple(norm(k) for k in path)
        if drop_adapter:
            p = tuple(k for k in p if k != ADAPTER_KEY)
        out[p] = x
    return out


def raw(x: Any) -> tuple[str, bytes]:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return f"key<{jax.random.key_impl(x)}>", np.asarray(jax.random.key_data(x)).tobytes()
    return str(x.dtype), np.asarray(x).tobytes()


def assert_bit_identical(got: dict, want: dict, what: str) -> None:
    """Same paths, and per leaf the same dtype (typed keys stay typed) and the same bytes."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    assert not missing and not extra, f"{what}: missing {missing}, unexpected {extra}"
    bad = []
    for p in sorted(want):
        g, w = got[p], want[p]
        if tuple(np.shape(g)) != tuple(np.shape(w)) or raw(g) != raw(w):
            bad.append("/".join(p))
    assert not bad, f"{what}: {len(bad)} leaves differ: {bad}"


def snapshot(model: nnx.Module, opt: nnx.Optimizer | None, *, lora: bool) -> dict[str, Any]:
    """Host copies of what was saved, split the way MaxText stores it (no adapter level)."""
    inner = model.base if isinstance(model, W.TunixMaxTextAdapter) else model
    if lora:
        params = nnx.state(inner, nnx.LoRAParam)
        aux = nnx.State({})
    else:
        params, _, aux = nnx.state(inner, nnx.Param, (nnx.Intermediate, nnx.Cache), ...)
    out = {
        "params": {p: _copy(x) for p, x in flat(params).items()},
        "nnx_aux": {p: _copy(x) for p, x in flat(aux).items()},
    }
    if opt is not None:
        opt_state = flat(nnx.state(opt, nnx.optimizer.OptState), drop_adapter=True)
        out["step"] = _copy(opt_state.pop(("step",)))
        out["opt_state"] = {
            p[1:]: _copy(x) for p, x in opt_state.items() if p[:1] == ("opt_state",)
        }
    return out


def _copy(x: Any) -> Any:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(
            np.array(jax.random.key_data(x)), impl=jax.random.key_impl(x)
        )
    return np.array(x)
