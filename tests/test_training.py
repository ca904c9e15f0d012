"""training.Checkpointer (Orbax v1) on real checkpoints (no mocks): listing, loads, saves,
migration, MaxText-layout steps, two processes, and the Orbax private names it relies on.

The fixtures are MaxText 0.2.5's own tiny model (tests/fixtures/maxtext025): a pre-training
run written by MaxText's loop through v1, a Tunix SFT step and a Tunix RL actor step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp0
import pytest
from conftest import FIXTURES, copy_fixture, recorded_shardings_resolve, tree_digest
from etils import epath
from orbax.checkpoint import v1 as ocp

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.base.treepaths import flatten, keystr, norm_key
from orbax_maxtext_layout.integration.manager import TUNIX_STEP_KEY, CheckpointManager
from orbax_maxtext_layout.training import Checkpointer

PRETRAIN = "maxtext025/pretrain_run/checkpoints"  # MaxText layout: 0 and 1 (items/step 1, 2)
SFT = "maxtext025/sft_run/checkpoints/2"  # Tunix directory 2 = MaxText step 1
RL = "maxtext025/rl_run/checkpoints/actor/2"
LOGGER = "orbax_maxtext_layout.integration.manager"

# The v1 `delete` API exists from orbax-checkpoint 0.12.8 (the oldest declared is older).
HAS_DELETE = hasattr(ocp.training.Checkpointer, "delete")


# -- helpers ------------------------------------------------------------------------------
def _one_device() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _abstract() -> dict:
    """MaxText's abstract items tree for the model, each leaf on one device."""
    items = oml.Target.from_checkpoint(FIXTURES / PRETRAIN / "1").items()
    dev = _one_device()
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), items)


def _context(partial_load: bool = True) -> ocp.Context:
    """The context maxtext 0.2.5's create_orbax_checkpoint_manager builds (build_context)."""
    ctx = ocp.Context()
    ctx.array.saving.use_ocdbt = True
    ctx.array.saving.use_zarr3 = True
    ctx.memory.write_concurrent_bytes = ctx.memory.read_concurrent_bytes = 96 * 10**9
    ctx.pathways.checkpointing_impl = ocp0.pathways.CheckpointingImpl.NO_DISPATCHER
    if partial_load:
        ctx.pytree.loading.partial_load = True
    return ctx


def _maxtext_kwargs(**kw: Any) -> dict:
    """create_orbax_checkpoint_manager's constructor arguments (checkpoint_period=1)."""
    policies = ocp.training.save_decision_policies
    return {
        "context": _context(),
        "save_decision_policy": policies.FixedIntervalPolicy(interval=1),
        "preservation_policy": ocp.training.preservation_policies.LatestN(10),
        **kw,
    }


def _ours(root: Path, **kw: Any) -> Checkpointer:
    return Checkpointer(root, **_maxtext_kwargs(**kw))


def _stock(root: Path) -> ocp.training.Checkpointer:
    return ocp.training.Checkpointer(root, **_maxtext_kwargs())


def _flat(tree: Any) -> dict:
    leaves = flatten(tree, is_leaf=lambda x: hasattr(x, "dtype"))
    return {tuple(norm_key(k) for k in p): v for p, v in leaves.items()}


def _raw(x: Any) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _assert_bit_identical(got: Any, want: Any, sharding: Any = None) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    g, w = _flat(got), _flat(want)
    assert set(g) == set(w), sorted(map(keystr, set(g) ^ set(w)))
    for p, v in w.items():
        assert g[p].dtype == v.dtype, p  # typed keys stay typed, step stays int32
        assert _raw(g[p]).tobytes() == _raw(v).tobytes(), p
        if sharding is not None:
            assert g[p].sharding == sharding, p


def _train(items: dict) -> dict:
    """One fake optimizer update: every float leaf changes, ``step`` advances."""
    out = jax.tree.map(lambda x: x + 1 if jax.numpy.issubdtype(x.dtype, np.floating) else x, items)
    return {**out, "step": items["step"] + 1}


def _converted_copy(rel: str, dest: Path) -> Path:
    """The step converted with `convert_step` (kept at its Tunix number), and its root."""
    step = copy_fixture(rel, dest)
    oml.convert_step(step, oml.Target.from_checkpoint(FIXTURES / PRETRAIN / "1"))
    return step


# -- listing ------------------------------------------------------------------------------
def test_lists_tunix_steps_under_their_maxtext_number(tmp_path):
    step = copy_fixture(SFT, tmp_path)
    root = step.parent
    with _stock(root) as stock:
        assert [c.step for c in stock.checkpoints] == [2]  # stock lists the directory name
    shutil.copytree(step, root / "0")  # Tunix directory 0 (no update yet): not listed
    with _ours(root, custom_metadata={"run": "resumed"}) as ckptr:
        assert ckptr.root_metadata().custom_metadata == {"run": "resumed"}
        assert [c.step for c in ckptr.checkpoints] == [1]
        assert ckptr.latest.step == 1 and ckptr.latest.path == root / "2"
        assert not ckptr.should_save(1)
        assert ckptr.should_save(2)
        meta = ckptr.checkpointables_metadata(1)  # reads Tunix directory 2
        assert set(meta.metadata) == {"model_params", "optimizer_state"}
        assert meta.step == 1
        if not HAS_DELETE:
            return
        ckptr.delete(1)
        assert ckptr.checkpoints == [] and ckptr.latest is None
    assert sorted(os.listdir(root)) == ["0", "metadata"]  # Tunix 0 kept; root metadata


# -- loading ------------------------------------------------------------------------------
@pytest.mark.parametrize("rel", [SFT, RL], ids=["sft", "rl"])
def test_load_equals_convert_step_then_stock_v1_load_bit_for_bit(tmp_path, rel):
    a = copy_fixture(rel, tmp_path / "a")
    b = _converted_copy(rel, tmp_path / "b")
    before = tree_digest(a)
    abstract = _abstract()

    with _ours(a.parent) as ckptr:
        got = ckptr.load_checkpointables(ckptr.latest, {"items": abstract})
        assert list(got) == ["items"]
        again = ckptr.load(1, abstract, checkpointable_name="items")
        with pytest.raises(KeyError, match="checkpointable_name='items'"):
            ckptr.load(1, abstract)  # v1's default name "state": absent, as in MaxText steps
    assert tree_digest(a) == before  # a load writes nothing

    with _stock(b.parent) as stock:
        want = stock.load_checkpointables(2, {"items": abstract})["items"]
    _assert_bit_identical(got["items"], want, sharding=_one_device())
    _assert_bit_identical(again, want, sharding=_one_device())
    assert int(got["items"]["step"]) == 2  # MaxText step 1 holds the state after update 2
    assert got["items"]["step"].dtype == np.int32
    key = got["items"]["nnx_aux"]["model"]["decoder"]["rngs"]["params"]["key"]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


def test_params_only_request_under_partial_load_returns_just_the_params(tmp_path):
    step = copy_fixture(RL, tmp_path)
    b = _converted_copy(RL, tmp_path / "b")
    params = {"params": _abstract()["params"]}
    with _ours(step.parent) as ckptr:
        got = ckptr.load_checkpointables(1, {"items": params})["items"]
        assert not ckptr._manager.legacy_steps.pending  # a partial load is not migrated
        some_aux = {
            "model": {"decoder": {"rngs": _abstract()["nnx_aux"]["model"]["decoder"]["rngs"]}}
        }
        part = ckptr.load_checkpointables(1, {"items": {**params, "nnx_aux": some_aux}})["items"]
        assert set(_flat(part["nnx_aux"])) == set(_flat(some_aux))
        assert not ckptr._manager.legacy_steps.pending  # names nnx_aux, but not all of it
        with pytest.warns(DeprecationWarning):
            pytree = ckptr.load_pytree(1, params, checkpointable_name="items")
    with _stock(b.parent) as stock:
        want = stock.load_checkpointables(2, {"items": params})["items"]
    assert list(got) == ["params"]
    _assert_bit_identical(got, want, sharding=_one_device())
    _assert_bit_identical(pytree, want, sharding=_one_device())


def test_other_checkpointables_load_the_stock_way_or_come_back_none(tmp_path, caplog):
    step = copy_fixture(SFT, tmp_path)
    abstract = _abstract()
    with caplog.at_level(logging.WARNING, "orbax_maxtext_layout"), _ours(step.parent) as ckptr:
        got = ckptr.load_checkpointables(1, {"items": abstract, "iter": None})
        assert got["iter"] is None and "has no 'iter' checkpointable" in caplog.text
        assert int(got["items"]["step"]) == 2
        # No abstract tree: as stored, with a warning, each leaf placed where the step's
        # _sharding says (as stock v1 places it), so only where those devices exist.
        if all(recorded_shardings_resolve(step / n) for n in ("model_params", "optimizer_state")):
            stored = ckptr.load_checkpointables(1)
            assert set(stored) == {"model_params", "optimizer_state"}
            assert "cannot be split into MaxText items" in caplog.text

    elsewhere = epath.Path(tmp_path / "elsewhere")
    ocp.save_checkpointables(elsewhere, {"iter": {"position": 7}})  # a v1-written iterator
    (elsewhere / "iter").rename(step / "iter")
    with _ours(step.parent) as ckptr:
        got = ckptr.load_checkpointables(1, {"items": abstract, "iter": None})
        assert got["iter"] == {"position": 7}
        assert int(got["items"]["step"]) == 2


# -- saving, step numbering and lazy migration --------------------------------------------
@pytest.mark.parametrize(
    "use_async, remove_legacy", [(False, False), (True, True)], ids=["sync", "async-remove"]
)
def test_save_after_load_moves_the_legacy_step_then_migrates_it(
    tmp_path, caplog, use_async, remove_legacy
):
    step = copy_fixture(SFT, tmp_path)
    root = step.parent
    meta_before = json.loads((step / "_CHECKPOINT_METADATA").read_text())
    abstract = _abstract()
    caplog.set_level(logging.INFO, LOGGER)

    # MaxText's loop: load the latest step, train, save at the restored step number.
    with _ours(root, remove_legacy=remove_legacy) as ckptr:
        ckptr.use_async = use_async  # what create_orbax_checkpoint_manager sets
        restored = ckptr.load_checkpointables(ckptr.latest.step, {"items": abstract})["items"]
        start = int(restored["step"])
        assert start == 2
        state = _train(restored)
        checkpointables = {"items": state}
        if use_async:  # maxtext's save_checkpoint, use_async branch
            response = ckptr.save_checkpointables_async(
                start, checkpointables, custom_metadata={"scan_layers": True}
            )
            assert response is not None
            response.result()
        else:
            assert ckptr.save_checkpointables(
                start, checkpointables, custom_metadata={"scan_layers": True}
            )
        ckptr.wait()
        assert [c.step for c in ckptr.checkpoints] == [1, 2]  # no save skipped, none deleted
        assert ckptr.checkpoints[0].path == root / "1"

    moved = root / "1"
    assert sorted(os.listdir(root)) == ["1", "2"]
    assert oml.detect_layout(moved) is oml.Layout.MAXTEXT
    files = oml.converted_provenance(moved)["data_files"]  # the migration shares the files
    assert files["mode"] == "share" and files["copy"]["files"] == 0, files
    assert files["hardlink"]["files"] + files["reflink"]["files"] > 0, files
    meta = json.loads((moved / "_CHECKPOINT_METADATA").read_text())
    if remove_legacy:  # removed only after verifying; the step metadata follows the disk
        assert not (moved / "model_params").exists()
        assert not (moved / "optimizer_state").exists()
    else:
        assert oml.verify_step(moved).ok
    assert meta["custom_metadata"][TUNIX_STEP_KEY] == 2
    for k, v in meta_before["custom_metadata"].items():
        assert meta["custom_metadata"][k] == v

    done = [r for r in caplog.records if r.getMessage().startswith("Migrated legacy step 1")]
    assert len(done) == 1
    # v1 saves run through v0's async path: the migration runs in Orbax's save-finalize
    # thread, never in the training (main) thread.
    assert done[0].threadName == "save_finalize"

    with _stock(root) as stock:  # stock v1 reads both steps
        assert [c.step for c in stock.checkpoints] == [1, 2]
        got1 = stock.load_checkpointables(1, {"items": abstract})["items"]
        got2 = stock.load_checkpointables(2, {"items": abstract})["items"]
    _assert_bit_identical(got1, restored, sharding=_one_device())
    _assert_bit_identical(got2, state, sharding=_one_device())
    # And a stock v0 manager restores the migrated step's items too.
    restore_args = jax.tree.map(lambda s: ocp0.ArrayRestoreArgs(sharding=s.sharding), abstract)
    args = ocp0.args.Composite(
        items=ocp0.args.PyTreeRestore(item=abstract, restore_args=restore_args)
    )
    with ocp0.CheckpointManager(root, item_names=("items",)) as v0:
        assert v0.all_steps() == [1, 2]
        _assert_bit_identical(v0.restore(1, args=args)["items"], restored)


def test_migrate_off_moves_but_never_rewrites(tmp_path):
    root = copy_fixture(RL, tmp_path).parent
    abstract = _abstract()
    with _ours(root, migrate="off") as ckptr:
        restored = ckptr.load_checkpointables(1, {"items": abstract})["items"]
        assert ckptr.save_checkpointables(2, {"items": _train(restored)})
    assert oml.detect_layout(root / "1") is oml.Layout.TUNIX
    with _ours(root) as ckptr:
        assert [c.step for c in ckptr.checkpoints] == [1, 2]
        _assert_bit_identical(ckptr.load_checkpointables(1, {"items": abstract})["items"], restored)


# -- MaxText-layout steps are stock ----------------------------------------------------------
def test_maxtext_layout_steps_behave_as_with_the_stock_checkpointer(tmp_path, caplog):
    a = tmp_path / "a"
    b = tmp_path / "b"
    for d in (a, b):
        shutil.copytree(FIXTURES / PRETRAIN, d)
    abstract = _abstract()
    with _ours(a) as ours, _stock(b) as stock:
        assert [(c.step, c.path.name) for c in ours.checkpoints] == [
            (c.step, c.path.name) for c in stock.checkpoints
        ]
        assert ours.should_save(2) == stock.should_save(2)
        for s in (0, 1):
            caplog.clear()
            with caplog.at_level(logging.DEBUG, "orbax_maxtext_layout.execute.restore"):
                got = ours.load_checkpointables(s, {"items": abstract})["items"]
            # the arrays through the restore engine, keys and scalars the stock (v1) way
            assert re.search(r": [1-9]\d* arrays .* read by the restore engine, [1-9]", caplog.text)
            want = stock.load_checkpointables(s, {"items": abstract})["items"]
            _assert_bit_identical(got, want, sharding=_one_device())
            assert int(got["step"]) == s + 1
        assert ours.checkpointables_metadata(1).metadata.keys() == {"items"}
        for c in (ours, stock):
            assert c.save_checkpointables(2, {"items": _train(got)})
            if HAS_DELETE:
                c.delete(0)
                assert [x.step for x in c.checkpoints] == [1, 2]
    left = ["1", "2"] if HAS_DELETE else ["0", "1", "2"]
    assert sorted(os.listdir(a)) == sorted(os.listdir(b)) == left
    assert not ours._manager.legacy_steps.pending


# -- two processes ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.needs_sockets("the processes' jax.distributed")
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: the slow pass
def test_processes_load_sharded_save_migrate_and_load_the_migrated_step(tmp_path, n):
    step = copy_fixture(RL, tmp_path)
    child = Path(__file__).parent / "training_child.py"
    port, outs = _free_port(), [tmp_path / f"p{i}.json" for i in range(n)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    pretrain = str(FIXTURES / PRETRAIN / "1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(child), str(i), str(port), str(step.parent), pretrain, str(o)]
            + [str(n)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i, o in enumerate(outs)
    ]
    try:
        logs = [p.communicate(timeout=180)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)

    # What one process restores, as full host arrays (same keys as the child's keystr).
    want = oml.restore_as_items(step.parent / "1", oml.Target.from_checkpoint(pretrain))
    got = [json.loads(o.read_text()) for o in outs]
    for path, v in jax.tree_util.tree_leaves_with_path(want):
        full, name = _raw(v), jax.tree_util.keystr(path)
        seen = set()
        for proc in got:
            for index, data in proc[name]:
                sl = tuple(slice(a, b) for a, b in index)
                assert np.array_equal(np.asarray(data, full.dtype), full[sl]), (name, index)
                seen.add(str(index))
        sharded = len(v.shape) > 0 and v.shape[0] % n == 0
        assert len(seen) == (n if sharded else 1), name  # each process read only its part
    assert sum(len(p) for p in got) == n * len(jax.tree.leaves(want))

    # The legacy step moved out of the save's way and the primary migrated it.
    assert oml.detect_layout(step.parent / "1") is oml.Layout.MAXTEXT
    assert oml.verify_step(step.parent / "1").ok
    abstract = _abstract()
    with _stock(step.parent) as stock:
        assert [c.step for c in stock.checkpoints] == [1, 2]
        one = stock.load_checkpointables(1, {"items": abstract})["items"]
        two = stock.load_checkpointables(2, {"items": abstract})["items"]
    _assert_bit_identical(one, two)  # the 2-process save wrote back what it loaded


# -- the Orbax private names training.Checkpointer relies on -----------------------------
def test_orbax_private_names_it_relies_on(tmp_path):
    from orbax.checkpoint.experimental.v1._src.context import context as context_lib

    root = copy_fixture(SFT, tmp_path).parent
    kwargs = _maxtext_kwargs(cleanup_tmp_directories=True)
    with ocp.training.Checkpointer(root, **kwargs) as stock:
        # v1 keeps a v0 manager in `_manager`; it lists, saves and deletes through it.
        assert type(stock._manager) is ocp0.CheckpointManager
        stock_options = stock._manager._options  # the options v1 derives from its arguments
        assert isinstance(stock_options, ocp0.CheckpointManagerOptions)
        assert stock_options.cleanup_tmp_directories is True
        # v1's own loads run in `context_lib.get_context(self._context)`.
        assert isinstance(stock._context, ocp.Context)
        assert context_lib.get_context(stock._context) is stock._context
        assert stock._context.pytree_options.loading.partial_load is True
        # A MaxText step's items load as v1 loads them: its PyTree handler's v0 handler
        # with its v0 restore args (`Checkpointer._load_native`).
        from orbax.checkpoint.experimental.v1._src.handlers import pytree_handler

        handler = pytree_handler.PyTreeHandler(context=stock._context)
        assert isinstance(handler._handler_impl, ocp0.PyTreeCheckpointHandler.__mro__[1])
        args = pytree_handler.create_v0_restore_args(stock._context, _abstract())
        assert args.partial_restore is True and args.item is not None
        # v1 builds every step path with `_step_name_format.build_name`.
        assert stock._step_name_format.build_name(2) == "2"
    with Checkpointer(root, **kwargs) as ours:
        assert type(ours._manager) is CheckpointManager
        # Built with exactly the options the stock constructor builds.
        assert dataclasses.asdict(ours._manager._options) == dataclasses.asdict(stock_options)
        # `checkpoints` reads the inner manager's `_checkpoints`: our listing, which has
        # the legacy step under its MaxText number (stock shows 2).
        assert [i.step for i in ours._manager._checkpoints] == [1]
        assert [c.step for c in ours.checkpoints] == list(ours._manager.all_steps()) == [1]
        assert ours._step_name_format.build_name(1) == "2"
        assert ours._step_name_format.build_name(5) == "5"
        # It sets the attributes the stock constructor sets, and no other.
        assert set(vars(ours)) == set(vars(stock))


def _v0_managers_built(build) -> int:
    """How many v0 managers ``build()`` constructs: calls of the stock v0 constructor's code
    (every v0 manager, ours included, runs it once), seen by the interpreter's profiler."""
    code = ocp0.CheckpointManager.__init__.__code__
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            calls.append(1)

    sys.setprofile(profile)
    try:
        built = build()
    finally:
        sys.setprofile(None)
    built.close()
    return len(calls)


def test_a_v1_construction_builds_one_v0_manager_ours(tmp_path):
    # Before: the stock v1 constructor built a stock v0 manager (listing the directory), ours
    # read its private options, closed it and built a second one.
    root = copy_fixture(SFT, tmp_path).parent
    kwargs = _maxtext_kwargs()
    assert _v0_managers_built(lambda: ocp.training.Checkpointer(root, **kwargs)) == 1
    assert _v0_managers_built(lambda: Checkpointer(root, **kwargs)) == 1
    with Checkpointer(root, **kwargs) as ours:
        assert type(ours._manager) is CheckpointManager


@pytest.mark.parametrize(
    "case",
    ["defaults", "maxtext", "policies", "lightweight", "synchronous"],
)
def test_the_v0_options_are_derived_as_the_stock_constructor_derives_them(tmp_path, case):
    policies = ocp.training.save_decision_policies
    kwargs = {
        "defaults": {},
        "maxtext": _maxtext_kwargs(cleanup_tmp_directories=True),
        "policies": {
            "save_decision_policy": policies.FixedIntervalPolicy(3),
            "preservation_policy": ocp.training.preservation_policies.LatestN(2),
            "step_name_format": ocp0.path.step.standard_name_format(step_prefix="s"),
        },
        "lightweight": {"lightweight_initialize": True},
        "synchronous": {
            "context": ocp.Context(async_options=ocp.options.AsyncOptions(timeout_secs=7))
        },
    }[case]
    root = tmp_path / "run"
    root.mkdir()
    with ocp.training.Checkpointer(root, **kwargs) as stock:
        want = _comparable(dataclasses.asdict(stock._manager._options))
    with Checkpointer(root, **kwargs) as ours:
        assert _comparable(dataclasses.asdict(ours._manager._options)) == want


def _comparable(x: Any) -> Any:
    """``x`` with each object that has no equality of its own (a save-decision policy built
    fresh by each constructor) as its class and attributes."""
    if isinstance(x, dict):
        return {k: _comparable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_comparable(v) for v in x]
    if hasattr(x, "__dict__") and type(x).__eq__ is object.__eq__:
        return (type(x).__qualname__, _comparable(vars(x)))
    return x
