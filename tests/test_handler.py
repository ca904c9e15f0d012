"""MaxTextLayoutHandler and load_params_from_path on real Orbax checkpoints (no mocks)."""

from __future__ import annotations

import collections
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import writers
from conftest import (
    MAXTEXT_NATIVE,
    RL_ACTOR_STEPS,
    SFT_STEPS,
    copy_fixture,
    placed_restore_args,
    recorded_shardings_resolve,
    stock_restore,
)
from etils import epath
from flax import nnx

from orbax_maxtext_layout import (
    CheckpointReadError,
    LayoutMismatchError,
    Target,
    convert_step,
    paths,
)
from orbax_maxtext_layout.base.treepaths import flatten, keystr, norm_key, unflatten
from orbax_maxtext_layout.execute.restore import plan_request
from orbax_maxtext_layout.integration.handler import (
    MaxTextLayoutHandler,
    MaxTextLayoutRestore,
    MaxTextLayoutSave,
    load_params_from_path,
)

RL = RL_ACTOR_STEPS["tunix017_rl"]  # tunix017/rl_run/checkpoints/actor/2
MESH = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
SHARDING = jax.sharding.NamedSharding(MESH, jax.sharding.PartitionSpec())


# -- helpers ------------------------------------------------------------------------------
def _flat(tree: Any) -> dict:
    leaves = flatten(tree, is_leaf=lambda x: hasattr(x, "dtype"))
    return {tuple(norm_key(k) for k in p): v for p, v in leaves.items()}


def _raw(x: Any) -> bytes:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x)).tobytes()
    return np.asarray(x).tobytes()


def _assert_bit_identical(got: Any, want: Any) -> None:
    g, w = _flat(got), _flat(want)
    assert set(g) == set(w), sorted(map(keystr, set(g) ^ set(w)))
    for p, v in w.items():
        assert g[p].dtype == v.dtype, p
        assert _raw(g[p]) == _raw(v), p


def _assert_sharded(tree: Any) -> None:
    for p, x in _flat(tree).items():
        assert isinstance(x, jax.Array), p
        assert x.sharding.is_equivalent_to(SHARDING, x.ndim), (p, x.sharding)


def _sharded(tree: Any) -> Any:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=SHARDING), tree)


@pytest.fixture(scope="module")
def abstract_items() -> dict:
    """MaxText's own full restore target for the fixture model, sharded."""
    return _sharded(unflatten(Target.from_checkpoint(MAXTEXT_NATIVE).abstract))


def _converted(rel: str, dest: Path, **kwargs: Any) -> tuple[Path, dict]:
    """convert_step on a copy, then a stock restore of its items onto the default device
    (`conftest.stock_restore`): the oracle."""
    step = copy_fixture(rel, dest)
    convert_step(step, Target.from_checkpoint(MAXTEXT_NATIVE), **kwargs)
    return step, stock_restore(step / "items")


def _corrupt(item_dir: Path) -> None:
    for f in item_dir.rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage\xff" * 7)


# -- load_params_from_path ----------------------------------------------------------------
def test_load_params_from_every_path_form_is_bit_identical(tmp_path, abstract_items):
    tunix = copy_fixture(RL, tmp_path / "tunix")
    converted, want = _converted(RL, tmp_path / "conv")
    params = abstract_items["params"]  # {"params": {...}}, what items/params holds
    results = {
        "model_params": load_params_from_path(tunix / "model_params", params),
        "tunix step": load_params_from_path(tunix, params),
        "tunix step/items (absent)": load_params_from_path(tunix / "items", params),
        "maxtext items": load_params_from_path(converted / "items", params),
        "maxtext step": load_params_from_path(converted, params),
        "contents form": {"params": load_params_from_path(tunix, params["params"])},
    }
    for name, got in results.items():
        _assert_bit_identical(got, want["params"])
        _assert_sharded(got)
        assert len(_flat(got)) == 12, name


def test_wrong_size_and_missing_weights_are_all_named_in_both_layouts(tmp_path, abstract_items):
    tunix = copy_fixture(RL, tmp_path / "tunix")
    converted, _ = _converted(RL, tmp_path / "conv")
    flat = _flat(abstract_items["params"])
    bad = {}
    for p, s in flat.items():  # every weight has an emb-16 dimension: make it 32
        bad[p] = jax.ShapeDtypeStruct(tuple(32 if d == 16 else d for d in s.shape), s.dtype)
    bad[("params", "decoder", "extra_norm", "scale")] = jax.ShapeDtypeStruct((16,), np.float32)
    for path in (tunix / "model_params", tunix, converted / "items"):
        with pytest.raises(LayoutMismatchError) as e:
            load_params_from_path(path, unflatten(bad))
        problems = e.value.problems
        assert len(problems) == 13, (path, problems)
        for p in flat:
            assert sum(keystr(p[1:]) in q for q in problems) == 1, (path, p)
        assert sum("missing" in q for q in problems) == 1
        assert any("extra_norm/scale" in q for q in problems)


def test_nnx_state_target_returns_a_state_with_the_live_values(tmp_path):
    model = writers.make_model(scanned=True, adapter=True, seed=3)
    optimizer = writers.make_optimizer(model, "rl")
    step = writers.write_tunix_step(tmp_path / "ckpt", 4, model, optimizer, role="actor")
    abstract = nnx.state(writers.abstract_model(scanned=True, seed=3), nnx.Param)
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=SHARDING), abstract
    )

    got = load_params_from_path(step / "model_params", abstract)

    assert isinstance(got, nnx.State)
    live = nnx.state(model.base, nnx.Param).to_pure_dict()
    _assert_bit_identical(got.to_pure_dict(), live)
    _assert_sharded(got.to_pure_dict())
    assert isinstance(jax.tree.leaves(abstract)[0], jax.ShapeDtypeStruct)  # input untouched


# -- the handler --------------------------------------------------------------------------
@pytest.mark.parametrize("rel", [RL, RL_ACTOR_STEPS["v1_rl"]], ids=["tunix017", "v1_writer"])
def test_transparent_full_restore_equals_convert_then_stock_restore(rel, tmp_path, abstract_items):
    step = copy_fixture(rel, tmp_path / "tunix")
    _, want = _converted(rel, tmp_path / "conv")

    got = ocp.Checkpointer(MaxTextLayoutHandler()).restore(
        step, args=MaxTextLayoutRestore(item=abstract_items)
    )

    assert sorted(got) == ["nnx_aux", "opt_state", "params", "step"]
    _assert_bit_identical(got, want)  # params, nnx_aux, opt_state and step, bit for bit
    _assert_sharded(got)
    keys = [x for p, x in _flat(got).items() if p[-1] == "key"]
    assert keys and all(jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key) for k in keys)
    assert got["step"].dtype == np.int32 and int(got["step"]) == int(want["step"])
    assert not (step / "items").exists()  # nothing written


def _count_tree_calls(monkeypatch) -> list[tuple[str, Any]]:
    """Records every call of the package's own `paths.flatten`/`unflatten` (each module
    binds them by name, so each binding is wrapped) as ``(name, tree)``."""
    calls: list[tuple[str, Any]] = []
    for name in ("flatten", "unflatten"):
        original = getattr(paths, name)

        def counted(tree, *args, _name=name, _fn=original, **kwargs):
            calls.append((_name, tree))
            return _fn(tree, *args, **kwargs)

        for module in list(sys.modules.values()):
            if module.__name__.startswith("orbax_maxtext_layout"):
                if getattr(module, name, None) is original:
                    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_restore_flattens_its_request_once_and_stays_flat(tmp_path, abstract_items, monkeypatch):
    """The request is flattened once (`RestoreRequest.of`) and everything after is flat:
    the only unflattens build Orbax's partial-restore request of each item with leaves
    the restore engine leaves to Orbax (here model_params, whose RNG state is asked in
    another shape than stored; the engine reads all of optimizer_state, its scalars too),
    and the result is built in the request's structure once. (Before: 3 flattens and 4
    unflattens, 4 and 3 with restore_args.)"""
    step = copy_fixture(RL, tmp_path / "tunix")
    calls = _count_tree_calls(monkeypatch)

    got = MaxTextLayoutHandler().restore(
        epath.Path(step), args=MaxTextLayoutRestore(item=abstract_items)
    )

    assert collections.Counter(n for n, _ in calls) == {"flatten": 1, "unflatten": 1}
    assert calls[0] == ("flatten", abstract_items)
    for name, tree in calls[1:]:  # {src path: RestoreArgs} of one item, for Orbax
        assert name == "unflatten" and all(isinstance(a, ocp.RestoreArgs) for a in tree.values())
    assert len(_flat(got)) == len(_flat(abstract_items))

    calls.clear()  # restore_args are a second tree: flattened once too
    params = abstract_items["params"]
    load_params_from_path(step / "model_params", params)
    # (an unflatten only where a leaf goes the stock way: the engine reads these whole)
    assert [n for n, _ in calls if n == "flatten"] == ["flatten", "flatten"]
    assert [n for n, _ in calls if n == "unflatten"] in ([], ["unflatten"])


def test_handler_restore_takes_only_directory_and_item_positionally():
    """Orbax calls ``restore(directory, args=...)``; the legacy options are keyword-only."""
    params = inspect.signature(MaxTextLayoutHandler.restore).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["self", "directory", "item"]
    with pytest.raises(TypeError):
        MaxTextLayoutHandler().restore(epath.Path("/nonexistent"), None, None)


def test_params_only_restore_never_reads_the_optimizer(tmp_path, abstract_items):
    step = copy_fixture(RL, tmp_path / "tunix")
    _, want = _converted(RL, tmp_path / "conv")
    params_only = {"params": abstract_items["params"]}
    plan = plan_request(step, Target.from_items(params_only), optimizer="drop", partial=True)
    assert {m.item for m in plan.moves} == {"model_params"} and len(plan.moves) == 12
    _corrupt(step / "optimizer_state")

    got = ocp.Checkpointer(MaxTextLayoutHandler()).restore(
        step / "model_params", item=params_only, transforms={}
    )

    _assert_bit_identical(got, {"params": want["params"]})
    with pytest.raises(CheckpointReadError, match="optimizer_state"):  # the damage is real
        MaxTextLayoutHandler().restore(
            epath.Path(step), args=MaxTextLayoutRestore(item=abstract_items)
        )
    shutil.rmtree(step / "optimizer_state")
    got = MaxTextLayoutHandler().restore(
        epath.Path(step), args=MaxTextLayoutRestore(item=params_only)
    )
    _assert_bit_identical(got, {"params": want["params"]})


def test_unconvertible_optimizer_is_refused_then_dropped_on_request(tmp_path, abstract_items):
    step = copy_fixture(SFT_STEPS["tunix017_sft"], tmp_path / "sft")
    handler = MaxTextLayoutHandler()
    with pytest.raises(LayoutMismatchError, match="optimizer='drop'"):
        handler.restore(epath.Path(step), args=MaxTextLayoutRestore(item=abstract_items))
    _, want = _converted(SFT_STEPS["tunix017_sft"], tmp_path / "conv", optimizer="drop")

    got = handler.restore(
        epath.Path(step / "items"),  # absent: the handler resolves the Tunix step itself
        args=MaxTextLayoutRestore(item=abstract_items, optimizer="drop"),
    )

    assert sorted(got) == ["nnx_aux", "params", "step"]
    _assert_bit_identical(got, want)


def _legacy(ckptr, path, item, rargs):
    return ckptr.restore(path, item=item, transforms={}, restore_args=rargs)


def _own_args(ckptr, path, item, rargs):
    return ckptr.restore(path, args=MaxTextLayoutRestore(item=item, restore_args=rargs))


def _stock_args(ckptr, path, item, rargs):
    args = ocp.args.PyTreeRestore(item=item, restore_args=rargs, partial_restore=True)
    return ckptr.restore(path, args=args)


@pytest.mark.parametrize("call", [_legacy, _own_args, _stock_args])
@pytest.mark.parametrize("checkpointer", [ocp.Checkpointer, ocp.AsyncCheckpointer])
def test_call_patterns_and_async_checkpointer(call, checkpointer, tmp_path, abstract_items):
    step = copy_fixture(RL, tmp_path / "tunix")
    _, want = _converted(RL, tmp_path / "conv")
    # Shardings come from restore_args, as MaxText passes them; the item leaves have none.
    params = abstract_items["params"]
    bare = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), params)
    rargs = {"params": ocp.checkpoint_utils.construct_restore_args(params)}
    ckptr = checkpointer(MaxTextLayoutHandler())
    try:
        got = call(ckptr, step / "model_params", {"params": bare}, rargs)
    finally:
        ckptr.close()
    _assert_bit_identical(got, {"params": want["params"]})
    _assert_sharded(got)


def _placed(item_dir: Path, **kwargs: Any) -> ocp.args.PyTreeRestore:
    return ocp.args.PyTreeRestore(restore_args=placed_restore_args(item_dir), **kwargs)


def test_maxtext_and_other_items_restore_the_stock_way(tmp_path, abstract_items):
    # A restore without restore args places leaves where the step's _sharding says, stock's
    # and the handler's alike: those forms are compared only where its devices exist.
    native = copy_fixture("maxtext_native/run/checkpoints/2", tmp_path)
    stock = stock_restore(native / "items")
    rargs = ocp.checkpoint_utils.construct_restore_args(abstract_items)
    full = ocp.args.PyTreeRestore(item=abstract_items, restore_args=rargs)  # MaxText's call
    item_only = ocp.args.PyTreeRestore(item=abstract_items)
    with ocp.Checkpointer(MaxTextLayoutHandler()) as ckptr:
        got = {
            "full": ckptr.restore(native / "items", args=full),
            "via_step": ckptr.restore(native, args=full),
            "placed": ckptr.restore(native / "items", args=_placed(native / "items")),
        }
        if recorded_shardings_resolve(native / "items"):
            got["item only"] = ckptr.restore(native / "items", args=item_only)
            got["via_step, item only"] = ckptr.restore(native, args=item_only)
            got["bare"] = ckptr.restore(native / "items")
    for restored in got.values():
        _assert_bit_identical(restored, stock)
    params = load_params_from_path(native, abstract_items["params"])
    _assert_bit_identical(params, stock["params"])
    step = copy_fixture(RL, tmp_path / "tunix")
    for item in ("optimizer_state", "model_params"):
        stock = stock_restore(step / item)
        # optimizer_state: an ordinary PyTree item, never converted. model_params: asked for
        # in its stored NNX form, not MaxText's, so restored as stored.
        extra = {"item": stock} if item == "model_params" else {}
        calls = [_placed(step / item, **extra)]
        if recorded_shardings_resolve(step / item):
            calls.append(ocp.args.PyTreeRestore(**extra) if extra else None)
        for args in calls:
            got = MaxTextLayoutHandler().restore(epath.Path(step / item), args=args)
            _assert_bit_identical(got, stock)


def test_save_is_stock_and_typestr_is_unique(tmp_path):
    tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": {"c": np.ones(4, np.int32)}}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        ckptr.save(tmp_path / "stock", args=ocp.args.PyTreeSave(tree))
    with ocp.Checkpointer(MaxTextLayoutHandler()) as ckptr:
        ckptr.save(tmp_path / "legacy", tree)  # legacy positional form -> MaxTextLayoutSave
        ckptr.save(tmp_path / "args", args=MaxTextLayoutSave(tree))
    stock_meta = json.loads((tmp_path / "stock" / "_METADATA").read_text())
    for name in ("legacy", "args"):
        assert json.loads((tmp_path / name / "_METADATA").read_text()) == stock_meta
        restored = stock_restore(tmp_path / name)
        _assert_bit_identical(restored, tree)
    assert MaxTextLayoutHandler.typestr() != ocp.PyTreeCheckpointHandler.typestr()
    step_meta = json.loads((tmp_path / "args" / "_CHECKPOINT_METADATA").read_text())
    assert step_meta["item_handlers"] == MaxTextLayoutHandler.typestr()


def test_tunix_restore_without_item_is_refused(tmp_path):
    step = copy_fixture(RL, tmp_path)
    with pytest.raises(LayoutMismatchError, match="item="):
        MaxTextLayoutHandler().restore(epath.Path(step / "model_params"))


_MULTI_DEVICE = """
import sys, numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, sys.argv[1])
from conftest import MAXTEXT_NATIVE, copy_fixture
from pathlib import Path
from orbax_maxtext_layout import Target
from orbax_maxtext_layout.base.treepaths import flatten, unflatten
from orbax_maxtext_layout.integration.handler import load_params_from_path

assert len(jax.devices()) == 4
mesh = Mesh(np.array(jax.devices()), ("x",))
want = {}
for p, s in Target.from_checkpoint(MAXTEXT_NATIVE).abstract.items():
    if p[0] == "params":  # shard the first axis that splits four ways
        axis = next((i for i, d in enumerate(s.shape) if d % 4 == 0), None)
        spec = P(*([None] * axis + ["x"])) if axis is not None else P()
        want[p[1:]] = jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec))
step = copy_fixture(sys.argv[2], Path(sys.argv[3]))
got = flatten(load_params_from_path(step / "model_params", unflatten(want)))
host = flatten(load_params_from_path(step, unflatten(
    {p: jax.ShapeDtypeStruct(s.shape, s.dtype) for p, s in want.items()})))
split = 0
for p, s in want.items():
    x = got[p]
    assert x.sharding == s.sharding, (p, x.sharding)
    assert len(x.addressable_shards) == 4
    split += s.sharding.spec != P()
    assert np.asarray(x).tobytes() == np.asarray(host[p]).tobytes(), p
    for shard in x.addressable_shards:  # each device holds exactly its slice
        assert np.array_equal(np.asarray(shard.data), np.asarray(host[p])[shard.index]), p
assert split >= 10, split
print("OK", split)
"""


def test_restores_straight_into_multi_device_shardings(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    env["JAX_PLATFORMS"] = "cpu"
    tests_dir = str(Path(__file__).parent)
    run = subprocess.run(
        [sys.executable, "-c", _MULTI_DEVICE, tests_dir, RL, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("OK")
