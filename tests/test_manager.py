"""CheckpointManager on real Orbax checkpoints (no mocks): listing, restore, migration, processes."""

from __future__ import annotations

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
import orbax.checkpoint as ocp
import pytest
from conftest import (
    MAXTEXT_NATIVE,
    RECORDED_DEVICES_ABSENT,
    copy_fixture,
    placed_restore_args,
    recorded_shardings_resolve,
    stock_restore,
    tree_digest,
)

from orbax_maxtext_layout import (
    Layout,
    Target,
    convert_step,
    converted_provenance,
    detect_layout,
    restore_as_items,
)
from orbax_maxtext_layout.base.treepaths import flatten, keystr, norm_key, unflatten
from orbax_maxtext_layout.integration.manager import TUNIX_STEP_KEY, CheckpointManager

RL = "tunix017/rl_run/checkpoints/actor/2"  # Tunix directory 2 = MaxText step 1
LOGGER = "orbax_maxtext_layout.integration.manager"


# -- helpers ------------------------------------------------------------------------------
def _one_device(_: Any = None) -> jax.sharding.Sharding:
    # Not at import: the two-process workers must initialise jax.distributed first.
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _abstract(sharding: Any = _one_device) -> Any:
    """MaxText's restore target for the fixture model, with ``sharding(leaf)`` on each leaf."""
    flat = Target.from_checkpoint(MAXTEXT_NATIVE).abstract
    return unflatten(
        {p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding(s)) for p, s in flat.items()}
    )


def _items_args(abstract: Any, **extra: ocp.args.CheckpointArgs) -> ocp.args.Composite:
    """The args of MaxText's ``load_state_if_possible`` (``ArrayRestoreArgs(sharding=...)``)."""
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), abstract)
    items = ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args)
    return ocp.args.Composite(items=items, **extra)


def _flat(tree: Any) -> dict:
    leaves = flatten(tree, is_leaf=lambda x: hasattr(x, "dtype"))
    return {tuple(norm_key(k) for k in p): v for p, v in leaves.items()}


def _raw(x: Any) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _assert_bit_identical(got: Any, want: Any) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    g, w = _flat(got), _flat(want)
    assert set(g) == set(w), sorted(map(keystr, set(g) ^ set(w)))
    for p, v in w.items():
        assert g[p].dtype == v.dtype, p
        assert _raw(g[p]).tobytes() == _raw(v).tobytes(), p


def _train(items: dict) -> dict:
    """One fake optimizer update: every float leaf changes, ``step`` advances."""
    out = jax.tree.map(lambda x: x + 1 if jax.numpy.issubdtype(x.dtype, np.floating) else x, items)
    return {**out, "step": items["step"] + 1}


def _manager(root: Path, **kw: Any) -> CheckpointManager:
    opts = ocp.CheckpointManagerOptions(
        create=True,
        max_to_keep=kw.pop("max_to_keep", None),
        enable_async_checkpointing=kw.pop("use_async", False),
    )
    return CheckpointManager(root, item_names=kw.pop("item_names", ("items",)), options=opts, **kw)


def _two_tunix_steps(tmp_path: Path) -> Path:
    """``actor/1`` and ``actor/2``: Tunix steps 1 and 2 (MaxText steps 0 and 1)."""
    step = copy_fixture(RL, tmp_path)
    shutil.copytree(step, step.parent / "1")
    return step.parent


# -- listing and restore ------------------------------------------------------------------
def test_lists_tunix_steps_under_their_maxtext_number(tmp_path):
    root = copy_fixture(RL, tmp_path).parent
    with ocp.CheckpointManager(root, item_names=("items",)) as stock:
        assert stock.all_steps() == [2]  # the stock manager lists the directory name
    with _manager(root) as m:
        assert m.all_steps() == [1]
        assert m.latest_step() == 1
        meta = m.metadata(1)  # reads Tunix directory 2
        assert meta.custom_metadata == {"global_step": 3, "role": "actor"}
        assert set(meta.item_handlers) == {"model_params", "optimizer_state"}
        m.delete(1)
        assert m.all_steps() == []
    assert sorted(os.listdir(root)) == []


def _tunix_handlers() -> dict:
    """The items Tunix's own CheckpointManager registers (google-tunix 0.1.7)."""
    return {n: ocp.PyTreeCheckpointHandler() for n in ("model_params", "optimizer_state")}


def _placed_model_params(step: Path) -> ocp.args.Composite:
    """A Tunix caller's restore of model_params, each leaf placed on the default device
    (`conftest.placed_restore_args`), not where the step's _sharding says."""
    rargs = placed_restore_args(step / "model_params")
    return ocp.args.Composite(model_params=ocp.args.PyTreeRestore(restore_args=rargs))


def _tunix_run(tmp_path: Path) -> Path:
    """Tunix directories 1 and 2, as Tunix's own save writes them (model_params, no items)."""
    root = copy_fixture(RL, tmp_path).parent
    shutil.copytree(root / "2", root / "1")
    return root


def test_a_tunix_caller_gets_the_stock_manager_numbering_and_all(tmp_path, caplog):
    # Tunix's CheckpointManager declares model_params/optimizer_state: its steps keep their
    # numbers, nothing is converted or moved, exactly as with the stock manager.
    root = _tunix_run(tmp_path)
    before = tree_digest(root)
    args = _placed_model_params(root / "2")
    with ocp.CheckpointManager(root, item_handlers=_tunix_handlers()) as stock:
        want_steps, want_latest = stock.all_steps(), stock.latest_step()
        want = stock.restore(2, args=args)
    assert (want_steps, want_latest) == ([1, 2], 2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with CheckpointManager(root, item_handlers=_tunix_handlers()) as m:
            assert m.numbering == "as_written"
            assert (m.all_steps(), m.latest_step()) == (want_steps, want_latest)
            got = m.restore(2, args=args)
            _assert_bit_identical(got.model_params, want.model_params)
            m.save(3, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(got.model_params)))
            assert m.all_steps() == [1, 2, 3]
    assert sorted(os.listdir(root)) == ["1", "2", "3"]  # no renames, no items/
    assert tree_digest(root, exclude=("3",)) == before
    assert not caplog.records  # nothing to warn about
    # The same directory read by a MaxText consumer (declaring nothing, or `items`).
    with CheckpointManager(root) as m:
        assert m.numbering == "maxtext"
        assert m.all_steps() == [0, 1, 2]
    with CheckpointManager(root, item_names=("model_params",), numbering="maxtext") as m:
        assert m.all_steps() == [0, 1, 2]  # said explicitly


def test_a_maxtext_numbering_manager_asked_for_tunix_items_says_what_to_pass(tmp_path, caplog):
    root = _tunix_run(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER), CheckpointManager(root) as m:
        args = _placed_model_params(root / "2")  # directory 1 is a copy of it
        m.restore(1, args=args)  # Tunix directory 2, one behind for a Tunix caller
        m.restore(0, args=args)
    warned = [r.getMessage() for r in caplog.records if "as_written" in r.getMessage()]
    assert len(warned) == 1 and "one behind" in warned[0], warned
    with pytest.raises(ValueError, match="numbering"):
        CheckpointManager(root, numbering="tunix")


def test_restore_equals_convert_step_then_stock_restore_bit_for_bit(tmp_path):
    a = copy_fixture(RL, tmp_path / "a")
    b = copy_fixture(RL, tmp_path / "b")
    before = tree_digest(a)
    args = _items_args(_abstract())

    with _manager(a.parent) as m:
        got = m.restore(m.latest_step(), args=args)
    assert tree_digest(a) == before  # a restore writes nothing

    convert_step(b, Target.from_checkpoint(MAXTEXT_NATIVE))
    with ocp.CheckpointManager(b.parent, item_names=("items",)) as stock:
        want = stock.restore(2, args=args)
    assert list(got.keys()) == ["items"]
    _assert_bit_identical(got["items"], want["items"])
    assert int(got["items"]["step"]) == 2  # MaxText step 1 holds the state after update 2
    key = got["items"]["nnx_aux"]["model"]["decoder"]["rngs"]["params"]["key"]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert key.sharding == _one_device()


def test_a_maxtext_step_restores_as_with_the_stock_manager_through_the_engine(tmp_path, caplog):
    """A MaxText-layout step: the arrays through the restore engine, keys and ``step`` the
    stock way; another item beside ``items`` the stock way; the same result as stock."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        shutil.copytree(MAXTEXT_NATIVE.parent, d)
    step = int(MAXTEXT_NATIVE.name)
    args = _items_args(_abstract())
    with _manager(a) as m, caplog.at_level(logging.DEBUG, "orbax_maxtext_layout.execute.restore"):
        got = m.restore(step, args=args)
    assert "read by the restore engine" in caplog.text
    assert not re.search(r": 0 arrays .* read by the restore engine", caplog.text)
    with ocp.CheckpointManager(b, item_names=("items",)) as stock:
        want = stock.restore(step, args=args)
    assert list(got.keys()) == list(want.keys()) == ["items"]
    _assert_bit_identical(got["items"], want["items"])
    for leaf in jax.tree.leaves(got["items"]):
        assert leaf.sharding == _one_device()


def test_restore_without_args_returns_the_legacy_items_and_does_not_migrate(tmp_path, caplog):
    step = copy_fixture(RL, tmp_path)
    if not all(recorded_shardings_resolve(step / n) for n in ("model_params", "optimizer_state")):
        pytest.skip(f"a restore without args places leaves as recorded: {RECORDED_DEVICES_ABSENT}")
    with _manager(step.parent) as m:
        with caplog.at_level(logging.WARNING, LOGGER):
            got = m.restore(1)
        assert set(got.keys()) == {"model_params", "optimizer_state"}
        for name in got.keys():
            _assert_bit_identical(got[name], stock_restore(step / name))
        assert "cannot be split into MaxText items" in caplog.text
        assert m.save(2, args=ocp.args.Composite(items=ocp.args.PyTreeSave({"step": np.int32(3)})))
    moved = step.parent / "1"
    assert detect_layout(moved) is Layout.TUNIX  # moved out of the save's way, not migrated


def test_model_only_step_restores_what_it_holds_and_migrates_with_its_own_number(tmp_path, caplog):
    step = copy_fixture("tunix_snapshot_v1/sft_model_only/checkpoints/1", tmp_path)
    args = _items_args(_abstract())
    caplog.set_level(logging.INFO, LOGGER)
    with _manager(step.parent) as m:
        assert m.all_steps() == [0]
        got = m.restore(0, args=args)["items"]
        assert int(got["step"]) == 1 and got["step"].sharding == _one_device()
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(got["opt_state"]))
        assert "does not hold ['opt_state/" in caplog.text
        assert m.save(1, args=ocp.args.Composite(items=ocp.args.PyTreeSave({"step": np.int32(2)})))
    # Moved to directory 0 and migrated there; its step is still Tunix step 1 (recorded
    # in TUNIX_STEP_KEY), not the new directory name.
    assert detect_layout(step.parent / "0") is Layout.MAXTEXT
    items = stock_restore(step.parent / "0" / "items")
    assert int(items["step"]) == 1 and "opt_state" not in items


def test_extra_iter_item_restores_the_stock_way_or_comes_back_none(tmp_path, caplog):
    step = copy_fixture(RL, tmp_path)
    args = _items_args(_abstract(), iter=ocp.args.JsonRestore())
    with _manager(step.parent, item_names=("items", "iter")) as m:
        with caplog.at_level(logging.WARNING, LOGGER):
            got = m.restore(1, args=args)
        assert got["iter"] is None and "has no 'iter' item" in caplog.text
        assert int(got["items"]["step"]) == 2

    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
        ckptr.save(step / "iter", args=ocp.args.JsonSave({"position": 7}))
    with _manager(step.parent, item_names=("items", "iter")) as m:
        got = m.restore(1, args=args)
        assert got["iter"] == {"position": 7}
        assert int(got["items"]["step"]) == 2


# -- saving, step numbering and lazy migration --------------------------------------------
@pytest.mark.parametrize("use_async, remove_legacy", [(False, False), (False, True), (True, True)])
def test_resumed_maxtext_loop_saves_every_step_and_migrates(
    tmp_path, caplog, use_async, remove_legacy
):
    root = _two_tunix_steps(tmp_path)
    meta_before = json.loads((root / "2" / "_CHECKPOINT_METADATA").read_text())
    args = _items_args(_abstract())
    caplog.set_level(logging.INFO, LOGGER)

    # A MaxText-style loop: restore the latest step, then update and save after each step.
    with _manager(root, max_to_keep=2, use_async=use_async, remove_legacy=remove_legacy) as m:
        assert m.all_steps() == [0, 1]
        restored = m.restore(m.latest_step(), args=args)["items"]
        state, start = restored, int(restored["step"])
        assert start == 2
        for step in range(start, start + 2):
            state = _train(state)
            assert m.save(step, args=ocp.args.Composite(items=ocp.args.PyTreeSave(state)))
        m.wait_until_finished()
        assert m.all_steps() == [0, 1, 2, 3]  # no save skipped; legacy steps kept by retention

    # Tunix directory 2 now is MaxText step 1, migrated in place; directory 1 moved to 0.
    migrated = root / "1"
    assert detect_layout(migrated) is Layout.MAXTEXT
    assert (migrated / "model_params").exists() is not remove_legacy
    files = converted_provenance(migrated)["data_files"]  # the migration shares the files
    assert files["mode"] == "share" and files["copy"]["files"] == 0, files
    assert files["hardlink"]["files"] + files["reflink"]["files"] > 0, files
    meta = json.loads((migrated / "_CHECKPOINT_METADATA").read_text())
    assert meta["custom_metadata"]["global_step"] == meta_before["custom_metadata"]["global_step"]
    assert meta["custom_metadata"][TUNIX_STEP_KEY] == 2
    assert meta["custom_metadata"]["scan_layers"] is True  # as MaxText's saves record it
    assert detect_layout(root / "0") is Layout.TUNIX  # not restored, so only moved

    with ocp.CheckpointManager(root, item_names=("items",)) as stock:
        assert stock.all_steps() == [0, 1, 2, 3]
        _assert_bit_identical(stock.restore(1, args=args)["items"], restored)
        _assert_bit_identical(stock.restore(3, args=args)["items"], state)
        assert int(stock.restore(2, args=args)["items"]["step"]) == 3
    with _manager(root) as m:  # the untouched legacy step still restores, under its number
        old = m.restore(0, args=args)["items"]
    _assert_bit_identical(old, restored)  # same fixture bytes in both Tunix steps

    done = [r for r in caplog.records if r.getMessage().startswith("Migrated legacy step 1")]
    assert len(done) == 1
    assert done[0].threadName == ("save_finalize" if use_async else "MainThread")
    assert ("removed legacy" in done[0].getMessage()) is remove_legacy


def test_migrate_off_moves_but_never_rewrites(tmp_path):
    root = copy_fixture(RL, tmp_path).parent
    args = _items_args(_abstract())
    with _manager(root, migrate="off") as m:
        restored = m.restore(1, args=args)["items"]
        assert m.save(2, args=ocp.args.Composite(items=ocp.args.PyTreeSave(_train(restored))))
    assert detect_layout(root / "1") is Layout.TUNIX
    with _manager(root) as m:
        assert m.all_steps() == [1, 2]
        _assert_bit_identical(m.restore(1, args=args)["items"], restored)


def test_failed_migration_is_logged_and_leaves_the_legacy_step_readable(tmp_path, caplog):
    step = copy_fixture(RL, tmp_path)
    args = _items_args(_abstract())
    with _manager(step.parent, remove_legacy=True) as m:
        restored = m.restore(1, args=args)["items"]
        (step / "items").write_text("not a directory")  # the migration cannot commit here
        with caplog.at_level(logging.ERROR, LOGGER):
            assert m.save(2, args=ocp.args.Composite(items=ocp.args.PyTreeSave(_train(restored))))
    assert "Migration of legacy step 1" in caplog.text and "failed:" in caplog.text
    moved = step.parent / "1"
    assert (moved / "model_params").is_dir() and (moved / "optimizer_state").is_dir()
    with _manager(step.parent) as m:
        assert m.all_steps() == [1, 2]
        _assert_bit_identical(m.restore(1, args=args)["items"], restored)


def test_save_never_deletes_an_unlisted_tunix_step(tmp_path, caplog):
    step = copy_fixture(RL, tmp_path)  # Tunix 2 would be step 1, which a MaxText step holds
    shutil.copytree(MAXTEXT_NATIVE, step.parent / "1")
    before = tree_digest(step)
    with caplog.at_level(logging.WARNING, LOGGER), _manager(step.parent) as m:
        assert m.all_steps() == [1]
        assert "is not listed: step 1 is a MaxText step" in caplog.text
        with pytest.raises(ocp.checkpoint_manager.StepAlreadyExistsError):
            m.save(2, args=ocp.args.Composite(items=ocp.args.PyTreeSave({"step": np.int32(3)})))
    assert tree_digest(step) == before


# -- two processes ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharding_for(mesh: Any) -> Any:
    spec = jax.sharding.PartitionSpec
    n = mesh.devices.size

    def pick(s: Any) -> Any:
        even = len(s.shape) > 0 and s.shape[0] % n == 0
        return jax.sharding.NamedSharding(mesh, spec("x") if even else spec())

    return pick


def _worker(process_id: int, port: int, root: str, out: str, n: int = 2) -> None:
    """One of ``n`` processes: restore through the manager on an n-process mesh, save (the
    primary migrates the restored step), then every process restores that step again at
    once (it must find it in the same layout everywhere, or the job hangs at a barrier)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=process_id)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    abstract = _abstract(_sharding_for(mesh))
    with _manager(Path(root)) as m:
        restored = m.latest_step()
        items = m.restore(restored, args=_items_args(abstract))["items"]
        shards = _local_shards(items, abstract)
        m.save(int(items["step"]), args=ocp.args.Composite(items=ocp.args.PyTreeSave(items)))
        again = m.restore(restored, args=_items_args(abstract))["items"]  # just migrated
        assert _local_shards(again, abstract) == shards
    Path(out).write_text(json.dumps(shards))


def _local_shards(items: Any, abstract: Any) -> dict:
    """``{leaf: [[index, values], ...]}`` of this process's shards of each leaf, each leaf
    checked to have the sharding ``abstract`` asked for."""
    shards = {}
    for p, x in _flat(items).items():
        key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        data = jax.random.key_data(x) if key else x
        assert x.sharding.is_equivalent_to(_flat(abstract)[p].sharding, x.ndim), p
        shards[keystr(p)] = [
            [[[s.start, s.stop] for s in sh.index], np.asarray(sh.data).tolist()]
            for sh in data.addressable_shards
        ]
    return shards


@pytest.mark.needs_sockets("the processes' jax.distributed")
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: the slow pass
def test_processes_restore_sharded_migrate_and_restore_the_migrated_step(tmp_path, n):
    # At 4 processes the primary migrated after the save while the others still saw the
    # legacy items: its restore waited at Orbax's barrier, theirs did not, and the job hung.
    step = copy_fixture(RL, tmp_path)
    port, outs = _free_port(), [tmp_path / f"p{i}.json" for i in range(n)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    argv = [sys.executable, __file__]
    procs = [
        subprocess.Popen(
            [*argv, str(i), str(port), str(step.parent), str(outs[i]), str(n)],
            env=env,
            cwd=Path(__file__).parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(n)
    ]
    try:
        logs = [p.communicate(timeout=180)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)

    # What one process restores, as full host arrays.
    want = _flat(restore_as_items(step.parent / "1", Target.from_checkpoint(MAXTEXT_NATIVE)))
    got = [json.loads(o.read_text()) for o in outs]
    for p, v in want.items():
        full = _raw(v)
        seen = set()
        for proc in got:
            for index, data in proc[keystr(p)]:
                sl = tuple(slice(a, b) for a, b in index)
                assert np.array_equal(np.asarray(data, full.dtype), full[sl]), (p, index)
                seen.add(str(index))
        sharded = len(v.shape) > 0 and v.shape[0] % n == 0
        assert len(seen) == (n if sharded else 1), p  # each process read only its part

    # The primary migrated the legacy step after the 2-process save committed.
    assert detect_layout(step.parent / "1") is Layout.MAXTEXT
    args = _items_args(_abstract())
    with ocp.CheckpointManager(step.parent, item_names=("items",)) as stock:
        assert stock.all_steps() == [1, 2]
        _assert_bit_identical(
            stock.restore(1, args=args)["items"], stock.restore(2, args=args)["items"]
        )


if __name__ == "__main__":  # a worker of test_two_processes_restore_sharded_and_migrate
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))


def test_remove_legacy_manager_breaks_the_lock_a_killed_removal_left(tmp_path, caplog):
    """A run killed after removing a migrated step's legacy items, before releasing the
    step's lock, leaves the lock of a dead process: the next manager removes it; a live
    process's lock stays."""
    step = copy_fixture(RL, tmp_path)
    convert_step(step, Target.from_checkpoint(MAXTEXT_NATIVE), remove_legacy=True)
    assert not (step / "model_params").exists()
    lock = step / ".orbax-maxtext-layout.lock"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    owner = {"pid": int(dead.stdout), "host": socket.gethostname()}
    lock.write_text(json.dumps(owner))
    caplog.set_level(logging.INFO, LOGGER)
    with _manager(step.parent, remove_legacy=True):
        pass
    assert not lock.exists()
    assert any("removed the lock of a dead run" in r.getMessage() for r in caplog.records)
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    with _manager(step.parent, remove_legacy=True):
        pass
    assert lock.exists()  # held by a live process (this one): not broken
