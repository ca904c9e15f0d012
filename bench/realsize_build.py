"""The builder of `bench/realsize.py`'s steps, and the check of a built step by stock Orbax
(each runs in a process of its own, `realsize.py build` / `check-step`).

How a step is built without holding the model: see `bench/realsize.py`'s docstring. Heavy
imports (jax, numpy, Orbax, tensorstore, MaxText) stay inside the functions.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from pathlib import Path

from realsize_steps import (
    ALPHA,
    FSDP,
    LORA_MODULES,
    MIB,
    RANK,
    REPO,
    TXN_BYTES,
    base_yml,
    du,
    flat_tree,
    step_path,
    unflat_tree,
    vm_hwm_kib,
)


def abstract(keys: list[str]):
    """MaxText's abstract items for ``keys``: ``(flat params, flat nnx_aux.model, layer axes)``,
    model paths (no ``params/params`` prefix)."""
    import contextlib

    import jax
    from _internal import abstract_model

    with contextlib.redirect_stdout(sys.stderr):
        items, axes = abstract_model([str(base_yml()), *keys])

    def flat(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {tuple(str(getattr(k, "key", k)) for k in p): x for p, x in leaves}

    return flat(items["params"]["params"]), flat(items["nnx_aux"]["model"]), dict(axes)


class Pool:
    """Free buffers kept for reuse, by size (at most ``limit`` bytes kept): memory a process
    touches the first time is slow on this VM (0.2 GB/s, against 6 GB/s once touched), so the
    builder draws into buffers it already touched."""

    def __init__(self, limit: int):
        self.limit, self.held, self.free = limit, 0, {}

    def take(self, shape, dtype):
        import numpy as np

        dtype = np.dtype(dtype)
        n = dtype.itemsize
        for d in shape:
            n *= d
        bufs = self.free.get(n)
        if bufs:
            self.held -= n
            buf = bufs.pop()
        else:
            buf = np.empty(n, np.uint8)
        return buf.view(dtype).reshape(shape)

    def give(self, arr) -> None:
        buf = arr.reshape(-1).view("uint8")
        if buf.nbytes > self.limit:
            return
        self.free.setdefault(buf.nbytes, []).append(buf)
        self.held += buf.nbytes
        for n in sorted(self.free, key=lambda n: n == buf.nbytes):  # other sizes go first
            while self.held > self.limit and self.free[n]:
                self.free[n].pop()
                self.held -= n


class Values:
    """The values of one param, drawn piece by piece from the seed: a piece is one of the 8
    slices of the param on its chunk axis (its largest non-layer axis that divides by 8), or the
    whole param. Any region made of whole pieces can be drawn again, in any process."""

    BLOCK = 1 << 23  # indices drawn at once (16 MiB: under glibc's largest mmap threshold)
    _tables: dict = {}

    def __init__(self, path: tuple[str, ...], shape, dtype, layer_axis: int | None, seed: int):
        import numpy as np

        self.path, self.shape, self.dtype = path, tuple(shape), np.dtype(dtype)
        self.name = "/".join(path)
        self.seed = seed
        cands = [i for i, n in enumerate(self.shape) if i != layer_axis and n % FSDP == 0]
        self.axis = max(cands, key=lambda i: (self.shape[i], -i)) if cands else None
        self.scale = path[-1] == "scale"

    def pieces(self) -> list[tuple[slice, ...]]:
        full = [slice(0, n) for n in self.shape]
        if self.axis is None:
            return [tuple(full)]
        step = self.shape[self.axis] // FSDP
        out = []
        for k in range(FSDP):
            idx = list(full)
            idx[self.axis] = slice(k * step, (k + 1) * step)
            out.append(tuple(idx))
        return out

    def _table(self):
        """The 65,536 values a draw picks from: the normal quantiles at (i + 0.5) / 2**16,
        times 0.02 (norm scales: 1 + 0.1 x), in the param's dtype."""
        import statistics

        import numpy as np

        key = (self.scale, self.dtype.str)
        if key not in Values._tables:
            nd = statistics.NormalDist()
            q = np.array([nd.inv_cdf((i + 0.5) / 65536) for i in range(65536)], np.float32)
            q = q * np.float32(0.1) + np.float32(1) if self.scale else q * np.float32(0.02)
            Values._tables[key] = q.astype(self.dtype)
        return Values._tables[key]

    def _draw(self, k: int, out) -> None:
        """Piece ``k``: 16-bit uniform indices from ``default_rng([seed, crc32(path), k])``,
        drawn in blocks of ``BLOCK`` (the stream depends on it), looked up in `_table` (a
        normal distribution, 3x faster to draw than ``standard_normal`` and a cast)."""
        import numpy as np

        rng = np.random.default_rng([self.seed, zlib.crc32(self.name.encode()), k])
        table, flat = self._table(), out.reshape(-1)
        for i in range(0, flat.size, self.BLOCK):
            n = min(self.BLOCK, flat.size - i)
            np.take(table, rng.integers(0, 65536, size=n, dtype=np.uint16), out=flat[i : i + n])

    def region(self, idx, pool: Pool | None = None) -> object:
        """The values of ``idx`` (a tuple of slices made of whole pieces), in a new array (or
        one from ``pool``)."""
        pool = pool or Pool(0)
        idx = tuple(slice(*s.indices(n)[:2]) for s, n in zip(idx, self.shape, strict=True))
        shape = tuple(s.stop - s.start for s in idx)
        out = pool.take(shape, self.dtype)
        for k, piece in enumerate(self.pieces()):
            inside = all(
                r.start <= p.start and p.stop <= r.stop for p, r in zip(piece, idx, strict=True)
            )
            overlap = all(
                p.start < r.stop and r.start < p.stop for p, r in zip(piece, idx, strict=True)
            )
            if not overlap:
                continue
            if not inside:
                raise ValueError(f"{self.name}: region {idx} cuts piece {k} ({piece})")
            sub = tuple(
                slice(p.start - r.start, p.stop - r.start) for p, r in zip(piece, idx, strict=True)
            )
            if sub == tuple(slice(0, n) for n in shape):
                self._draw(k, out)  # the region is this piece: drawn in place
            else:
                part = pool.take(tuple(p.stop - p.start for p in piece), self.dtype)
                self._draw(k, part)
                out[sub] = part
                pool.give(part)
        return out


class LazyArray:
    """A leaf that Orbax saves like a ``jax.Array`` (shape, dtype, sharding), with no data: its
    shards are drawn from ``values`` when written."""

    def __init__(self, values: Values, sharding):
        self.values, self.sharding = values, sharding
        self.shape, self.dtype = values.shape, values.dtype
        self.ndim = len(self.shape)
        self.size = 1
        for n in self.shape:
            self.size *= n
        self.nbytes = self.size * self.dtype.itemsize


_STATS = {"regions": 0, "transactions": 0, "bytes": 0, "draw_s": 0.0, "write_s": 0.0, "wait_s": 0.0}


def _install_lazy_writer() -> None:
    """Orbax's save writes a `LazyArray` shard by shard with the tensorstore spec it built for
    it; every other leaf, and everything else, goes through stock Orbax.

    Two hooks of orbax-checkpoint 0.12.8's array handler: ``transfer_arrays_to_host`` (a lazy
    array becomes ``ReplicaSlices`` with no slices, carrying its global and local shapes and
    sharding, from which Orbax builds its write spec and its metadata) and
    ``async_serialize_from_host`` (given that spec: create the array as Orbax does, then write
    each distinct shard, drawn when its turn comes, in transactions of at most ``TXN_BYTES``).
    The writing blocks the event loop on purpose: one array at a time, one shard drawn ahead
    at most while the previous transaction commits."""
    import dataclasses

    import jax
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import replica_slices as rs
    from orbax.checkpoint._src.serialization import serialization as ser
    from orbax.checkpoint._src.serialization import type_handler_registry as thr

    if getattr(ser, "_realsize_lazy", False):
        return

    @dataclasses.dataclass(frozen=True)
    class LazySlices(rs.ReplicaSlices):
        lazy: LazyArray | None = None

    transfer, serialize = rs.transfer_arrays_to_host, ser.async_serialize_from_host

    def transfer_arrays_to_host(arrays, *a, **kw):
        real = iter(transfer([x for x in arrays if not isinstance(x, LazyArray)], *a, **kw))
        out = []
        for x in arrays:
            if not isinstance(x, LazyArray):
                out.append(next(real))
                continue
            local = x.sharding.shard_shape(x.shape)
            state["left"] += 1
            out.append(LazySlices(x.shape, local, x.sharding, x.dtype, True, [], lazy=x))
        return out

    state: dict = {"txn": None, "held": 0, "pending": None, "pending_bytes": 0, "left": 0}
    state.update(pool=Pool(TXN_BYTES // 2), bufs=[], pending_bufs=[])

    def wait_pending() -> None:
        if state["pending"] is not None:
            t = time.perf_counter()
            state["pending"].result()
            _STATS["wait_s"] += time.perf_counter() - t
            state["pending"], state["pending_bytes"] = None, 0
            for buf in state["pending_bufs"]:  # no longer referenced by tensorstore
                state["pool"].give(buf)
            state["pending_bufs"] = []

    def flush(wait: bool) -> None:
        """Commits the open transaction (after the one committing before it)."""
        wait_pending()
        if state["txn"] is not None:
            state["pending"], state["pending_bytes"] = state["txn"].commit_async(), state["held"]
            state["pending_bufs"], state["bufs"] = state["bufs"], []
            state["txn"], state["held"] = None, 0
            _STATS["transactions"] += 1
        if wait:
            wait_pending()

    def txn():
        if state["txn"] is None:
            state["txn"] = ts.Transaction()
        return state["txn"]

    async def async_serialize_from_host(rslices, tspec, **kw):
        if not isinstance(rslices, LazySlices):
            return await serialize(rslices, tspec, **kw)
        x = rslices.lazy
        context = kw.get("context")
        # created in the open transaction, as Orbax creates it in its own; then a handle
        # without one (no I/O), rebound to each transaction the shards are written in
        ts.open(ts.Spec(tspec), create=True, open=True, context=context, transaction=txn()).result()
        t = ts.open(ts.Spec(tspec), open=True, assume_metadata=True, context=context).result()
        regions, seen = [], set()
        for idx in x.sharding.devices_indices_map(x.shape).values():
            key = tuple(s.indices(n)[:2] for s, n in zip(idx, x.shape, strict=True))
            if key not in seen:
                seen.add(key)
                regions.append(idx)
        for idx in regions:
            nbytes = x.dtype.itemsize
            for s, n in zip(idx, x.shape, strict=True):
                a, b = s.indices(n)[:2]
                nbytes *= b - a
            if state["pending_bytes"] + state["held"] + nbytes > 2 * TXN_BYTES:
                wait_pending()  # at most two transactions' bytes held
            t0 = time.perf_counter()
            data = x.values.region(idx, state["pool"])  # while the previous one commits
            _STATS["draw_s"] += time.perf_counter() - t0
            if state["held"] and state["held"] + nbytes > TXN_BYTES:
                flush(wait=False)
            t0 = time.perf_counter()
            write = t.with_transaction(txn())[idx].write(
                data, can_reference_source_data_indefinitely=True
            )
            write.result()
            _STATS["write_s"] += time.perf_counter() - t0
            state["held"] += nbytes
            state["bufs"].append(data)
            _STATS["regions"] += 1
            _STATS["bytes"] += nbytes
            del data
        state["left"] -= 1
        if state["left"] == 0:  # the last lazy array of this save
            flush(wait=True)

    rs.transfer_arrays_to_host = transfer_arrays_to_host
    ser.async_serialize_from_host = async_serialize_from_host
    thr.register_type_handler(LazyArray, thr.get_type_handler(jax.Array), override=True)
    ser._realsize_lazy = True


def orbax_save(root: Path, step: int, item: str, tree, *, zarr3: bool, custom, tfs) -> None:
    import orbax.checkpoint as ocp
    from etils import epath

    manager = ocp.CheckpointManager(
        epath.Path(root),
        item_handlers={item: ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=zarr3)},
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
    )
    try:
        save = ocp.args.PyTreeSave(tree, ocdbt_target_data_file_size=tfs)
        args = ocp.args.Composite(**{item: save})
        manager.save(step, args=args, custom_metadata=custom, force=True)
        manager.wait_until_finished()
    finally:
        manager.close()


def _rng_leaf(x, rng, sharding):
    """A value for an RNG leaf of MaxText's model (typed keys stay typed)."""
    import jax
    import numpy as np

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(jax.random.key(0, impl="unsafe_rbg"))
        assert str(x.dtype) == str(jax.random.key(0, impl=impl).dtype), x.dtype
        n = 1
        for d in x.shape:
            n *= d
        keys = jax.random.split(jax.random.key(int(rng.integers(2**31)), impl=impl), max(n, 1))
        keys = keys.reshape(x.shape) if x.shape else keys[0]
        return jax.device_put(keys, sharding)
    return jax.device_put(np.zeros(x.shape, x.dtype), sharding)


def step_tree(params: dict, *, lazy: bool):
    """``(item name, tree, zarr3, custom_metadata, step number)`` of a step; ``lazy``: params
    are `LazyArray` leaves (the builder), else ``jax.Array``s holding the same values (the
    stock saves of ``prove``)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    flat, aux, axes = abstract(params["model_keys"])
    devices = jax.devices()
    if params["chunks"] == "fsdp" and len(devices) < FSDP:
        raise RuntimeError(f"{FSDP} devices needed, JAX has {len(devices)} (XLA_FLAGS)")
    mesh = Mesh(np.array(devices[:FSDP]), ("fsdp",))
    leaves = {}
    for path, x in sorted(flat.items()):
        v = Values(path, x.shape, x.dtype, axes.get(path), params["seed"])
        if params["chunks"] == "single":
            sharding = SingleDeviceSharding(devices[0])
        else:
            spec = [None] * len(v.shape)
            if v.axis is not None:
                spec[v.axis] = "fsdp"
            sharding = NamedSharding(mesh, PartitionSpec(*spec))
        if lazy:
            leaves[path] = LazyArray(v, sharding)
        else:
            leaves[path] = jax.make_array_from_callback(v.shape, sharding, v.region)
    if params["layout"] == "maxtext":
        return "items", {"params": {"params": unflat_tree(leaves)}}, True, {"scan_layers": True}, 0
    rng = np.random.default_rng([params["seed"], 1])
    replicated = NamedSharding(mesh, PartitionSpec())
    for path, x in sorted(aux.items()):
        leaves[path] = _rng_leaf(x, rng, replicated)
    tree = unflat_tree({(*p, "value"): v for p, v in leaves.items()})
    return "model_params", tree, False, None, 1


def build_lora(root: Path, params: dict) -> None:
    """A Tunix LoRA adapter step (rank 16, alpha 32, 7 modules) at ``root/1``."""
    import math

    import numpy as np

    sys.path.insert(0, str(REPO / "tests"))
    from lora_writers import write_adapters

    flat, _aux, axes = abstract(params["model_keys"])
    layers = params["layers"]
    rng = np.random.default_rng([params["seed"], 2])
    # factor std s: |scale * (a @ b)| ~ (alpha / r) * sqrt(r) * s^2 = 0.02, the weights' std
    s = math.sqrt(0.02 / ((ALPHA / RANK) * math.sqrt(RANK)))
    factors = {}
    for module, k in LORA_MODULES.items():
        path = ("decoder", "layers", *module.split("/"), "kernel")
        shape, ax = flat[path].shape, axes[path]
        per = shape[:ax] + shape[ax + 1 :]
        rows, cols = math.prod(per[:k]), math.prod(per[k:])
        for leaf, fshape in (
            ("kernel_lora_a", (rows, layers, RANK)),
            ("kernel_lora_b", (RANK, layers, cols)),
        ):
            x = rng.standard_normal(fshape, np.float32)
            x *= s
            factors[(*path[:-1], leaf)] = x
    write_adapters(root, 1, factors)


def _ocdbt_sizes(item_dir: Path) -> dict[str, int]:
    """``{key: stored bytes}`` of an OCDBT database, from its B-tree (no value is read)."""
    import tensorstore as ts

    base = ts.KvStore.open(f"file://{item_dir.resolve()}/").result()
    manifest = ts.ocdbt.dump(base).result()
    out: dict[str, int] = {}

    def walk(location: str, prefix: bytes) -> None:
        node = ts.ocdbt.dump(base, node=location).result()
        for e in node.get("entries", []):
            if node.get("height", 0):
                walk(e["location"], prefix + (e.get("subtree_common_prefix") or b""))
            elif "inline_value" in e:
                out[(prefix + e["key"]).decode()] = len(e["inline_value"])
            else:
                out[(prefix + e["key"]).decode()] = int(str(e["indirect_value"]).rsplit(":", 1)[-1])

    walk(manifest["versions"][-1]["root"]["location"], b"")
    return out


def _item_layout(item_dir: Path) -> dict:
    """Per array: its shape, outer chunk (stored shard) and inner chunk shapes, codec, and the
    number and largest size of its stored chunk keys."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item_dir.resolve()}/"}).result()
    arrays: dict = {}
    for key, size in sorted(_ocdbt_sizes(item_dir).items()):
        name, _, rest = key.partition("/")
        a = arrays.setdefault(name, {"chunk_keys": 0, "largest_chunk_bytes": 0})
        if rest in ("zarr.json", ".zarray"):
            meta = json.loads(kv.read(key.encode()).result().value)
            a["zarr"] = 3 if rest == "zarr.json" else 2
            a["shape"] = meta["shape"]
            a["dtype"] = meta.get("data_type") or meta.get("dtype")
            if rest == "zarr.json":
                a["outer_chunk"] = meta["chunk_grid"]["configuration"]["chunk_shape"]
                codec = meta["codecs"][0]
                a["codec"] = codec["name"]
                if codec["name"] == "sharding_indexed":
                    a["inner_chunk"] = codec["configuration"]["chunk_shape"]
            else:
                a["outer_chunk"] = meta["chunks"]
                a["codec"] = (meta.get("compressor") or {}).get("id")
        elif rest:
            a["chunk_keys"] += 1
            a["largest_chunk_bytes"] = max(a["largest_chunk_bytes"], size)
    return arrays


def build(work: Path, name: str, params: dict, out_json: Path) -> None:
    """Builds step ``name`` under ``work/name``; writes its figures to ``out_json``."""
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    root = work / name
    tfs = params.get("target_file_size")
    if params["layout"] == "lora":
        build_lora(root, params)
    else:
        _install_lazy_writer()
        item, tree, zarr3, custom, n = step_tree(params, lazy=True)
        orbax_save(root, n, item, tree, zarr3=zarr3, custom=custom, tfs=tfs)
    wall = time.perf_counter() - t0
    hwm = vm_hwm_kib()
    step = step_path(work, name)
    item = step / ("items" if params["layout"] == "maxtext" else "model_params")
    files = [f for f in step.rglob("*") if f.is_file()]
    out = {
        "build_s": round(wall, 1),
        "peak_rss_kib": hwm,
        "step_bytes": du(step),
        "files": len(files),
        "data_files": sum(1 for f in files if f.parent.name == "d"),
        "writes": {k: round(v, 1) for k, v in _STATS.items()},
        "arrays": _item_layout(item),
    }
    out_json.write_text(json.dumps(out))


# == the check of a built step (its own process) =================================================
def check_step(work: Path, name: str, params: dict, out_json: Path) -> None:
    """Stock Orbax reads the step: its metadata (every param, shape and dtype of MaxText's
    model) and several arrays, which must equal the values drawn again from the seed. Writes
    what it checked to ``out_json``; raises on a difference."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from etils import epath

    step = step_path(work, name)
    if params["layout"] == "lora":
        meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(step / "model_params")).tree
        n = len(jax.tree_util.tree_leaves(meta))
        out_json.write_text(json.dumps({"leaves": n, "problems": []}))
        return
    flat, _aux, axes = abstract(params["model_keys"])
    tunix = params["layout"] == "tunix"
    item = step / ("model_params" if tunix else "items")
    handler = ocp.PyTreeCheckpointHandler()
    meta = handler.metadata(epath.Path(item)).tree
    got = flat_tree(meta["params"]["params"] if not tunix else meta)
    if tunix:
        got = {p[:-1]: v for p, v in got.items() if p[-1] == "value" and p[:-1] in flat}
    problems = []
    for path, x in flat.items():
        m = got.get(path)
        if m is None:
            problems.append(f"{'/'.join(path)}: missing in Orbax's metadata")
        elif tuple(m.shape) != tuple(x.shape) or np.dtype(m.dtype) != np.dtype(x.dtype):
            problems.append(f"{'/'.join(path)}: {m.shape} {m.dtype}, want {x.shape} {x.dtype}")
    # several arrays: every param of at most 300 MiB, and the smallest above it
    sizes = sorted((x.size * np.dtype(x.dtype).itemsize, p) for p, x in flat.items())
    chosen = [p for b, p in sizes if b <= 300 * MIB]
    chosen += [p for b, p in sizes if b > 300 * MIB][:1]
    device = jax.devices()[0]
    with_sharding = set(chosen[:2])  # restored as jax.Arrays on a given sharding
    sub, args = {}, {}
    for p in chosen:
        q = (*p, "value") if tunix else ("params", "params", *p)
        sub[q] = meta_leaf = flat_tree(meta)[q]
        if p in with_sharding:
            args[q] = ocp.ArrayRestoreArgs(
                sharding=jax.sharding.SingleDeviceSharding(device),
                global_shape=tuple(meta_leaf.shape),
                dtype=meta_leaf.dtype,
            )
        else:
            args[q] = ocp.RestoreArgs(restore_type=np.ndarray)
    restored = handler.restore(
        epath.Path(item),
        args=ocp.args.PyTreeRestore(
            item=unflat_tree(sub), restore_args=unflat_tree(args), partial_restore=True
        ),
    )
    restored = flat_tree(restored)
    checked = []
    for p in chosen:
        q = (*p, "value") if tunix else ("params", "params", *p)
        v = Values(p, flat[p].shape, flat[p].dtype, axes.get(p), params["seed"])
        want = v.region(tuple(slice(0, n) for n in v.shape))
        arr = restored[q]
        kind = "jax.Array" if isinstance(arr, jax.Array) else "numpy"
        a = np.asarray(arr)
        if a.shape != want.shape or a.dtype != want.dtype or a.tobytes() != want.tobytes():
            problems.append(f"{'/'.join(p)}: restored values differ from the seed's")
        checked.append({"param": "/".join(p), "bytes": want.nbytes, "as": kind})
        del a, arr, want
        restored.pop(q)
    out = {"params_in_metadata": len(got), "arrays_checked": checked, "problems": problems}
    out_json.write_text(json.dumps(out))
    if problems:
        raise SystemExit("\n".join(problems))
