"""A guest in the trainer's process (issue 57): every restore path frees what it returns on
``del`` with the collector off, a restore that fails part way holds nothing, and no library
call changes a process-wide setting.

Memory is counted two ways, with ``gc.disable()`` so that only reference counts free
anything: the distinct device buffers of ``jax.live_arrays()`` (a restore's result alone does
not show a cycle that keeps its per-device shards), and the live objects of the package's
own types (`package_objects`: a reader, its mappings, the engine's boxes). Each path runs
once first, so that caches filled on a first call (Orbax's, JAX's compilations) are not
counted. Real Orbax steps, the real fixtures, the real chip where the default backend is
one (tests/test_on_device.py's targets).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import os
import shutil
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import FIXTURES, MAXTEXT_NATIVE, RL_ACTOR_STEPS, copy_fixture
from etils import epath
from orbax.checkpoint import v1 as ocp1
from threadpoolctl import threadpool_info  # sets KMP_DUPLICATE_LIB_OK on import

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.base.treepaths import flatten, unflatten
from orbax_maxtext_layout.errors import CheckpointReadError
from orbax_maxtext_layout.execute import restore_engine
from orbax_maxtext_layout.integration import manager as manager_mod
from orbax_maxtext_layout.model.scan_targets import unroll_target
from orbax_maxtext_layout.orbax_io.reader import ItemReader
from orbax_maxtext_layout.training import Checkpointer

RL = RL_ACTOR_STEPS["tunix017_rl"]  # tunix017/rl_run/checkpoints/actor/2
PRETRAIN = "maxtext025/pretrain_run/checkpoints/1"


# -- what is alive ------------------------------------------------------------------------
def device_buffers() -> dict[tuple[int, int], int]:
    """``{(device id, buffer address): bytes}`` of every live device buffer (distinct: the
    arrays that share one count once)."""
    out = {}
    for x in jax.live_arrays():
        if x.is_deleted():
            continue
        for s in x.addressable_shards:
            data = s.data
            if jax.dtypes.issubdtype(data.dtype, jax.dtypes.extended):
                data = jax.random.key_data(data)
            out[s.device.id, data.unsafe_buffer_pointer()] = data.nbytes
    return out


def package_objects() -> collections.Counter:
    """Live objects of the package's own types, by type."""
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects() if _ours(o))


def _ours(o: Any) -> bool:
    module = type(o).__dict__.get("__module__")
    return isinstance(module, str) and module.startswith("orbax_maxtext_layout")


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def assert_freed_on_del(restore: Callable[[], Any], *, times: int = 1) -> None:
    """``restore()`` (run once before, for caches) ``times`` times in a row, each result
    dropped with ``del``, the collector off: no device buffer, host array or package object
    outlives it."""
    warm = restore()
    del warm
    with collector_off():
        buffers, objects = set(device_buffers()), package_objects()
        for _ in range(times):
            got = restore()
            leaves = jax.tree.leaves(got)
            assert leaves
            hosts = [weakref.ref(x) for x in leaves if isinstance(x, np.ndarray)]
            made = set(device_buffers()) - buffers
            assert made or hosts  # the check below counts something
            del got, leaves
            left = set(device_buffers()) - buffers
            assert not left, f"{len(left)} of {len(made)} device buffers outlived del"
            assert all(r() is None for r in hosts), "a host array outlived del"
            grown = package_objects() - objects
            assert not grown, f"package objects outlived del: {dict(grown)}"


# -- targets ------------------------------------------------------------------------------
def _device() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _items(root: Path | str = MAXTEXT_NATIVE, *, host: bool = False) -> dict:
    """MaxText's full items request for the fixture model: each leaf on the default device,
    or with ``host`` without a sharding (host arrays)."""
    sharding = None if host else _device()
    return unflatten(
        {
            p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
            for p, s in oml.Target.from_checkpoint(root).abstract.items()
        }
    )


def _params(host: bool = False) -> dict:
    return {"params": _items(host=host)["params"]["params"]}


@pytest.fixture
def run(tmp_path) -> dict[str, Path]:
    """A Tunix step and a MaxText step of the same model (copies)."""
    tunix = copy_fixture(RL, tmp_path / "tunix")
    maxtext = tmp_path / "maxtext" / "2"
    shutil.copytree(MAXTEXT_NATIVE, maxtext)
    return {"tunix": tunix, "maxtext": maxtext}


# -- every restore path frees what it returns ---------------------------------------------
@pytest.mark.parametrize("layout", ["tunix", "maxtext"])
@pytest.mark.parametrize("host", [False, True], ids=["device", "host"])
def test_load_params_from_path_frees_its_result_on_del(run, layout, host):
    path = run[layout] if layout == "tunix" else run[layout] / "items"
    params = _params(host)
    assert_freed_on_del(lambda: oml.load_params_from_path(str(path), params))


@pytest.mark.parametrize("layout", ["tunix", "maxtext"])
def test_the_handler_frees_its_result_on_del(run, layout):
    path = run[layout] if layout == "tunix" else run[layout] / "items"
    items = _items()
    args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), items)
    handler = oml.MaxTextLayoutHandler()
    restore = oml.MaxTextLayoutRestore(item=items, restore_args=args)
    assert_freed_on_del(lambda: handler.restore(epath.Path(path), args=restore))


def test_the_v0_manager_frees_its_result_on_del(run):
    items = _items()
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), items)
    args = ocp.args.Composite(items=ocp.args.PyTreeRestore(item=items, restore_args=restore_args))
    for root in (run["tunix"].parent, run["maxtext"].parent):
        with oml.CheckpointManager(root, item_names=("items",)) as m:
            step = m.latest_step()
            assert_freed_on_del(lambda m=m, step=step: m.restore(step, args=args))


def test_the_v1_checkpointer_frees_its_result_on_del(tmp_path):
    for rel in ("maxtext025/rl_run/checkpoints/actor/2", PRETRAIN):
        step = copy_fixture(rel, tmp_path / rel.split("/")[1])
        items = _items(FIXTURES / PRETRAIN)
        ctx = ocp1.Context()
        ctx.pytree.loading.partial_load = True
        with Checkpointer(step.parent, context=ctx) as ckptr:
            n = ckptr.latest.step
            assert_freed_on_del(
                lambda c=ckptr, n=n, i=items: c.load_checkpointables(n, {"items": i})
            )


def test_twenty_restores_in_a_row_hold_nothing_between_them(run):
    params = _params()
    assert_freed_on_del(lambda: oml.load_params_from_path(str(run["tunix"]), params), times=20)


def _many_arrays_item(path: epath.Path) -> dict:
    """A MaxText items tree of 9 params saved at ``path``; its flat ``{name: array}``."""
    rng = np.random.default_rng(3)
    flat = {f"w{i}": rng.standard_normal((64, 256 - 16 * i)).astype(np.float32) for i in range(8)}
    flat["last"] = rng.standard_normal((32, 64)).astype(np.float32)  # the smallest: read last
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    ckptr.save(path, args=ocp.args.PyTreeSave({"params": {"params": flat}}))
    ckptr.close()
    return flat


def _cut(path: epath.Path, name: str) -> None:
    """``name``'s one stored chunk overwritten with zeros in its data file (not a valid
    zstd frame); every other chunk as it was."""
    reader = ItemReader.open(path)
    lay = reader.layout(name)
    file, offset, length = reader.value_file(f"{name}/{lay.key((0,) * len(lay.shape))}")
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(bytes(length))


def test_a_restore_that_fails_part_way_holds_nothing_it_placed(tmp_path):
    """The engine, one worker: every array but the last (the smallest) is placed on the
    device before the last one's cut chunk fails. While the caller still holds the error,
    none of them is alive; nor any package object once it is dropped."""
    path = epath.Path(tmp_path) / "item"
    flat = _many_arrays_item(path)
    _cut(path, "params.params.last")
    device = _device()

    def reads() -> dict:
        reader = ItemReader.open(path)
        return {
            k: (reader, restore_engine.ArrayRequest(f"params.params.{k}", v.shape, v.dtype, device))
            for k, v in flat.items()
        }

    with collector_off():
        buffers, objects = set(device_buffers()), package_objects()
        placed = []
        real_place = restore_engine._ReadCall._place

        def counting(self, box):  # counts what was placed before the failure
            real_place(self, box)
            placed.append(box.stop)

        restore_engine._ReadCall._place = counting
        try:
            with pytest.raises(
                CheckpointReadError, match=r"cannot read params\.params\.last"
            ) as err:
                restore_engine.read_across(reads(), workers=1)
        finally:
            restore_engine._ReadCall._place = real_place
        assert len(placed) == len(flat) - 1  # the others were on the device when it failed
        assert not set(device_buffers()) - buffers  # freed while the error is still held
        del err
        grown = package_objects() - objects
        assert not grown, dict(grown)


def test_load_params_from_path_that_fails_frees_what_it_placed(tmp_path):
    path = epath.Path(tmp_path) / "item"
    flat = _many_arrays_item(path)
    _cut(path, "params.params.last")
    one = _device()
    params = {
        "params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one) for k, v in flat.items()}
    }
    with pytest.raises(CheckpointReadError):  # once: caches
        oml.load_params_from_path(str(path), params)
    with collector_off():
        buffers, objects = set(device_buffers()), package_objects()
        with pytest.raises(CheckpointReadError, match=r"params\.params\.last"):
            oml.load_params_from_path(str(path), params)
        assert not set(device_buffers()) - buffers
        grown = package_objects() - objects
        assert not grown, dict(grown)


def test_flatten_leaves_no_cycle():
    """`flatten` of real arrays: the flat dict and its leaves go with the last reference."""
    with collector_off():
        leaf = np.ones(3)
        ref = weakref.ref(leaf)
        flat = flatten({"a": {"b": [leaf, None]}, "c": (1, 2)})
        assert flat[("a", "b", 0)] is leaf
        del flat, leaf
        assert ref() is None


# -- the process as it was found ----------------------------------------------------------
def _numpy_hugepages() -> bool:
    switch = np._core.multiarray._set_madvise_hugepage
    was = switch(True)
    switch(was)
    return bool(was)


def _loggers() -> dict:
    manager = logging.Logger.manager
    out = {"": (logging.root.level, tuple(logging.root.handlers), manager.disable)}
    for name, lg in list(manager.loggerDict.items()):
        if isinstance(lg, logging.Logger):
            out[name] = (lg.level, tuple(lg.handlers), lg.propagate, lg.disabled)
    return out


def _blas_threads() -> list:
    return [(i["filepath"], i["num_threads"]) for i in threadpool_info()]


def process_settings() -> dict:
    """Every process-wide setting a library call could change."""
    return {
        "gc enabled": gc.isenabled(),
        "gc thresholds": gc.get_threshold(),
        "gc debug": gc.get_debug(),
        "gc frozen": gc.get_freeze_count(),
        "numpy huge pages": _numpy_hugepages(),
        "signals": {s: signal.getsignal(s) for s in signal.valid_signals() if s < signal.SIGRTMIN},
        "environment": dict(os.environ),
        "loggers": _loggers(),
        "threads": {t for t in threading.enumerate() if t.is_alive()},
        "jax platforms": jax.config.jax_platforms,
        "jax prng": jax.config.jax_default_prng_impl,
        "stdout": (sys.stdout, sys.stderr),
        "blas threads": _blas_threads(),
        "recursion limit": sys.getrecursionlimit(),
        "switch interval": sys.getswitchinterval(),
        "profile": (sys.getprofile(), sys.gettrace()),
    }


def _diff(before: Any, after: Any) -> Any:
    if isinstance(before, dict) and isinstance(after, dict):
        keys = set(before) | set(after)
        return {k: (before.get(k), after.get(k)) for k in keys if before.get(k) != after.get(k)}
    if isinstance(before, set) and isinstance(after, set):
        return {"gone": before - after, "new": after - before}
    return before, after


@contextlib.contextmanager
def freezes_watched() -> Iterator[list[int]]:
    """The permanent generation's size at each collection while the block runs (a freeze
    inside a call shows there, though the call undoes it before returning)."""
    seen: list[int] = []

    def watch(phase: str, info: dict) -> None:
        seen.append(gc.get_freeze_count())

    gc.callbacks.append(watch)
    try:
        yield seen
    finally:
        gc.callbacks.remove(watch)


def _calls(tmp_path: Path) -> dict[str, Callable[[], Any]]:
    """Each library call a trainer or a script makes, on fresh copies."""
    ex = Path(oml.EXAMPLES_DIR)
    target = oml.Target.from_checkpoint(MAXTEXT_NATIVE)
    n = iter(range(1000))

    def fresh(rel: str) -> Path:
        return copy_fixture(rel, tmp_path / f"c{next(n)}")

    def migrate() -> None:
        step = fresh(RL)
        items = _items()
        rargs = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), items)
        args = ocp.args.Composite(items=ocp.args.PyTreeRestore(item=items, restore_args=rargs))
        opts = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
        with oml.CheckpointManager(step.parent, item_names=("items",), options=opts) as m:
            state = m.restore(m.latest_step(), args=args)["items"]
            assert m.save(
                m.latest_step() + 1, args=ocp.args.Composite(items=ocp.args.PyTreeSave(state))
            )
        assert oml.detect_layout(step.parent / "1") is oml.Layout.MAXTEXT  # migrated

    def verify() -> None:
        step = fresh(RL)
        oml.convert_step(step, target)
        assert oml.verify_step(step).ok

    def merge() -> None:
        out = tmp_path / f"merged{next(n)}"
        oml.merge_lora(
            ex / "tunix_lora_run/checkpoints/1", ex / "maxtext_run/checkpoints/2", alpha=4, out=out
        )

    return {
        "load_params_from_path": lambda: oml.load_params_from_path(str(fresh(RL)), _params()),
        "restore_as_items": lambda: oml.restore_as_items(fresh(RL), target),
        "a save that migrates": migrate,
        "convert_step": lambda: oml.convert_step(fresh(RL), target),
        "convert_step --unroll": lambda: oml.convert_step(
            fresh(RL), unroll_target(target), rescan="unroll"
        ),
        "verify_step": verify,
        "merge_lora": merge,
    }


@pytest.mark.parametrize("collector", ["on", "off"])
def test_no_library_call_changes_a_process_setting(tmp_path, collector):
    """Each call, made as a trainer makes it: every setting is as it was after it, no freeze
    happened during it, and (collector off) an object the caller made just before is still
    in the youngest generation: nothing froze, unfroze or collected it."""
    calls = _calls(tmp_path)
    for call in calls.values():  # once each first: lazily started pools, caches
        call()
    was = gc.isenabled()
    if collector == "off":
        gc.disable()
    try:
        for name, call in calls.items():
            before = process_settings()
            mine = [object()]  # tracked, made just before the call: generation 0
            assert collector == "on" or any(o is mine for o in gc.get_objects(0))
            with freezes_watched() as seen:
                call()
            after = process_settings()
            # A freed frozen object leaves the permanent generation (the suite's guard freezes
            # what outlives each test): fewer is fine, more is a freeze, none an unfreeze.
            frozen = (before.pop("gc frozen"), after.pop("gc frozen"))
            assert frozen[0] - 1000 <= frozen[1] <= frozen[0], f"{name}: frozen {frozen}"
            changed = {k: _diff(before[k], after[k]) for k in before if before[k] != after[k]}
            assert not changed, f"{name} changed {changed}"
            assert all(c <= frozen[0] for c in seen), f"{name} froze the heap: {seen}"
            if collector == "off":
                assert any(o is mine for o in gc.get_objects(0)), f"{name} moved our objects"
    finally:
        if was:
            gc.enable()


def test_a_wrapped_stock_constructor_still_tells_a_tunix_caller(tmp_path):
    """A profiler or harness that wrapped ``ocp.CheckpointManager.__init__`` as
    ``(*args, **kwargs)`` before the manager was built: a Tunix caller (its items declared)
    still gets the stock numbering, with or without ``functools.wraps``."""
    import functools

    real = ocp.CheckpointManager.__init__
    handlers = {"model_params": ocp.PyTreeCheckpointHandler()}

    def bare(self, *args, **kwargs):
        return real(self, *args, **kwargs)

    wrapped = functools.wraps(real)(lambda self, *a, **k: real(self, *a, **k))
    for wrapper in (bare, wrapped):
        ocp.CheckpointManager.__init__ = wrapper
        try:
            by_keyword = manager_mod.declared_numbering((), {"item_handlers": handlers})
            positional = manager_mod.declared_numbering(
                (tmp_path, None, None, None, ("model_params",)), {}
            )
        finally:
            ocp.CheckpointManager.__init__ = real
        assert by_keyword == "as_written"
        if wrapper is wrapped:  # positional arguments bind to the unwrapped signature
            assert positional == "as_written"
    assert manager_mod.declared_numbering((), {"item_names": ("items",)}) == "maxtext"
