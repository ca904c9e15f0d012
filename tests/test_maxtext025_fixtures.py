"""Real checkpoints of MaxText 0.2.5's own tiny model (tests/fixtures/maxtext025).

Written by MaxText's pre-training loop, MaxText's Tunix-based SFT trainer and an RL actor step
saved by google-tunix 0.1.7 (tests/fixtures/generators/gen_maxtext025.py; facts in the fixture's
README). These tests need no MaxText: stock Orbax/JAX/numpy and the package's public API only.
Fixtures are read-only data: every test works on a copy in tmp_path.
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
from conftest import stock_restore
from etils import epath

import orbax_maxtext_layout as oml

FIXTURE = Path(__file__).parent / "fixtures" / "maxtext025"
PRETRAIN = "pretrain_run/checkpoints"
SFT_STEP = "sft_run/checkpoints/2"
RL_STEP = "rl_run/checkpoints/actor/2"
TUNIX_STEPS = {"sft": SFT_STEP, "rl": RL_STEP}

N_LAYERS = 3
UPDATES = 2
# The 12 weights of the tiny llama3.1-8b-shaped model: stored shape, scanned on axis 1.
WEIGHTS = {
    "decoder/decoder_norm/scale": (16,),
    "decoder/layers/mlp/wi_0/kernel": (16, 3, 32),
    "decoder/layers/mlp/wi_1/kernel": (16, 3, 32),
    "decoder/layers/mlp/wo/kernel": (32, 3, 16),
    "decoder/layers/post_self_attention_layer_norm/scale": (16, 3),
    "decoder/layers/pre_self_attention_layer_norm/scale": (16, 3),
    "decoder/layers/self_attention/key/kernel": (16, 3, 2, 8),
    "decoder/layers/self_attention/out/kernel": (2, 3, 8, 16),
    "decoder/layers/self_attention/query/kernel": (16, 3, 2, 8),
    "decoder/layers/self_attention/value/kernel": (16, 3, 2, 8),
    "decoder/logits_dense/kernel": (16, 64),
    "token_embedder/embedding": (64, 16),
}
# MaxText 0.2.5's RNG state: 12 leaves, under two Rngs objects only; unsafe_rbg keys (4,).
RNG_GROUPS = {"decoder/rngs": (), "decoder/layers/self_attention/rngs": (N_LAYERS,)}
RNG_STREAMS = ("aqt", "dropout", "params")
RNGS = {
    f"{group}/{stream}/{leaf}": batch + ((4,) if leaf == "key" else ())
    for group, batch in RNG_GROUPS.items()
    for stream in RNG_STREAMS
    for leaf in ("count", "key")
}
# Stock restores without shardings read them from the checkpoint (single CPU device here).
pytestmark = pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")

V1_PYTREE_HANDLER = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"


# -- helpers: stock Orbax only ------------------------------------------------------------------
def _copy(tmp_path: Path) -> Path:
    """A writable copy of the whole fixture tree."""
    out = tmp_path / "maxtext025"
    shutil.copytree(FIXTURE, out)
    for root, dirs, files in os.walk(out):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return out


@pytest.fixture
def fx(tmp_path) -> Path:
    return _copy(tmp_path)


def _key(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    raise TypeError(k)


def _flat(tree) -> dict[str, object]:
    """``{"a/b/c": leaf}``; chain indices as strings, ``None`` members are no leaves."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {"/".join(_key(k) for k in path): leaf for path, leaf in leaves}


def _metadata(item: Path) -> dict[str, object]:
    return _flat(ocp.PyTreeCheckpointHandler().metadata(epath.Path(item)).tree)


def _restore(item: Path) -> dict[str, object]:
    return _flat(stock_restore(item))


def _step_metadata(step: Path) -> dict:
    return json.loads((step / "_CHECKPOINT_METADATA").read_text())


def _raw(x) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _rng_paths(paths, prefix: str = "", suffix: str = "") -> dict[str, str]:
    """``{model path: stored path}`` of the RNG leaves among ``paths``."""
    out = {}
    for p in paths:
        if "/rngs/" in p:
            model = p.removeprefix(prefix).removesuffix(suffix)
            out[model] = p
    return out


# -- the pre-training run (MaxText's own loop) ----------------------------------------------------
def test_pretrain_run_has_two_maxtext_steps_numbered_after_the_update(fx):
    steps = oml.find_steps(fx / PRETRAIN)
    assert [(s.step, s.layout, s.role) for s in steps] == [
        (0, oml.Layout.MAXTEXT, None),
        (1, oml.Layout.MAXTEXT, None),
    ]
    for directory, items_step in ((0, 1), (1, 2)):
        step = fx / PRETRAIN / str(directory)
        meta = _step_metadata(step)
        assert meta["custom_metadata"] == {"scan_layers": True}
        assert meta["item_handlers"] == {"items": V1_PYTREE_HANDLER}
        assert sorted(p.name for p in step.iterdir() if p.is_dir()) == ["items"]
        restored = _restore(step / "items")
        # MaxText saves after the update: directory N holds items/step == N + 1.
        assert int(restored["step"]) == items_step
        assert restored["step"].dtype == np.int32
        assert int(restored["opt_state/0/count"]) == items_step
        assert int(restored["opt_state/2/count"]) == items_step


def test_pretrain_items_tree(fx):
    item = fx / PRETRAIN / "1" / "items"
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(item)).tree
    assert sorted(tree) == ["nnx_aux", "opt_state", "params", "step"]
    # Linen form: [{count, mu: {params}, nu: {params}}, None, {count}].
    opt = tree["opt_state"]
    assert isinstance(opt, list) and len(opt) == 3 and opt[1] is None
    assert sorted(opt[0]) == ["count", "mu", "nu"] and sorted(opt[2]) == ["count"]
    assert list(opt[0]["mu"]) == ["params"] and list(opt[0]["nu"]) == ["params"]

    flat = _metadata(item)
    assert len(flat) == 51
    groups = {}
    for p in flat:
        root = (
            "/".join(p.split("/")[:2]) if p.startswith(("params/", "nnx_aux/")) else p.split("/")[0]
        )
        groups[root] = groups.get(root, 0) + 1
    assert groups == {"params/params": 12, "nnx_aux/model": 12, "opt_state": 26, "step": 1}
    weights = {
        p.removeprefix("params/params/"): m.shape
        for p, m in flat.items()
        if p.startswith("params/")
    }
    assert weights == WEIGHTS
    for moment in ("mu", "nu"):
        prefix = f"opt_state/0/{moment}/params/"
        assert {
            p.removeprefix(prefix): m.shape for p, m in flat.items() if p.startswith(prefix)
        } == WEIGHTS
    assert all(m.dtype == np.float32 for p, m in flat.items() if p.startswith("params/"))

    # Both pre-training steps have the same tree and stored specs.
    assert oml.read_specs(item) == oml.read_specs(fx / PRETRAIN / "0" / "items")


# -- RNG state and keys, in all three producers -----------------------------------------------------
RNG_ITEMS = {
    "pretrain": (f"{PRETRAIN}/1/items", "nnx_aux/model/", ""),
    "sft": (f"{SFT_STEP}/model_params", "", "/value"),
    "rl": (f"{RL_STEP}/model_params", "base/", "/value"),
}


@pytest.mark.parametrize("name", sorted(RNG_ITEMS))
def test_rng_leaves_are_twelve_unsafe_rbg_streams(name, fx):
    rel, prefix, suffix = RNG_ITEMS[name]
    item = fx / rel
    specs = {"/".join(map(str, p)): s for p, s in oml.read_specs(item).items()}
    rngs = _rng_paths(specs, prefix, suffix)
    assert len(rngs) == 12
    assert {m: specs[p].shape for m, p in rngs.items()} == RNGS
    for model_path, stored in rngs.items():
        spec = specs[stored]
        assert spec.dtype == np.uint32
        # The only marker of a typed key on disk: Orbax's random_key_impl ext-metadata.
        assert spec.key_impl == ("unsafe_rbg" if model_path.endswith("/key") else None)

    # A stock restore with no target gives typed unsafe_rbg keys, one (4,) key per layer.
    restored = _restore(item)
    for model_path, stored in rngs.items():
        x = restored[stored]
        batch = RNG_GROUPS[model_path.rsplit("/", 2)[0]]
        if model_path.endswith("/key"):
            assert jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            assert str(jax.random.key_impl(x)) == "unsafe_rbg"
            assert x.shape == batch
            assert jax.random.key_data(x).shape == (*batch, 4)
        else:
            assert x.dtype == np.uint32 and x.shape == batch


# -- the Tunix-layout steps --------------------------------------------------------------------------
def test_tunix_steps_are_found_where_tunix_writes_them(fx):
    assert oml.detect_layout(fx / SFT_STEP) is oml.Layout.TUNIX
    assert oml.detect_layout(fx / RL_STEP) is oml.Layout.TUNIX
    assert [(s.step, s.layout, s.role) for s in oml.find_steps(fx / "sft_run/checkpoints")] == [
        (UPDATES, oml.Layout.TUNIX, None)
    ]
    assert [(s.step, s.layout, s.role) for s in oml.find_steps(fx / "rl_run/checkpoints")] == [
        (UPDATES, oml.Layout.TUNIX, "actor")
    ]
    assert _step_metadata(fx / SFT_STEP)["custom_metadata"] == {}
    assert _step_metadata(fx / RL_STEP)["custom_metadata"] == {"global_step": 2, "role": "actor"}
    for rel in TUNIX_STEPS.values():
        step = fx / rel
        assert sorted(p.name for p in step.iterdir() if p.is_dir()) == [
            "model_params",
            "optimizer_state",
        ]
        assert sorted(_step_metadata(step)["item_handlers"]) == ["model_params", "optimizer_state"]


@pytest.mark.parametrize("name", sorted(TUNIX_STEPS))
def test_tunix_model_params_hold_the_pretraining_model(name, fx):
    prefix = "base/" if name == "rl" else ""
    flat = _metadata(fx / TUNIX_STEPS[name] / "model_params")
    assert len(flat) == 24
    assert all(p.startswith(prefix) and p.endswith("/value") for p in flat)
    weights = {
        p.removeprefix(prefix).removesuffix("/value"): m.shape
        for p, m in flat.items()
        if "/rngs/" not in p
    }
    assert weights == WEIGHTS


def test_sft_optimizer_state_tree(fx):
    flat = _metadata(fx / SFT_STEP / "optimizer_state")
    assert len(flat) == 27
    # chain(clip_by_global_norm, chain(adam, decay, schedule)): clip's EmptyState is omitted.
    assert sorted({p for p in flat if "/mu/" not in p and "/nu/" not in p}) == [
        "opt_state/1/0/count/value",
        "opt_state/1/2/count/value",
        "step/value",
    ]
    values = _restore(fx / SFT_STEP / "optimizer_state")
    assert {p: int(v) for p, v in values.items() if np.ndim(v) == 0} == {
        "opt_state/1/0/count/value": UPDATES,
        "opt_state/1/2/count/value": UPDATES,
        "step/value": UPDATES,
    }
    assert values["step/value"].dtype == np.uint32


def test_rl_optimizer_state_tree(fx):
    flat = _metadata(fx / RL_STEP / "optimizer_state")
    assert len(flat) == 29
    # inject_hyperparams(chain(clip_by_global_norm, adamw))(learning_rate=schedule).
    assert sorted({p for p in flat if "/mu/" not in p and "/nu/" not in p}) == [
        "opt_state/count/value",
        "opt_state/hyperparams/learning_rate/value",
        "opt_state/hyperparams_states/learning_rate/count/value",
        "opt_state/inner_state/1/0/count/value",
        "step/value",
    ]
    assert all(
        p.startswith(("opt_state/inner_state/1/0/mu/base/", "opt_state/inner_state/1/0/nu/base/"))
        for p in flat
        if "/mu/" in p or "/nu/" in p
    )
    values = _restore(fx / RL_STEP / "optimizer_state")
    assert int(values["opt_state/inner_state/1/0/count/value"]) == UPDATES
    assert int(values["opt_state/hyperparams_states/learning_rate/count/value"]) == UPDATES
    assert int(values["step/value"]) == UPDATES


# -- conversion onto the pre-training run's own target --------------------------------------------
def _expected_items(step: Path, name: str) -> dict[str, np.ndarray]:
    """What the converted items must hold, read from the Tunix source with stock Orbax."""
    base = "base/" if name == "rl" else ""
    params = _restore(step / "model_params")
    opt = _restore(step / "optimizer_state")
    out = {}
    for p, x in params.items():
        model = p.removeprefix(base).removesuffix("/value")
        dest = "nnx_aux/model/" if "/rngs/" in model else "params/params/"
        out[dest + model] = x
    adam = "opt_state/inner_state/1/0/" if name == "rl" else "opt_state/1/0/"
    for p, x in opt.items():
        if not p.startswith(adam):
            continue
        rest = p.removeprefix(adam).removesuffix("/value")
        if rest == "count":
            out["opt_state/0/count"] = x
        else:
            moment, model = rest.split("/", 1)
            out[f"opt_state/0/{moment}/params/{model.removeprefix(base)}"] = x
    if name == "sft":  # the schedule's own count
        out["opt_state/2/count"] = opt["opt_state/1/2/count/value"]
    else:  # RL's schedule lives in the inject shell; its count is the Adam count
        out["opt_state/2/count"] = opt[adam + "count/value"]
    out["step"] = opt["step/value"]
    return out


@pytest.mark.parametrize("name", sorted(TUNIX_STEPS))
def test_tunix_step_converts_onto_the_pretraining_target(name, fx):
    pretrain_items = fx / PRETRAIN / "1" / "items"
    step = fx / TUNIX_STEPS[name]
    target = oml.Target.from_checkpoint(fx / PRETRAIN / "1")
    assert (len(target.params), len(target.nnx_aux), len(target.opt_state)) == (12, 12, 26)

    oml.convert_step(step, target)

    # Stored metadata: exactly what MaxText's own loop wrote (shapes, dtypes, key impls).
    assert oml.read_specs(step / "items") == oml.read_specs(pretrain_items)
    assert oml.Target.from_checkpoint(step).params == target.params
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(step / "items")).tree
    assert isinstance(tree["opt_state"], list) and tree["opt_state"][1] is None

    # Values: bit for bit the Tunix source (weights, RNG counts and keys, moments, counts).
    got = _restore(step / "items")
    want = _expected_items(step, name)
    assert sorted(got) == sorted(want) == sorted(_metadata(pretrain_items))
    for p, x in got.items():
        if p == "step":  # uint32 in Tunix, int32 in MaxText
            assert x.dtype == np.int32 and int(x) == int(want[p]) == UPDATES
            continue
        assert x.dtype == want[p].dtype, p
        assert _raw(x).tobytes() == _raw(want[p]).tobytes(), p
        if "/rngs/" in p and p.endswith("/key"):
            assert str(jax.random.key_impl(x)) == "unsafe_rbg", p
