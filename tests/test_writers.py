"""Checks that ``tests/writers.py`` writes what DOMAIN.md describes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import writers
from conftest import stock_restore
from etils import epath
from flax import nnx

L = 3


def _tree_paths(tree: Any) -> dict[str, Any]:
    """``{"a/b/c": leaf}`` for a metadata or restored tree."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for key_path, leaf in flat:
        parts = [str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path]
        out["/".join(parts)] = leaf
    return out


def _metadata(item_dir: epath.Path) -> dict[str, Any]:
    return _tree_paths(ocp.PyTreeCheckpointHandler().metadata(item_dir).tree)


def _shapes(item_dir: epath.Path) -> dict[str, tuple[tuple[int, ...], str]]:
    return {p: (tuple(m.shape), str(np.dtype(m.dtype))) for p, m in _metadata(item_dir).items()}


def _key_impls(item_dir: epath.Path) -> dict[str, str | None]:
    """``param_name -> ext_metadata.random_key_impl`` from ``array_metadatas/process_0``."""
    data = json.loads((item_dir / "array_metadatas" / "process_0").read_text())
    out = {}
    for entry in data["array_metadatas"]:
        meta = entry["array_metadata"]
        out[meta["param_name"]] = (meta.get("ext_metadata") or {}).get("random_key_impl")
    return out


def _step_custom_metadata(step_dir: epath.Path) -> Any:
    return json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]


@pytest.fixture(scope="module")
def rl_step(tmp_path_factory: pytest.TempPathFactory) -> epath.Path:
    """A scanned adapter RL actor step after 2 updates."""
    model = writers.make_model(scanned=True, adapter=True)
    optimizer = writers.make_optimizer(model, "rl")
    writers.train_steps(model, optimizer, 2)
    root = epath.Path(tmp_path_factory.mktemp("rl")) / "checkpoints"
    return writers.write_tunix_step(
        root, 2, model, optimizer, role="actor", custom_metadata={"global_step": 3, "role": "actor"}
    )


@pytest.fixture(scope="module")
def sft_step(tmp_path_factory: pytest.TempPathFactory) -> epath.Path:
    """An unscanned bare SFT step after 1 update."""
    model = writers.make_model(scanned=False)
    optimizer = writers.make_optimizer(model, "sft")
    writers.train_steps(model, optimizer, 1)
    root = epath.Path(tmp_path_factory.mktemp("sft")) / "checkpoints"
    return writers.write_tunix_step(root, 1, model, optimizer, custom_metadata={})


def test_rl_step_layout(rl_step: epath.Path) -> None:
    assert rl_step.parent.name == "actor" and rl_step.name == "2"
    assert {p.name for p in rl_step.iterdir()} >= {"model_params", "optimizer_state"}
    assert _step_custom_metadata(rl_step) == {"global_step": 3, "role": "actor"}

    params = _shapes(rl_step / "model_params")
    assert all(p.startswith("base/") and p.endswith("/value") for p in params)
    layers = "base/decoder/layers"
    assert params[f"{layers}/mlp/wi/kernel/value"] == ((8, L, 16), "float32")
    assert params[f"{layers}/mlp/wo/kernel/value"] == ((16, L, 8), "float32")
    assert params[f"{layers}/pre_self_attention_layer_norm/scale/value"] == ((8, L), "float32")
    assert params[f"{layers}/dropout/rngs/dropout/count/value"] == ((L,), "uint32")
    assert params[f"{layers}/dropout/rngs/dropout/key/value"] == ((L, 2), "uint32")
    assert params[f"{layers}/routing_table/value"] == ((L, 4, 2), "int32")
    assert params["base/decoder/rngs/params/key/value"] == ((2,), "uint32")
    assert len(params) == 13

    opt = _shapes(rl_step / "optimizer_state")
    assert all(p.endswith("/value") for p in opt)
    assert opt["step/value"] == ((), "uint32")
    for path in (
        "opt_state/count/value",
        "opt_state/hyperparams_states/learning_rate/count/value",
        "opt_state/inner_state/1/0/count/value",
    ):
        assert opt[path] == ((), "int32")
    assert opt["opt_state/hyperparams/learning_rate/value"] == ((), "float32")
    mu = f"opt_state/inner_state/1/0/mu/{layers}/mlp/wi/kernel/value"
    assert opt[mu] == ((8, L, 16), "float32")
    assert len(opt) == 17

    restored = stock_restore(rl_step / "optimizer_state")
    assert int(restored["step"]["value"]) == 2
    adam = restored["opt_state"]["inner_state"]["1"]["0"]
    assert int(adam["count"]["value"]) == 2
    assert float(np.abs(adam["mu"]["base"]["decoder"]["logits_dense"]["kernel"]["value"]).sum()) > 0


def test_typed_keys_keep_random_key_impl(rl_step: epath.Path) -> None:
    impls = _key_impls(rl_step / "model_params")
    keys = {name: impl for name, impl in impls.items() if name.endswith(".key.value")}
    assert len(keys) == 3
    assert set(keys.values()) == {"threefry2x32"}
    assert impls["base.decoder.layers.dropout.rngs.dropout.count.value"] is None

    restored = stock_restore(rl_step / "model_params")
    key = restored["base"]["decoder"]["layers"]["dropout"]["rngs"]["dropout"]["key"]["value"]
    assert jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == (L,)
    count = restored["base"]["decoder"]["layers"]["dropout"]["rngs"]["dropout"]["count"]["value"]
    np.testing.assert_array_equal(count, np.arange(L))


def test_sft_step_layout(sft_step: epath.Path) -> None:
    assert sft_step.name == "1" and sft_step.parent.name == "checkpoints"
    assert _step_custom_metadata(sft_step) == {}

    params = _shapes(sft_step / "model_params")
    assert all(p.endswith("/value") and not p.startswith("base/") for p in params)
    assert "decoder/layers/mlp/wi/kernel/value" not in params
    for i in range(L):
        assert params[f"decoder/layers_{i}/mlp/wi/kernel/value"] == ((8, 16), "float32")
        assert params[f"decoder/layers_{i}/dropout/rngs/dropout/count/value"] == ((), "uint32")
        assert params[f"decoder/layers_{i}/dropout/rngs/dropout/key/value"] == ((2,), "uint32")
        assert params[f"decoder/layers_{i}/routing_table/value"] == ((4, 2), "int32")

    opt = _shapes(sft_step / "optimizer_state")
    assert "opt_state/1/0/count/value" in opt
    assert "opt_state/1/2/count/value" not in opt  # constant lr: no scale_by_schedule state
    assert opt["opt_state/1/0/nu/decoder/layers_2/mlp/wo/kernel/value"] == ((16, 8), "float32")


def test_model_only_and_intermediate(tmp_path: Path) -> None:
    model = writers.add_intermediate(writers.make_model(scanned=True))
    step = writers.write_tunix_step(tmp_path, 1, model)
    assert not (step / "optimizer_state").exists()
    params = _shapes(step / "model_params")
    assert params["decoder/max_logits/value/0"] == ((), "float32")
    assert params["decoder/layers/max_logits/value/0"] == ((L,), "float32")


def _flat_variables(model: nnx.Module) -> dict[tuple[str, ...], nnx.Variable]:
    return {tuple(map(str, path)): var for path, var in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("param_scan_axis", [1, 0])
def test_scanned_and_unscanned_hold_the_same_weights(param_scan_axis: int) -> None:
    unscanned = _flat_variables(writers.make_model(scanned=False, seed=7))
    scanned_model = writers.make_model(scanned=True, seed=7, param_scan_axis=param_scan_axis)
    scanned = _flat_variables(scanned_model)

    matched = set()
    for path, var in unscanned.items():
        if not path[1].startswith("layers_"):
            np.testing.assert_array_equal(_raw(scanned[path]), _raw(var))
            matched.add(path)
            continue
        i = int(path[1].removeprefix("layers_"))
        stacked_path = (path[0], "layers", *path[2:])
        stacked = scanned[stacked_path]
        axis = param_scan_axis if isinstance(stacked, nnx.Param) else 0
        if isinstance(stacked, nnx.Param):
            assert stacked.get_metadata("param_scan_axis") == param_scan_axis
        np.testing.assert_array_equal(np.take(_raw(stacked), i, axis=axis), _raw(var))
        matched.add(stacked_path)
    assert matched == set(scanned)


def _raw(var: nnx.Variable) -> np.ndarray:
    value = var.get_value()
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    return np.asarray(value)


def test_abstract_model_has_scan_metadata() -> None:
    model = writers.abstract_model(scanned=True, adapter=True)
    state = nnx.state(model)
    kernel = state["base"]["decoder"]["layers"]["mlp"]["wi"]["kernel"]
    assert kernel.get_metadata("param_scan_axis") == 1
    assert kernel.get_value().shape == (8, L, 16)
    routing = state["base"]["decoder"]["layers"]["routing_table"]
    assert isinstance(routing, writers.RoutingTable) and routing.get_value().shape == (L, 4, 2)


def test_maxtext_step_layout(tmp_path: Path) -> None:
    model = writers.add_intermediate(writers.make_model(scanned=True))
    optimizer = writers.make_optimizer(model, "sft_schedule")
    writers.train_steps(model, optimizer, 1)
    step = writers.write_maxtext_step(tmp_path, 2, model, optimizer)

    assert step.name == "2" and {p.name for p in step.iterdir()} >= {"items"}
    assert _step_custom_metadata(step) == {"scan_layers": True}
    items = _shapes(step / "items")
    assert not any(p.endswith("/value") or "/value/" in p for p in items)
    assert not any("max_logits" in p for p in items)
    assert items["step"] == ((), "int32")
    assert items["params/params/decoder/layers/mlp/wi/kernel"] == ((8, L, 16), "float32")
    assert items["nnx_aux/model/decoder/layers/dropout/rngs/dropout/key"] == ((L, 2), "uint32")
    assert items["nnx_aux/model/decoder/layers/routing_table"] == ((L, 4, 2), "int32")
    assert items["opt_state/1/0/mu/decoder/layers/mlp/wi/kernel"] == ((8, L, 16), "float32")
    assert items["opt_state/1/2/count"] == ((), "int32")
    assert not any(p.startswith("params/params/") and "rngs" in p for p in items)

    tree = ocp.PyTreeCheckpointHandler().metadata(step / "items").tree
    assert isinstance(tree["opt_state"], list) and tree["opt_state"][0] is None
    impls = _key_impls(step / "items")
    assert impls["nnx_aux.model.decoder.layers.dropout.rngs.dropout.key"] == "threefry2x32"


def test_opt_state_to_linen_rules() -> None:
    inner = {"count": 1, "mu": {"w": 2}, "nu": {"w": 3}}
    assert writers.opt_state_to_linen({1: {0: inner, 2: {"count": 4}}}) == [
        None,
        {0: inner, 2: {"count": 4}},
    ]
    assert writers.opt_state_to_linen({"0": inner, "2": {"count": 4}}) == [
        {"count": 1, "mu": {"params": {"w": 2}}, "nu": {"params": {"w": 3}}},
        None,
        {"count": 4},
    ]
    shell = {"count": 1, "inner_state": {1: {0: inner}}}
    assert writers.opt_state_to_linen(shell) == shell


def test_multisteps_optimizer_shell(tmp_path: Path) -> None:
    model = writers.make_model(scanned=False, num_layers=1, custom_var=False, dropout=False)
    optimizer = writers.make_optimizer(model, "multisteps")
    writers.train_steps(model, optimizer, 2)
    step = writers.write_tunix_step(tmp_path, 2, model, optimizer)
    opt = _shapes(step / "optimizer_state")
    assert {"opt_state/mini_step/value", "opt_state/gradient_step/value"} <= set(opt)
    assert "opt_state/acc_grads/decoder/layers_0/mlp/wi/kernel/value" in opt
    assert "opt_state/inner_opt_state/inner_state/1/0/count/value" in opt
