"""The restore engine (`execute.restore_engine`) against stock Orbax, bit for bit.

Real Orbax items (zarr2 and zarr3, one chunk and many per array) are restored with the same
request through the engine and through stock `PyTreeCheckpointHandler`: the same values,
dtypes (casts as Orbax casts) and shardings; PRNG keys, Orbax scalars and transforms go the stock
way, counted in the engine's debug line; a corrupt chunk is a `CheckpointReadError` naming
the array. The 8-device cases (fsdp-chunked steps into matching, resharded, replicated and
one-device targets) run in a child process, where the host devices can be set.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

import orbax_maxtext_layout as oml
from orbax_maxtext_layout.errors import CheckpointReadError
from orbax_maxtext_layout.execute import restore_engine
from orbax_maxtext_layout.execute.restore import restore_pytree
from orbax_maxtext_layout.orbax_io.reader import ItemReader
from orbax_maxtext_layout.storage.scratch import Ahead, aligned

LOGGER = "orbax_maxtext_layout.execute.restore"
HOST = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])


def _tree() -> dict:
    rng = np.random.default_rng(7)
    return {
        "params": {
            "w": rng.standard_normal((64, 1000)).astype(np.float32),  # 8 chunks (chunk_byte_size)
            "b": rng.standard_normal((3, 50, 40)).astype(ml_dtypes.bfloat16),
            "edge": rng.standard_normal((37, 301)).astype(np.float32),  # edge chunks cropped
            "tiny": rng.standard_normal((5,)).astype(np.float32),
        },
        "counts": np.arange(1000, dtype=np.int32).reshape(10, 100),
        "step": np.int32(12),  # a scalar: the stock way
    }


def _save(path: epath.Path, *, zarr3: bool, negate: bool = False) -> dict:
    tree = _tree()
    if negate:  # other values, same layout
        tree["params"] = {k: -v for k, v in tree["params"].items()}
    chunked = ocp.SaveArgs(chunk_byte_size=32_000)
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(), tree)
    save_args["params"]["w"] = chunked
    save_args["params"]["edge"] = ocp.SaveArgs(chunk_byte_size=8_000)
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=zarr3))
    ckptr.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args))
    ckptr.close()
    return tree


@pytest.fixture(params=[False, True], ids=["zarr2", "zarr3"])
def item(tmp_path, request):
    path = epath.Path(tmp_path) / "item"
    tree = _save(path, zarr3=request.param)
    return path, tree


def _stock(path, args):
    return ocp.PyTreeCheckpointHandler().restore(path, args=args)


def _same(got, want) -> None:
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert type(g) is type(w) or (isinstance(g, jax.Array) and isinstance(w, jax.Array))
        assert np.asarray(g).dtype == np.asarray(w).dtype
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
        if isinstance(w, jax.Array):
            assert g.sharding == w.sharding


def _engine_count(caplog) -> int:
    counts = [
        int(m.group(1))
        for r in caplog.records
        if (m := re.search(r": (\d+) arrays .* read by the restore engine", r.getMessage()))
    ]
    assert counts, "the engine logged no line"
    return sum(counts)


def _request(tree, place):
    """Restore args placing every array leaf with ``place(leaf)``, scalars as stock does."""

    def args(x):
        if np.ndim(x) == 0:
            return ocp.RestoreArgs()
        return place(x)

    return jax.tree.map(args, tree)


def test_device_and_host_targets_equal_stock_bit_for_bit(item, caplog):
    path, tree = item
    rargs = _request(tree, lambda x: ocp.ArrayRestoreArgs(sharding=HOST, global_shape=x.shape))
    rargs["params"]["b"] = ocp.RestoreArgs(restore_type=np.ndarray)  # a host array
    args = ocp.args.PyTreeRestore(item=rargs, restore_args=rargs)
    with caplog.at_level(logging.DEBUG, LOGGER):
        got = restore_pytree(path, args, _stock)
    _same(got, _stock(path, args))
    assert _engine_count(caplog) == 5  # every array; the scalar step the stock way
    assert isinstance(got["params"]["b"], np.ndarray)
    assert np.array_equal(np.asarray(got["params"]["edge"]), tree["params"]["edge"])


def test_casts_as_orbax_casts(item, caplog):
    path, tree = item
    casts = {"w": ml_dtypes.bfloat16, "b": np.float32, "edge": np.float16, "tiny": np.float64}
    rargs = _request(tree, lambda x: ocp.ArrayRestoreArgs(sharding=HOST, global_shape=x.shape))
    for k, dt in casts.items():
        rargs["params"][k] = ocp.ArrayRestoreArgs(
            sharding=HOST, global_shape=tree["params"][k].shape, dtype=dt
        )
    rargs["counts"] = ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.float32)
    args = ocp.args.PyTreeRestore(item=rargs, restore_args=rargs)
    with caplog.at_level(logging.DEBUG, LOGGER):
        got = restore_pytree(path, args, _stock)
    want = _stock(path, args)
    _same(got, want)
    assert got["params"]["w"].dtype == ml_dtypes.bfloat16
    assert _engine_count(caplog) >= 4


def test_subtree_and_partial_requests(item, caplog):
    path, tree = item
    params = _request(
        tree["params"], lambda x: ocp.ArrayRestoreArgs(sharding=HOST, global_shape=x.shape)
    )
    for kwargs in ({"transforms": {}}, {"partial_restore": True}):
        args = ocp.args.PyTreeRestore(
            item={"params": params}, restore_args={"params": params}, **kwargs
        )
        caplog.clear()
        with caplog.at_level(logging.DEBUG, LOGGER):
            got = restore_pytree(path, args, _stock)
        _same(got, _stock(path, args))
        assert _engine_count(caplog) == 4
        assert set(got) == {"params"}


def test_what_the_engine_does_not_take_goes_the_stock_way(item, caplog, monkeypatch):
    path, tree = item
    # No restore args: placed from the recorded sharding (stock's business, never guessed).
    args = ocp.args.PyTreeRestore(item=jax.tree.map(np.asarray, tree))
    with caplog.at_level(logging.DEBUG, LOGGER):
        got = restore_pytree(path, args, _stock)
    _same(got, _stock(path, args))
    # A shape other than the stored one: Orbax pads (strict=False); the engine declines.
    rargs = _request(tree, lambda x: ocp.ArrayRestoreArgs(sharding=HOST, global_shape=x.shape))
    rargs["params"]["tiny"] = ocp.ArrayRestoreArgs(sharding=HOST, global_shape=(8,), strict=False)
    args = ocp.args.PyTreeRestore(item=rargs, restore_args=rargs)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, LOGGER):
        got = restore_pytree(path, args, _stock)
    _same(got, _stock(path, args))
    assert got["params"]["tiny"].shape == (8,)
    assert "a shape other than the stored one: 1" in caplog.text
    # The switch: everything the stock way, the same result.
    monkeypatch.setenv(restore_engine.ENV, "stock")
    rargs = _request(tree, lambda x: ocp.ArrayRestoreArgs(sharding=HOST, global_shape=x.shape))
    args = ocp.args.PyTreeRestore(item=rargs, restore_args=rargs)
    assert not restore_engine.enabled()
    _same(restore_pytree(path, args, _stock), _stock(path, args))


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr2", "zarr3"])
def test_zero_dimensional_arrays_are_read_by_the_engine_as_stock_reads_them(
    tmp_path, zarr3, caplog
):
    """0-d arrays (an RNG counter, a step kept as an array) are one value each: the engine
    reads them too, so an item of counters never sends Orbax the whole item's metadata for
    them; host and device targets and a cast give what stock gives. A NumPy or Python
    scalar (Orbax's "scalar" value type: stock returns a scalar, not an array) stays stock."""
    vals = {
        "f32": np.array(-0.0, np.float32),
        "bf16": np.array(3.5, ml_dtypes.bfloat16),
        "u32": np.array(4_000_000_000, np.uint32),
        "i8": np.array(-7, np.int8),
        "flag": np.array(True),
    }
    tree = {"host": dict(vals), "device": {k: jax.device_put(v, HOST) for k, v in vals.items()}}
    tree["scalar"] = np.int32(5)
    path = epath.Path(tmp_path) / "zero_d"
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=zarr3))
    ckptr.save(path, args=ocp.args.PyTreeSave(tree))
    ckptr.close()
    rargs = {
        "host": {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in vals},
        "device": {k: ocp.ArrayRestoreArgs(sharding=HOST, global_shape=()) for k in vals},
        "scalar": ocp.RestoreArgs(),
    }
    rargs["device"]["u32"] = ocp.ArrayRestoreArgs(sharding=HOST, global_shape=(), dtype=np.float32)
    args = ocp.args.PyTreeRestore(item=rargs, restore_args=rargs)
    with caplog.at_level(logging.DEBUG, LOGGER):
        got = restore_pytree(path, args, _stock)
    _same(got, _stock(path, args))
    assert _engine_count(caplog) == 2 * len(vals)  # the scalar: not an array, never asked
    assert not isinstance(got["scalar"], np.ndarray) and got["scalar"] == 5  # as stock
    assert got["host"]["u32"].shape == () and int(got["host"]["u32"]) == 4_000_000_000


def test_prng_keys_go_the_stock_way(tmp_path):
    keys = jax.random.split(jax.random.key(3), 4)
    path = epath.Path(tmp_path) / "keys"
    tree = {"rng": keys, "w": np.ones((300, 1000), np.float32)}
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    ckptr.save(path, args=ocp.args.PyTreeSave(tree))
    ckptr.close()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=HOST), tree)
    rargs = ocp.checkpoint_utils.construct_restore_args(abstract)
    args = ocp.args.PyTreeRestore(item=abstract, restore_args=rargs)
    got, want = restore_pytree(path, args, _stock), _stock(path, args)
    assert jax.dtypes.issubdtype(got["rng"].dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(got["rng"]), jax.random.key_data(want["rng"]))
    assert np.array_equal(np.asarray(got["w"]), np.asarray(want["w"]))


def test_read_arrays_reads_exactly_the_stored_chunks(item):
    path, tree = item
    reader = ItemReader.open(path)
    reqs = {
        k: restore_engine.ArrayRequest(f"params.{k}", v.shape, v.dtype, None)
        for k, v in tree["params"].items()
    }
    assert all(restore_engine.why_not(reader, r) is None for r in reqs.values())
    # A budget smaller than any box: boxes still complete (one at a time past the budget).
    got = restore_engine.read_arrays(reader, reqs, workers=3, budget=1)
    for k, v in tree["params"].items():
        assert got[k].tobytes() == v.tobytes() and got[k].dtype == v.dtype


def test_read_across_two_items_in_one_run(tmp_path):
    """A Tunix step's two items read in one run: every array from its own item, and a
    corrupt chunk named with the item that holds it."""
    paths = {z: epath.Path(tmp_path) / f"item-{z}" for z in ("zarr2", "zarr3")}
    trees = {z: _save(p, zarr3=z == "zarr3", negate=z == "zarr3") for z, p in paths.items()}
    readers = {z: ItemReader.open(p) for z, p in paths.items()}
    reads = {
        (z, k): (readers[z], restore_engine.ArrayRequest(f"params.{k}", v.shape, v.dtype, HOST))
        for z, tree in trees.items()
        for k, v in tree["params"].items()
    }
    got = restore_engine.read_across(reads, workers=2)
    assert set(got) == set(reads)
    for (z, k), x in got.items():
        want = trees[z]["params"][k]
        assert x.dtype == want.dtype and np.asarray(x).tobytes() == want.tobytes()
    _cut_first_chunk(paths["zarr3"], "params.w")
    readers["zarr3"] = ItemReader.open(paths["zarr3"])
    reads = {k: (readers[k[0]], r) for k, (_, r) in reads.items()}
    with pytest.raises(CheckpointReadError, match=r"item-zarr3: cannot read params\.w"):
        restore_engine.read_across(reads, workers=2)


def _cut_first_chunk(path: epath.Path, name: str) -> None:
    """The data file holding ``name``'s first chunk cut in the middle of it."""
    reader = ItemReader.open(path)
    lay = reader.layout(name)
    key = f"{name}/{lay.key((0,) * len(lay.shape))}"
    file, offset, length = reader.value_file(key)
    os.truncate(file, offset + length // 2)


def test_a_corrupt_chunk_names_the_array_and_returns_nothing(tmp_path):
    path = epath.Path(tmp_path) / "item"
    tree = _save(path, zarr3=False)
    _cut_first_chunk(path, "params.w")
    rargs = _request(tree, lambda x: ocp.ArrayRestoreArgs(sharding=HOST, global_shape=x.shape))
    args = ocp.args.PyTreeRestore(item=rargs, restore_args=rargs)
    with pytest.raises(CheckpointReadError, match=r"params\.w"):
        restore_pytree(path, args, _stock)


def test_load_params_from_path_reads_a_maxtext_step_through_the_engine(tmp_path, caplog):
    src = Path(oml.EXAMPLES_DIR) / "maxtext_run"
    shutil.copytree(src, tmp_path / "run")
    step = tmp_path / "run" / "checkpoints" / "2"
    meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(step / "items")).tree
    abstract = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=HOST), meta["params"]["params"]
    )
    with caplog.at_level(logging.DEBUG, LOGGER):
        got = oml.load_params_from_path(str(step / "items"), {"params": abstract})
    assert _engine_count(caplog) > 0
    os.environ[restore_engine.ENV] = "stock"
    try:
        want = oml.load_params_from_path(str(step / "items"), {"params": abstract})
    finally:
        del os.environ[restore_engine.ENV]
    _same(got, want)


_CHILD = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import logging, re, numpy as np, jax, orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from orbax_maxtext_layout.execute.restore import restore_pytree
logging.basicConfig(level=logging.WARNING)
log = logging.getLogger("orbax_maxtext_layout.execute.restore")
log.setLevel(logging.DEBUG)
lines = []
log.addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: lines.append(r.getMessage())})())
path = epath.Path(sys.argv[1])
mesh = Mesh(np.array(jax.devices()), ("x",))
rng = np.random.default_rng(1)
tree = {"k": rng.standard_normal((64, 3, 96)).astype(np.float32), "v": rng.standard_normal((16, 40)).astype(np.float32)}
saved = {"k": jax.device_put(tree["k"], NamedSharding(mesh, P("x"))), "v": jax.device_put(tree["v"], NamedSharding(mesh, P(None, "x")))}
ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
ckptr.save(path, args=ocp.args.PyTreeSave(saved))
ckptr.close()
stock = lambda d, a: ocp.PyTreeCheckpointHandler().restore(d, args=a)
targets = {
    "matching fsdp": {"k": P("x"), "v": P(None, "x")},
    "resharded": {"k": P(None, None, "x"), "v": P("x")},
    "replicated": {"k": P(), "v": P()},
}
for what, specs in targets.items():
    rargs = {k: ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, s), global_shape=tree[k].shape) for k, s in specs.items()}
    rargs["v"] = ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, specs["v"]), global_shape=(16, 40), dtype=jax.numpy.bfloat16)
    args = ocp.args.PyTreeRestore(item=rargs, restore_args=rargs)
    lines.clear()
    got, want = restore_pytree(path, args, stock), stock(path, args)
    assert any(re.search(r": 2 arrays .* read by the restore engine", l) for l in lines), lines
    for k in tree:
        assert got[k].sharding == want[k].sharding, (what, k)
        assert got[k].dtype == want[k].dtype, (what, k)
        for a, b in zip(sorted(got[k].addressable_shards, key=lambda s: s.device.id), sorted(want[k].addressable_shards, key=lambda s: s.device.id)):
            assert a.device == b.device and a.index == b.index, (what, k)
            assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes(), (what, k)
        # each device its own buffer: replicas never share one
        ptrs = [s.data.unsafe_buffer_pointer() for s in got[k].addressable_shards]
        assert len(set(ptrs)) == len(ptrs), (what, k)
print("OK")
"""


def test_eight_devices_matching_resharded_and_replicated_targets(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "item")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("OK")


def test_host_buffers_are_reused_within_the_budget():
    """The staging pool of accelerator targets (CPU devices keep their buffers instead)."""
    pool = restore_engine._Buffers(budget=3 << 20)
    a = pool.take(2 << 20)
    pool.started(1)  # a task runs: a take past the budget waits for a give
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.take(2 << 20)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got
    pool.give(a, 2 << 20)
    waiter.join(5)
    assert got and got[0] is a  # the same buffer, rewritten, not fresh memory
    assert a.ctypes.data % 64 == 0
    pool.started(-1)
    b = pool.take(1 << 20)  # nothing runs: never waits
    pool.give(got[0], 2 << 20)
    pool.give(b, 1 << 20)
    c = pool.take(1 << 20)
    assert c is b  # the smallest buffer that fits
    pool.give(c, 1 << 20)
    big = pool.take(8 << 20)  # larger than the budget: made alone, the pool kept small
    pool.give(big, 8 << 20)
    assert sum(x.nbytes for x in pool.free) <= 8 << 20 and len(pool.free) == 1


def test_fresh_buffers_faulted_in_ahead_never_lose_what_the_writer_wrote():
    """`Ahead`: helpers touch ranges while the writer claims and writes them; every byte
    is the writer's, whichever got to a range first (with and without madvise)."""
    for use_madvise in (True, False):
        buf = aligned(8 << 20)
        ahead = Ahead(buf, 64 << 10, madvise=use_madvise)
        want = np.random.default_rng(3).integers(0, 255, buf.nbytes, np.uint8) | 1  # no zeros
        helpers = [
            threading.Thread(
                target=lambda k=k, a=ahead: [a.touch(i) for i in range(k, len(a.state), 2)]
            )
            for k in range(2)
        ]
        for t in helpers:
            t.start()
        for start in range(0, buf.nbytes, 96 << 10):  # writer steps unlike the helpers'
            stop = min(start + (96 << 10), buf.nbytes)
            ahead.claim(start, stop)
            buf[start:stop] = want[start:stop]
        for t in helpers:
            t.join()
        assert np.array_equal(buf, want)


def _vm_flags(buf: np.ndarray) -> list[str]:
    """The kernel's VmFlags of the mapping that holds the middle of ``buf`` (NumPy advises
    from the first page boundary on: the mapping splits there)."""
    at, inside = buf.ctypes.data + buf.nbytes // 2, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= at < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError("no mapping holds the buffer")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's smaps only")
def test_fresh_buffers_are_never_asked_for_in_huge_pages():
    """A restore's fresh host buffers (`aligned`) are not advised into transparent huge
    pages, which NumPy asks for on a large array: where free memory goes back to the host
    (a VM's free page reporting), a huge page's first touch waits for the host to back
    2 MiB, 5x slower than small pages (`scratch.small_pages`)."""
    switch = np._core.multiarray._set_madvise_hugepage
    was = switch(True)  # NumPy's default where the kernel has huge pages
    try:
        numpy_own = np.empty(64 << 20, np.uint8)
        ours = aligned(64 << 20)
        if "hg" not in _vm_flags(numpy_own):  # the control: NumPy advises its own
            pytest.skip("this kernel does not report huge page advice (gVisor)")
        assert "hg" not in _vm_flags(ours)
        assert switch(was) is True  # the switch was put back after the allocation
    finally:
        switch(was)


def test_large_boxes_faulted_in_ahead_decode_bit_for_bit(tmp_path):
    """Boxes of 64 MiB and more are faulted in by helper threads while their chunks are
    decoded straight into them (chunks of whole rows) or copied in piece by piece (chunks
    of columns): the same bytes as stock."""
    rng = np.random.default_rng(5)
    tree = {
        "rows": rng.standard_normal((2048, 8192), np.float32),  # 64 MiB, chunks of rows
        "cols": rng.standard_normal((8192, 2048), np.float32),
    }
    path = epath.Path(tmp_path) / "big"
    save_args = {"rows": ocp.SaveArgs(chunk_byte_size=8 << 20), "cols": ocp.SaveArgs()}
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=False))
    ckptr.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args))
    ckptr.close()
    reader = ItemReader.open(path)
    assert reader.layout("rows").chunk[0] < 2048 == reader.layout("rows").shape[0]
    reqs = {
        "rows": restore_engine.ArrayRequest("rows", (2048, 8192), np.dtype(np.float32), HOST),
        # a cast: never decoded in place, copied piece by piece into the claimed ranges
        "cols": restore_engine.ArrayRequest("cols", (8192, 2048), np.dtype(np.float64)),
    }
    assert all(r.nbytes >= restore_engine._POPULATE_FROM for r in reqs.values())
    got = restore_engine.read_arrays(reader, reqs, workers=2)
    assert np.asarray(got["rows"]).tobytes() == tree["rows"].tobytes()
    assert got["cols"].tobytes() == tree["cols"].astype(np.float64).tobytes()
