"""Benchmark (issue 30): every streaming operation of the CLI on real-size steps, against ``cp -r``.

    V=$(ls -d /root/.cache/orbax-maxtext-layout/interop-venv-*)
    # the real-size run: about 40 GiB of steps under --work (kept for the next run), and up
    # to 15 GiB of output at a time (deleted after each operation); steps built in ~15 min
    PYTHONPATH=$PWD $V/bin/python bench/realsize.py --work /tmp/omtl-realsize --json realsize.json
    # a quick run on cut models (about 2.5 GB per llama step)
    PYTHONPATH=$PWD $V/bin/python bench/realsize.py --layers 2 --moe-layers 1 --max-shard-size 1GiB
    # the builder against stock Orbax saves of the same values (small; exit 1 on any difference)
    PYTHONPATH=$PWD $V/bin/python bench/realsize.py prove --layers 2 --moe-layers 1

Run it with the interop venv's Python (MaxText 0.2.5, Python 3.12); every child runs with the
same interpreter, on JAX's CPU backend. The orchestrator and the measuring wrapper import the
standard library only.

**The steps** are built once in ``--work`` (default ``/tmp/omtl-realsize``), each by a child
process, and reused by later runs while ``<work>/<step>.step.json`` records the same
parameters (``--layers``, ``--moe-layers``, ``--seed``):

- ``llama-fsdp`` (``<work>/llama-fsdp/0``): MaxText's unmodified ``llama3.1-8b`` (8.03 B
  params, ``weight_dtype=bfloat16``, ``scan_layers=true``, ``param_scan_axis`` 1; with
  ``--layers N`` below 32, ``override_model_config=true base_num_decoder_layers=N``), a
  param-only MaxText step: ``items`` holds ``params/params/{decoder,token_embedder}/...``,
  Orbax OCDBT + zarr3, ``custom_metadata={"scan_layers": true}`` in ``_CHECKPOINT_METADATA``.
  The tree and shapes are MaxText's own abstract model
  (`orbax_maxtext_layout.model.maxtext_config.abstract_model`). It is saved as from 8 devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=8``), each param sharded on its largest
  non-layer axis that divides by 8 (replicated if none), so each array is stored as 8
  per-device chunks, each spanning every layer (issue 30's step; MaxText's own fsdp rules
  would shard most kernels on their embed axis instead, e.g. ``wi_0`` on axis 0, not 2). Values: normal * 0.02 (norm scales 1 + normal * 0.1) in bf16, drawn per
  piece (the 8 fsdp slices of a param) from ``default_rng([seed, crc32(param path), piece])``
  as 16-bit indices into the normal quantiles (`Values`).
- ``llama-onechunk`` (``<work>/llama-onechunk/0``): the same values, saved as from one device
  (``SingleDeviceSharding``): one stored chunk per array, except that Orbax splits an array
  larger than its 2 GiB OCDBT target file size: at 32 layers each MLP kernel (3.76 GB) is
  stored as 2 chunks of (4096, 32, 7168) or (7168, 32, 4096), 1.88 GB decoded, one zstd frame
  each, both spanning all layers.
- ``tunix-fsdp`` (``<work>/tunix-fsdp/1``): the same model in Tunix's layout, as google-tunix
  0.1.7 saves ``nnx.state(model)`` (``model_params`` only, a ``value`` level on every leaf,
  zarr2, the RNG state of MaxText's model included), 8-way fsdp chunks, the same weights.
  ``convert`` skips steps that already hold MaxText ``items/``, so ``convert --unroll`` and
  ``verify`` need this step.
- ``lora16`` (``<work>/lora16/1``): a Tunix LoRA adapter step on ``llama-fsdp``'s model:
  rank 16, alpha 32, qwix factors of all 7 modules (query, key, value, out, wi_0, wi_1, wo),
  float32, written by `tests/lora_writers.write_adapters` (stock Orbax).
- ``moe-cut`` (``<work>/moe-cut/0``): MaxText's ``qwen3-30b-a3b`` (128 experts) cut to
  ``--moe-layers`` (default 4: 6.2 GB of bf16 weights) with ``override_model_config=true``,
  otherwise as ``llama-fsdp``.

How a step is built without holding the model: stock Orbax saves it (``CheckpointManager``,
``PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=...)``, as bench/export_hf.py saves its
step), so every file but the chunks' bytes is Orbax's own (``_METADATA``, ``_sharding``,
``array_metadatas``, the per-process OCDBT database and its merge, the commit files), and each
array's tensorstore spec (zarr metadata, chunk grid, codecs, kvstore) is the one Orbax builds.
Only the writing of each array's bytes is replaced: each leaf is a lazy array (shape, dtype,
sharding, no data) and its shards are generated and written one at a time with that spec, in
transactions of at most 1 GiB (a one-chunk array's shard in one transaction). ``prove``
checks it against stock Orbax saves of the same values from real ``jax.Array``s (every JSON
file, every key and every stored value byte for byte) and against MaxText 0.2.5's own
``save_checkpoint``; after each build a child restores the step's metadata and several
arrays with stock Orbax and compares them with the values drawn again from the seed.

**The operations**, each in a fresh child process, with a fresh output directory deleted
right after (then ``sync``); the step's files are read once, untimed, before each:

- ``cp``: ``cp -r STEP OUT`` of every step measured (once untimed first; the floor);
- ``export-hf`` (llama-fsdp, llama-onechunk, moe-cut): ``python -m orbax_maxtext_layout
  export-hf STEP --out OUT --memory-budget BUDGET --hf-model-path tests/fixtures/hf_tokenizer
  [--override-model-architecture] [--max-shard-size S] --maxtext-config <base.yml> <keys>``;
- ``export-hf-2p`` (the llama steps): the same with ``--process-index i --process-count 2``,
  both processes started together: wall until both exit, bytes summed, each one's peak RSS;
- ``merge-lora`` (lora16): ``merge-lora LORA --base LLAMA_FSDP --alpha 32 --out OUT
  --memory-budget BUDGET``;
- ``export-adapter`` (lora16): ``export-hf LORA --adapter --alpha 32 --out OUT
  --maxtext-config <base.yml> <keys>``, the adapters as a PEFT adapter (issue 31);
- ``convert-unroll`` (tunix-fsdp): ``convert ROOT --unroll --out OUT --optimizer drop
  --memory-budget BUDGET -q --maxtext-config <base.yml> <keys>``, then ``verify`` of that
  output (its ``model_params`` hard-linked beside ``items/``), timed alone;
- ``floor-decode`` (the llama steps, tunix-fsdp, moe-cut) and ``floor-codec`` (tunix-fsdp):
  ``bench/floor.py STEP [--encode 1]``, every stored chunk of the step decoded once on both
  cores with the package's reader (and re-encoded at zstd level 1), nothing written: what
  this machine spends at least. Each row of ``export-hf`` and ``convert-unroll`` gets its
  floor (``FLOOR_OF``; ``verify``'s is two decode passes, both sides) as ``floor_s``,
  ``x_floor`` and ``floor_x_cp`` (a ``cp -r`` goal below ``floor_x_cp`` is out of this
  machine's reach); ``export-hf-2p`` gets ``x_one_process_floor``, one process's CPU seconds
  spread over 2 cores, as a share of its wall time;
- ``baseline``: a child that imports what the operations import (jax with its CPU backend up,
  MaxText's exporter module, Orbax, safetensors, the package) and exits.

Each command runs under a standard-library wrapper: wall time from start to exit; peak RSS
from ``wait4``'s rusage (the VmHWM of the process and of any process it reaped); the
``rchar``/``read_bytes``/``wchar``/``write_bytes`` of ``/proc/<pid>/io``, read after the
process exited and before it is reaped (``waitid(..., WNOWAIT)``), which includes the
processes it reaped. ``rchar`` counts bytes through ``read(2)``-family calls (from the page
cache too); bytes read through ``mmap`` are not in it (the minor faults are in the JSON).
A step's stored chunks and safetensors tensors are read with ``preadv`` (issue 58; from
2026-12-06 to issue 58 they were mapped where the kernel populates a mapped range in one
call, and not in ``rchar`` there). Each chunk is decoded once: the tests check that through
``io_counts``'s "chunk decoded".
"over baseline" subtracts the baseline's peak RSS and its ``rchar`` (the imports).
Medians of ``--repeats`` (peak RSS: the largest). ``--before DIR`` also runs every operation
with another checkout's package first on ``PYTHONPATH``, side by side.

**The goals** of issue 30, held or not held per row: ``export-hf`` of the llama steps ≤ 5x
``cp -r`` of the step, ``rchar`` over imports ≤ 1.25x the step on disk, RSS over baseline ≤
budget + 512 MiB; ``merge-lora`` ≤ 5x ``cp -r`` of the base, same RSS bound; ``convert
--unroll`` ≤ 3x ``cp -r``, ``verify`` ≤ 2x; ``export-hf`` with 2 processes ≤ 0.6x one
process. The outputs of ``export-hf`` are hashed before deletion: the two llama chunkings,
and 1 and 2 processes, must write identical files.

Exit status 1 if a build or an operation fails or the export outputs differ (goals not held
do not fail the run).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

from export_hf import parse_size  # bench/export_hf.py's (standard library only at its top)

# Standard library only at the top: the orchestrator and the wrapper must stay small (a
# child's ru_maxrss starts from its parent's high-water mark).
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PKG = "orbax_maxtext_layout"
TOKENIZER = REPO / "tests" / "fixtures" / "hf_tokenizer"
BUILD_VERSION = 2  # bump when the builder writes other bytes
LLAMA_LAYERS, MOE_LAYERS = 32, 48
RANK, ALPHA = 16, 32
LORA_MODULES = {  # module -> number of leading contracting dims of its per-layer kernel
    "self_attention/query": 1,
    "self_attention/key": 1,
    "self_attention/value": 1,
    "self_attention/out": 2,
    "mlp/wi_0": 1,
    "mlp/wi_1": 1,
    "mlp/wo": 1,
}
FSDP = 8
TXN_BYTES = 1 << 30  # decoded bytes per write transaction (fsdp shards)
STEPS = {
    "llama-fsdp": {"model": "llama", "layout": "maxtext", "chunks": "fsdp"},
    "llama-onechunk": {"model": "llama", "layout": "maxtext", "chunks": "single"},
    "tunix-fsdp": {"model": "llama", "layout": "tunix", "chunks": "fsdp"},
    "lora16": {"model": "llama", "layout": "lora"},
    "moe-cut": {"model": "moe", "layout": "maxtext", "chunks": "fsdp"},
}
OPS = (
    "cp",
    "export-hf",
    "export-hf-2p",
    "merge-lora",
    "export-adapter",
    "convert-unroll",
    "verify",
    "floor-decode",
    "floor-codec",
    "baseline",
)
APPLICABLE = {
    "llama-fsdp": ("floor-decode", "export-hf", "export-hf-2p"),
    "llama-onechunk": ("floor-decode", "export-hf", "export-hf-2p"),
    "tunix-fsdp": ("floor-decode", "floor-codec", "convert-unroll", "verify"),
    "lora16": ("merge-lora", "export-adapter"),
    "moe-cut": ("floor-decode", "export-hf"),
}
# The floor of an operation (`bench/floor.py`, measured on the same step in the same run):
# what it must at least spend on this machine's 2 cores, decoding (and re-encoding) every byte.
FLOOR_OF = {
    "export-hf": "floor-decode",
    "export-hf-2p": "floor-decode",
    "convert-unroll": "floor-codec",
    "verify": "floor-decode",  # twice: both sides (`_floor_wall`)
}
MIB, GIB = 1 << 20, 1 << 30


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def child_env(pythonpath: list[Path] | None, devices: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("XLA_FLAGS", None)
    env.update(
        {
            "JAX_PLATFORMS": "cpu",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONHASHSEED": "0",
        }
    )
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    return env


def base_yml() -> Path:
    spec = importlib.util.find_spec("maxtext")  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise SystemExit("maxtext is not installed: run this with the interop venv's Python")
    return Path(spec.origin).parent / "configs" / "base.yml"


def model_keys(model: str, layers: int) -> list[str]:
    """MaxText's config overrides (after ``base.yml``) of a step's model."""
    if model == "llama":
        keys = ["model_name=llama3.1-8b", "weight_dtype=bfloat16", "scan_layers=true"]
        if layers != LLAMA_LAYERS:
            keys += ["override_model_config=true", f"base_num_decoder_layers={layers}"]
        return keys
    assert model == "moe", model
    keys = ["model_name=qwen3-30b-a3b", "weight_dtype=bfloat16", "scan_layers=true"]
    if layers != MOE_LAYERS:
        keys += ["override_model_config=true", f"base_num_decoder_layers={layers}"]
    return keys


def step_params(name: str, layers: int, moe_layers: int, seed: int) -> dict:
    kind = STEPS[name]
    n = moe_layers if kind["model"] == "moe" else layers
    return {
        "name": name,
        **kind,
        "layers": n,
        "model_keys": model_keys(kind["model"], n),
        "seed": seed,
        "version": BUILD_VERSION,
    }


def step_path(work: Path, name: str) -> Path:
    """The step directory the operations take (``<root>/<n>``)."""
    layout = STEPS[name]["layout"]
    return work / name / ("0" if layout == "maxtext" else "1")


# == the builder (its own process; heavy imports inside) ========================================
def _flat(tree, prefix=()) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, (*prefix, str(k))))
        else:
            out[(*prefix, str(k))] = v
    return out


def _unflat(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def _abstract(keys: list[str]):
    """MaxText's abstract items for ``keys``: ``(flat params, flat nnx_aux.model, layer axes)``,
    model paths (no ``params/params`` prefix)."""
    import contextlib

    import jax

    from orbax_maxtext_layout.model.maxtext_config import abstract_model

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


def _orbax_save(root: Path, step: int, item: str, tree, *, zarr3: bool, custom, tfs) -> None:
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

    flat, aux, axes = _abstract(params["model_keys"])
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
        return "items", {"params": {"params": _unflat(leaves)}}, True, {"scan_layers": True}, 0
    rng = np.random.default_rng([params["seed"], 1])
    replicated = NamedSharding(mesh, PartitionSpec())
    for path, x in sorted(aux.items()):
        leaves[path] = _rng_leaf(x, rng, replicated)
    tree = _unflat({(*p, "value"): v for p, v in leaves.items()})
    return "model_params", tree, False, None, 1


def _vm_hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def build_lora(root: Path, params: dict) -> None:
    """A Tunix LoRA adapter step (rank 16, alpha 32, 7 modules) at ``root/1``."""
    import math

    import numpy as np

    sys.path.insert(0, str(REPO / "tests"))
    from lora_writers import write_adapters

    flat, _aux, axes = _abstract(params["model_keys"])
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
        _orbax_save(root, n, item, tree, zarr3=zarr3, custom=custom, tfs=tfs)
    wall = time.perf_counter() - t0
    hwm = _vm_hwm_kib()
    step = step_path(work, name)
    item = step / ("items" if params["layout"] == "maxtext" else "model_params")
    files = [f for f in step.rglob("*") if f.is_file()]
    out = {
        "build_s": round(wall, 1),
        "peak_rss_kib": hwm,
        "step_bytes": _du(step),
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
    flat, _aux, axes = _abstract(params["model_keys"])
    tunix = params["layout"] == "tunix"
    item = step / ("model_params" if tunix else "items")
    handler = ocp.PyTreeCheckpointHandler()
    meta = handler.metadata(epath.Path(item)).tree
    got = _flat(meta["params"]["params"] if not tunix else meta)
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
        sub[q] = meta_leaf = _flat(meta)[q]
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
            item=_unflat(sub), restore_args=_unflat(args), partial_restore=True
        ),
    )
    restored = _flat(restored)
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


# == prove: the builder against stock Orbax ======================================================
def stock_save(work: Path, name: str, params: dict, how: str, out_json: Path) -> None:
    """The same step saved by stock Orbax from real ``jax.Array``s (``how="v0"``: the
    ``CheckpointManager``, as the builder; ``"maxtext"``: MaxText 0.2.5's own
    ``save_checkpoint`` through Orbax v1's ``training.Checkpointer``)."""
    import logging
    import types

    logging.getLogger("absl").setLevel(logging.ERROR)
    item, tree, zarr3, custom, n = step_tree(params, lazy=False)
    root = work / name
    if how == "v0":
        _orbax_save(
            root, n, item, tree, zarr3=zarr3, custom=custom, tfs=params.get("target_file_size")
        )
    else:
        from maxtext.common import checkpointing

        assert item == "items" and params.get("target_file_size") is None, params
        manager = checkpointing.create_orbax_checkpoint_manager(str(root), True, False, 1)
        try:
            config = types.SimpleNamespace(scan_layers=True)
            checkpointing.save_checkpoint(manager, n, tree, config, force=True)
        finally:
            manager.close()
    out_json.write_text(json.dumps({"peak_rss_kib": _vm_hwm_kib()}))


def compare_steps(mine: Path, stock: Path) -> dict:
    """Every file of two steps: the same names (OCDBT data files aside), equal JSON (the commit
    times and the temporary path Orbax names in ``commit_success.txt`` aside), and per OCDBT
    item the same keys with byte-identical values."""
    import tensorstore as ts

    def files(d: Path) -> dict[str, Path]:
        return {str(f.relative_to(d)): f for f in d.rglob("*") if f.is_file()}

    def ocdbt_file(rel: str) -> bool:
        parts = rel.split("/")
        return "d" in parts[:-1] or parts[-1] == "manifest.ocdbt"

    fa, fb = files(mine), files(stock)
    diffs = []
    na = {r for r in fa if not ocdbt_file(r)}
    nb = {r for r in fb if not ocdbt_file(r)}
    diffs += [f"only in the built step: {r}" for r in sorted(na - nb)]
    diffs += [f"only in the stock step: {r}" for r in sorted(nb - na)]
    same_files = []
    for rel in sorted(na & nb):
        a, b = fa[rel].read_text(), fb[rel].read_text()
        if rel.endswith("commit_success.txt"):
            a, b = (re.sub(r" to .*", "", x) for x in (a, b))
        elif rel.endswith("_CHECKPOINT_METADATA"):
            ja, jb = json.loads(a), json.loads(b)
            for j in (ja, jb):
                j.pop("init_timestamp_nsecs", None)
                j.pop("commit_timestamp_nsecs", None)
            if ja != jb:
                keys = sorted(k for k in set(ja) | set(jb) if ja.get(k) != jb.get(k))
                diffs.append(
                    f"{rel}: differs in {keys}: {[ja.get(k) for k in keys]} vs {[jb.get(k) for k in keys]}"
                )
            else:
                same_files.append(rel)
            continue
        if a != b:
            diffs.append(f"{rel}: differs")
        else:
            same_files.append(rel)
    items = sorted(str(Path(r).parent) for r in na & nb if Path(r).name == "_METADATA")
    values = 0
    for item in items:
        kvs = [
            ts.KvStore.open({"driver": "ocdbt", "base": f"file://{(d / item).resolve()}/"}).result()
            for d in (mine, stock)
        ]
        ka, kb = (set(kv.list().result()) for kv in kvs)
        diffs += [f"{item}: key only in the built step: {k!r}" for k in sorted(ka - kb)]
        diffs += [f"{item}: key only in the stock step: {k!r}" for k in sorted(kb - ka)]
        for k in sorted(ka & kb):
            if kvs[0].read(k).result().value != kvs[1].read(k).result().value:
                diffs.append(f"{item}: {k.decode()}: other bytes")
            values += 1
    return {
        "same_files": same_files,
        "values_compared": values,
        "data_files": [sum(1 for r in f if Path(r).parent.name == "d") for f in (fa, fb)],
        "bytes": [_du(mine), _du(stock)],
        "diffs": diffs,
    }


def prove(argv: list[str]) -> int:
    """Each step built by the builder and saved by stock Orbax from real jax.Arrays holding
    the same values (llama-fsdp also by MaxText 0.2.5's own save_checkpoint), at a small size:
    every JSON file, every OCDBT key and every stored value must be byte-identical. Exit 1 on
    any difference."""
    ap = argparse.ArgumentParser(prog="realsize.py prove", description=prove.__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--moe-layers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--only",
        nargs="+",
        default=["llama-fsdp", "llama-onechunk", "llama-onechunk@256MiB", "tunix-fsdp", "moe-cut"],
        help="steps (NAME@SIZE: with that OCDBT target data file size, so that Orbax subchunks)",
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/omtl-realsize-prove"))
    ap.add_argument("--keep", action="store_true", help="keep the steps written")
    args = ap.parse_args(argv)
    if args.layers > 4 or args.moe_layers > 2:
        raise SystemExit(
            "prove holds whole stock steps in memory: keep --layers <= 4, --moe-layers <= 2"
        )
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    report, failed = [], False
    for spec in args.only:
        name, _, size = spec.partition("@")
        params = step_params(name, args.layers, args.moe_layers, args.seed)
        if size:
            params["target_file_size"] = parse_size(size)
        hows = ["v0", "maxtext"] if name == "llama-fsdp" else ["v0"]
        dirs = {}
        for how in ["lazy", *hows]:
            d = work / how / spec.replace("@", "-")
            d.mkdir(parents=True)
            verb = ["build", str(d), name] if how == "lazy" else ["stock", str(d), name, how]
            res = _wrapped(
                [[sys.executable, __file__, *verb, json.dumps(params), d / f"{how}.json"]],
                child_env([REPO], devices=FSDP),
                d,
                [d / f"{how}.log"],
            )
            p = res["procs"][0]
            if p["rc"] != 0:
                print(f"{spec} {how}: failed\n{_tail(d / f'{how}.log')}", file=sys.stderr)
                failed = True
                break
            dirs[how] = (d / name, p)
            print(
                f"{spec}: {how} written in {res['wall']:.1f} s, peak RSS {p['maxrss_kib'] / 1024:.0f} MiB",
                file=sys.stderr,
            )
        else:
            for how in hows:
                got = compare_steps(dirs["lazy"][0], dirs[how][0])
                got.update(
                    step=spec,
                    against=how,
                    build_peak_mib=[round(dirs[h][1]["maxrss_kib"] / 1024) for h in ("lazy", how)],
                )
                failed |= bool(got["diffs"]) and not (
                    how == "maxtext" and _only_handler_name(got["diffs"])
                )
                report.append(got)
                print(json.dumps({k: v for k, v in got.items() if k != "same_files"}), flush=True)
        for how in dirs:
            if not args.keep:
                shutil.rmtree(work / how / spec.replace("@", "-"), ignore_errors=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print("builder == stock Orbax" if not failed else "DIFFERENCES (see above)")
    return 1 if failed else 0


def _only_handler_name(diffs: list[str]) -> bool:
    """MaxText's v1 save names Orbax v1's PyTreeHandler in ``_CHECKPOINT_METADATA``; nothing
    else may differ."""
    return all("_CHECKPOINT_METADATA: differs in ['item_handlers']" in d for d in diffs)


# == the baseline child ===========================================================================
def baseline() -> None:
    """Imports what the operations import, brings up jax's CPU backend, and does nothing."""
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):
        import jax
        import maxtext.checkpoint_conversion.to_huggingface  # noqa: F401
        import orbax.checkpoint  # noqa: F401
        import safetensors  # noqa: F401
        import tensorstore  # noqa: F401

        import orbax_maxtext_layout
        import orbax_maxtext_layout.cli  # noqa: F401

        jax.numpy.zeros(8).block_until_ready()


# == the wrapper (standard library only) ==========================================================
def _proc_io(pid: int) -> dict:
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("rchar", "wchar", "read_bytes", "write_bytes"):
            out[k] = int(v)
    return out


def wrap(spec_file: Path) -> None:
    """Starts the commands of ``spec_file`` together; prints, as JSON, the wall time until the
    last exits and, per command, its exit code, wall time, peak RSS (``wait4``'s rusage: its
    VmHWM and that of any process it reaped) and its ``/proc/<pid>/io`` read after it exited,
    before it is reaped."""
    spec = json.loads(spec_file.read_text())
    procs, results = {}, [None] * len(spec["cmds"])
    t0 = time.perf_counter()
    for i, (cmd, log) in enumerate(zip(spec["cmds"], spec["logs"], strict=True)):
        f = open(log, "wb")  # closed when the process is reaped
        p = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=spec["cwd"],
            env=spec["env"],
            start_new_session=True,
        )
        procs[p.pid] = (i, p, f, time.perf_counter())
    killed = []

    def kill() -> None:
        for _i, p, _f, _t in procs.values():
            if p.returncode is None:
                killed.append(p.pid)
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass

    timer = threading.Timer(spec["timeout"], kill)
    timer.daemon = True
    timer.start()
    end = t0
    while any(r is None for r in results):
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        pid = info.si_pid
        t = time.perf_counter()
        io = _proc_io(pid)  # the exited process, not yet reaped
        _, status, ru = os.wait4(pid, 0)
        if pid not in procs:
            continue
        i, p, f, start = procs[pid]
        p.returncode = os.waitstatus_to_exitcode(status)
        f.close()
        end = max(end, t)
        results[i] = {
            "rc": p.returncode if pid not in killed else "timeout",
            "wall": t - start,
            "maxrss_kib": ru.ru_maxrss,
            "minflt": ru.ru_minflt,
            "majflt": ru.ru_majflt,
            "user_s": round(ru.ru_utime, 2),
            "sys_s": round(ru.ru_stime, 2),
            **io,
        }
    timer.cancel()
    print(json.dumps({"wall": end - t0, "procs": results}))


def _wrapped(
    cmds: list[list[str]], env: dict, cwd: Path, logs: list[Path], timeout: float = 7200
) -> dict:
    """``cmds`` started together under the wrapper, in a fresh process."""
    spec = {
        "cmds": [[str(c) for c in cmd] for cmd in cmds],
        "env": env,
        "cwd": str(cwd),
        "logs": [str(x) for x in logs],
        "timeout": timeout,
    }
    spec_file = logs[0].with_suffix(".wrap.json")
    spec_file.write_text(json.dumps(spec))
    res = subprocess.run(
        [sys.executable, str(Path(__file__)), "wrap", str(spec_file)],
        capture_output=True,
        text=True,
        env=child_env(None),
    )
    if res.returncode != 0:
        raise RuntimeError(f"the wrapper failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _tail(log: Path, n: int = 25) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join("    " + x for x in lines[-n:])


# == the run =====================================================================================
def _warm(*paths: Path) -> None:
    """Reads every file once (untimed): the operation starts from the page cache."""
    buf = bytearray(8 << 20)
    for p in paths:
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file() and not f.is_symlink():
                with open(f, "rb", buffering=0) as fh:
                    while fh.readinto(buf):
                        pass


def _digest(d: Path) -> dict[str, str]:
    out = {}
    for f in sorted(d.rglob("*")):
        if f.is_file():
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                while chunk := fh.read(16 << 20):
                    h.update(chunk)
            out[str(f.relative_to(d))] = h.hexdigest()
    return out


def _settle(*dirs: Path) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    os.sync()


def _package_of(package: Path) -> Path:
    code = f"import {PKG} as m; print(m.__file__)"
    res = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env([package]),
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    return Path(res.stdout.strip().splitlines()[-1]).resolve().parent


class Runner:
    def __init__(self, args, work: Path, infos: dict, packages: dict[str, Path]):
        self.args, self.work, self.infos, self.packages = args, work, infos, packages
        self.scratch = work / "scratch"
        self.logs = work / "logs" / time.strftime("%Y%m%d-%H%M%S")
        self.logs.mkdir(parents=True, exist_ok=True)
        self.runs: list[dict] = []
        self.problems: list[str] = []
        self.digests: dict[tuple, dict] = {}

    # -- commands ---------------------------------------------------------------------------
    def _cli(self, *a) -> list[str]:
        return [sys.executable, "-m", PKG, *map(str, a)]

    def _mt(self, name: str) -> list[str]:
        return ["--maxtext-config", str(base_yml()), *self.infos[name]["params"]["model_keys"]]

    def commands(self, op: str, name: str, out: Path) -> list[list[str]]:
        if op == "baseline":
            return [[sys.executable, str(Path(__file__)), "baseline"]]
        a, step = self.args, step_path(self.work, name)
        budget = ["--memory-budget", a.budget]
        if op == "cp":
            return [["cp", "-r", str(step), str(out)]]
        if op in ("export-hf", "export-hf-2p"):
            extra = ["--hf-model-path", str(TOKENIZER), *budget]
            if any(
                k.startswith("override_model_config")
                for k in self.infos[name]["params"]["model_keys"]
            ):
                extra.append("--override-model-architecture")
            if a.max_shard_size:
                extra += ["--max-shard-size", a.max_shard_size]
            if op == "export-hf":
                return [self._cli("export-hf", step, "--out", out, *extra, *self._mt(name))]
            return [
                self._cli(
                    "export-hf",
                    step,
                    "--out",
                    out,
                    *extra,
                    "--process-index",
                    i,
                    "--process-count",
                    2,
                    *self._mt(name),
                )
                for i in range(2)
            ]
        if op == "export-adapter":
            override = any(
                k.startswith("override_model_config")
                for k in self.infos[name]["params"]["model_keys"]
            )
            return [
                self._cli(
                    "export-hf",
                    step,
                    "--adapter",
                    "--alpha",
                    ALPHA,
                    "--out",
                    out,
                    *(["--override-model-architecture"] if override else []),
                    *self._mt(name),
                )
            ]
        if op == "merge-lora":
            base = step_path(self.work, "llama-fsdp")
            return [
                self._cli(
                    "merge-lora", step, "--base", base, "--alpha", ALPHA, "--out", out, *budget
                )
            ]
        if op == "convert-unroll":
            return [
                self._cli(
                    "convert",
                    self.work / name,
                    "--unroll",
                    "--out",
                    out,
                    "--optimizer",
                    "drop",
                    *budget,
                    "-q",
                    *self._mt(name),
                )
            ]
        if op == "verify":
            return [self._cli("verify", out)]
        if op in ("floor-decode", "floor-codec"):
            level = ["--encode", "1"] if op == "floor-codec" else []  # the writers' zarr2 level
            return [[sys.executable, str(HERE / "floor.py"), str(step), *level]]
        raise ValueError(op)

    # -- one measured operation -------------------------------------------------------------
    def measure(
        self, op: str, name: str, tag: str, repeat: int, out: Path, warm: list[Path]
    ) -> dict:
        package = self.packages[tag]
        label = f"{name}-{op}{'-' + tag if tag else ''}-{repeat}"
        cmds = self.commands(op, name, out)
        writes = op not in ("baseline", "verify", *FLOOR_OF.values())
        need = self._output_bytes(op, name) if writes else 0
        free = shutil.disk_usage(self.work).free
        run = {"step": name, "op": op, "package": tag or "this", "repeat": repeat}
        if need and free < need + 2 * GIB:
            run.update(rc="disk", error=f"{free / GIB:.1f} GiB free, {need / GIB:.1f} GiB needed")
            self.problems.append(f"{label}: not run, {run['error']}")
            self.runs.append(run)
            return run
        _warm(*warm)
        env = child_env([package] if op != "cp" else None)
        logs = [self.logs / f"{label}-p{i}.log" for i in range(len(cmds))]
        print(f"[{label}] {' '.join(cmds[0][:6])} ...", file=sys.stderr, flush=True)
        res = _wrapped(cmds, env, self.scratch, logs, self.args.timeout)
        procs = res["procs"]
        run.update(
            rc=next((p["rc"] for p in procs if p["rc"] != 0), 0),
            wall=res["wall"],
            peak_rss_kib=max(p["maxrss_kib"] for p in procs),
            procs=procs,
            **{
                k: sum(p.get(k, 0) for p in procs)
                for k in ("rchar", "read_bytes", "wchar", "write_bytes")
            },
        )
        if run["rc"] == 0 and op.startswith("floor-"):
            lines = logs[0].read_text().splitlines()
            run["floor"] = json.loads(next(x for x in reversed(lines) if x.startswith("{")))
        if run["rc"] != 0:
            tails = "\n".join(_tail(x) for x in logs)
            run["error"] = tails[-4000:]
            self.problems.append(f"{label}: exit {run['rc']} (log {logs[0]})\n{tails}")
        print(
            f"[{label}] rc {run['rc']}, {run['wall']:.1f} s, peak RSS {run['peak_rss_kib'] / 1024:.0f} MiB, "
            f"rchar {run['rchar'] / GIB:.2f} GiB",
            file=sys.stderr,
            flush=True,
        )
        self.runs.append(run)
        return run

    def _output_bytes(self, op: str, name: str) -> int:
        info = self.infos[name]
        if op == "merge-lora":
            return self.infos["llama-fsdp"]["build"]["step_bytes"]
        if op.startswith("export-hf"):
            return info["build"]["weight_bytes"] + GIB
        return info["build"]["step_bytes"]

    # -- the operations of one step ---------------------------------------------------------
    def cp(self, name: str) -> None:
        step = step_path(self.work, name)
        out = self.scratch / "cp"
        _settle(out)
        subprocess.run(["cp", "-r", str(step), str(out)], check=True)  # once, untimed
        _settle(out)
        for r in range(self.args.repeats):
            self.measure("cp", name, "", r, out, [step])
            _settle(out)

    def step_ops(self, name: str, ops: list[str]) -> None:
        step = step_path(self.work, name)
        for tag in self.packages:
            for r in range(self.args.repeats):
                for op in ops:
                    if op == "verify":
                        continue  # run right after convert-unroll, on its output
                    if op.startswith("floor-") and tag:
                        continue  # the machine's, not a package's
                    out = self.scratch / f"out-{op}"
                    _settle(out)
                    warm = [step]
                    if op == "merge-lora":
                        warm = [step, step_path(self.work, "llama-fsdp")]
                    run = self.measure(op, name, tag, r, out, warm)
                    if run["rc"] == 0 and op.startswith("export-hf"):
                        self.digests[(name, op, tag, r)] = _digest(out)
                    if op == "convert-unroll" and "verify" in ops and run["rc"] == 0:
                        self.verify(name, tag, r, out)
                    _settle(out)

    def verify(self, name: str, tag: str, r: int, out: Path) -> None:
        """``verify`` of a convert output: its legacy items hard-linked beside its items/."""
        src = step_path(self.work, name)
        steps = [d for d in out.iterdir() if (d / "items").is_dir()]
        if len(steps) != 1:
            self.problems.append(f"{name}: convert wrote {[d.name for d in steps]}, not one step")
            return
        for legacy in ("model_params", "optimizer_state"):
            if (src / legacy).is_dir():
                subprocess.run(["cp", "-al", str(src / legacy), str(steps[0] / legacy)], check=True)
        os.sync()
        self.measure("verify", name, tag, r, out, [out])

    def baselines(self) -> None:
        for tag in self.packages:
            for r in range(self.args.repeats):
                self.measure("baseline", "-", tag, r, self.scratch / "out-baseline", [])

    def check_digests(self) -> None:
        """The exports of one model (both chunkings, 1 and 2 processes, every package) must
        write the same files."""
        groups: dict[str, list] = {}
        for (name, op, tag, r), d in self.digests.items():
            model = self.infos[name]["params"]["model"]
            label = f"{name} {op}{' (' + tag + ')' if tag else ''} #{r + 1}"
            groups.setdefault(model, []).append((label, d))
        for model, runs in groups.items():
            ref_label, ref = runs[0]
            for label, d in runs[1:]:
                if d != ref:
                    bad = sorted(k for k in set(d) | set(ref) if d.get(k) != ref.get(k))
                    self.problems.append(
                        f"{model}: the export of {label} differs from {ref_label} in {bad[:10]}"
                    )


# -- building and reusing the steps -----------------------------------------------------------
def ensure_step(work: Path, name: str, params: dict, timeout: float) -> dict:
    """The step's marker (parameters, build and check figures), building it first unless the
    marker records the same parameters."""
    marker = work / f"{name}.step.json"
    step = step_path(work, name)
    if marker.exists():
        info = json.loads(marker.read_text())
        if info.get("params") == params and (step / "commit_success.txt").exists():
            print(f"{name}: reusing {step}", file=sys.stderr)
            return info
        print(f"{name}: {marker} records other parameters: rebuilding", file=sys.stderr)
    marker.unlink(missing_ok=True)
    shutil.rmtree(work / name, ignore_errors=True)
    os.sync()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"{name}: building {step} ...", file=sys.stderr, flush=True)
    devices = FSDP if params["layout"] != "lora" else None
    res = _wrapped(
        [
            [
                sys.executable,
                __file__,
                "build",
                work,
                name,
                json.dumps(params),
                logs / f"build-{name}.json",
            ]
        ],
        child_env([REPO], devices=devices),
        work,
        [logs / f"build-{name}.log"],
        timeout,
    )
    p = res["procs"][0]
    if p["rc"] != 0:
        raise SystemExit(
            f"building {name} failed (exit {p['rc']}):\n{_tail(logs / f'build-{name}.log', 40)}"
        )
    built = json.loads((logs / f"build-{name}.json").read_text())
    built["wrapper"] = {
        "wall": round(res["wall"], 1),
        "peak_rss_kib": p["maxrss_kib"],
        "wchar": p.get("wchar"),
    }
    flat_bytes = 0
    for a in built.get("arrays", {}).values():
        n = 2  # bf16 weights; float32 factors for lora (approximate: informative only)
        for d in a.get("shape", []):
            n *= d
        flat_bytes += n
    built["weight_bytes"] = flat_bytes
    print(
        f"{name}: built in {res['wall']:.0f} s, peak RSS {p['maxrss_kib'] / 1024:.0f} MiB, "
        f"{built['step_bytes'] / GIB:.2f} GiB on disk; checking it with stock Orbax ...",
        file=sys.stderr,
        flush=True,
    )
    cres = _wrapped(
        [
            [
                sys.executable,
                __file__,
                "check-step",
                work,
                name,
                json.dumps(params),
                logs / f"check-{name}.json",
            ]
        ],
        child_env([REPO]),
        work,
        [logs / f"check-{name}.log"],
        timeout,
    )
    cp = cres["procs"][0]
    if cp["rc"] != 0:
        raise SystemExit(f"the check of {name} failed:\n{_tail(logs / f'check-{name}.log', 40)}")
    check = json.loads((logs / f"check-{name}.json").read_text())
    check["wall"] = round(cres["wall"], 1)
    check["peak_rss_kib"] = cp["maxrss_kib"]
    info = {"params": params, "step": str(step), "build": built, "check": check}
    marker.write_text(json.dumps(info, indent=1))
    return info


# -- figures -----------------------------------------------------------------------------------
def summarize(args, infos: dict, runner: Runner) -> dict:
    budget = parse_size(args.budget)
    ok = [r for r in runner.runs if r.get("rc") == 0]

    def pick(step, op, tag):
        return [r for r in ok if r["step"] == step and r["op"] == op and r["package"] == tag]

    def med(xs, k):
        return statistics.median(x[k] for x in xs) if xs else None

    rows = []
    base = {tag: pick("-", "baseline", tag) for tag in ("this", "before")}
    base_rss = {t: max((x["peak_rss_kib"] for x in v), default=0) for t, v in base.items()}
    base_rchar = {t: med(v, "rchar") or 0 for t, v in base.items()}
    cp_wall = {n: med(pick(n, "cp", "this"), "wall") for n in infos}

    def floor_wall(name, op):
        runs = pick(name, FLOOR_OF[op], "this") if op in FLOOR_OF else []
        if not runs:
            return None
        wall = med(runs, "wall")
        if op == "verify":  # both sides decoded: a second pass, without a second start
            wall += statistics.median(r["floor"]["wall_s"] for r in runs)
        return wall

    order = [(n, op) for n in STEPS for op in ("cp", *APPLICABLE[n])]
    for tag in ("this", "before"):
        if base[tag]:
            rows.append(_row("-", "baseline", tag, base[tag], None, None, None, 0, 0, budget))
    for name, op in order:
        if name not in infos:
            continue
        for tag in ("this", "before") if op != "cp" else ("this",):
            runs = pick(name, op, tag)
            failed = [
                r
                for r in runner.runs
                if r["step"] == name and r["op"] == op and r["package"] == tag and r.get("rc") != 0
            ]
            if not runs and not failed:
                continue
            floor_step = "llama-fsdp" if op == "merge-lora" else name
            nproc = 2 if op == "export-hf-2p" else 1
            size = infos[name]["build"]["step_bytes"]
            if op == "merge-lora":
                size += infos["llama-fsdp"]["build"]["step_bytes"]
            one = med(pick(name, "export-hf", tag), "wall") if op == "export-hf-2p" else None
            rows.append(
                _row(
                    name,
                    op,
                    tag,
                    runs,
                    cp_wall.get(floor_step),
                    size,
                    one,
                    0 if op == "cp" else base_rss[tag],
                    0 if op == "cp" else nproc * base_rchar[tag],
                    budget,
                    failed=len(failed),
                    floors=(
                        floor_wall(name, op),
                        _cpu(pick(name, "export-hf", tag)) if op == "export-hf-2p" else None,
                    ),
                )
            )
    return {
        "params": {
            "layers": args.layers,
            "moe_layers": args.moe_layers,
            "seed": args.seed,
            "budget": args.budget,
            "repeats": args.repeats,
            "max_shard_size": args.max_shard_size,
            "packages": {k or "this": str(v) for k, v in runner.packages.items()},
        },
        "steps": infos,
        "rows": rows,
        "runs": runner.runs,
        "problems": runner.problems,
        "ok": not runner.problems,
    }


def _cpu(runs: list[dict]) -> float | None:
    """The median CPU seconds (user + kernel, every process) of ``runs``."""
    if not runs:
        return None
    return statistics.median(sum(p["user_s"] + p["sys_s"] for p in r["procs"]) for r in runs)


def _floors(row: dict, wall, cp, one, floor=None, one_cpu=None) -> None:
    """What this machine allows: the operation's floor (`FLOOR_OF`), and for 2 processes the
    best split of one process's CPU over 2 cores."""
    if floor:
        row["floor_s"] = round(floor, 2)
        row["x_floor"] = round(wall / floor, 2) if wall is not None else None
        row["floor_x_cp"] = round(floor / cp, 2) if cp else None
    if one and one_cpu:
        row["one_process_cpu_s"] = round(one_cpu, 1)
        row["x_one_process_floor"] = round(one_cpu / 2 / one, 2)


def _row(name, op, tag, runs, cp, size, one, base_rss, base_rchar, budget, failed=0, floors=()):
    def med(k):
        return statistics.median(x[k] for x in runs) if runs else None

    wall = med("wall")
    peak = max((x["peak_rss_kib"] for x in runs), default=None)
    rchar = med("rchar")
    row = {
        "step": name,
        "op": op,
        "package": tag,
        "runs": len(runs),
        "failed": failed,
        "wall_s": round(wall, 2) if wall is not None else None,
        "x_cp": round(wall / cp, 2) if wall is not None and cp else None,
        "rchar_gib": round(rchar / GIB, 3) if rchar is not None else None,
        "rchar_over_imports_gib": round((rchar - base_rchar) / GIB, 3)
        if rchar is not None
        else None,
        "x_step": round((rchar - base_rchar) / size, 3) if rchar is not None and size else None,
        "read_bytes_gib": round(med("read_bytes") / GIB, 3) if runs else None,
        "write_bytes_gib": round(med("write_bytes") / GIB, 3) if runs else None,
        "peak_rss_mib": round(peak / 1024) if peak is not None else None,
        "rss_per_process_mib": [round(p["maxrss_kib"] / 1024) for p in runs[-1]["procs"]]
        if runs
        else None,
        "rss_over_baseline_mib": round((peak - base_rss) / 1024)
        if peak is not None and op not in ("baseline", "cp")
        else None,
        "step_bytes": size,
    }
    if runs:
        row["cpu_s"] = round(_cpu(runs), 1)
    _floors(row, wall, cp, one, *floors)
    bound = (budget + 512 * MIB) / MIB
    goals = []
    llama_export = op == "export-hf" and name.startswith("llama-")
    if llama_export or op == "merge-lora":
        goals.append(
            ("≤ 5x cp -r" + (" of the base" if op == "merge-lora" else ""), row["x_cp"], 5.0)
        )
    if llama_export:
        goals.append(("rchar ≤ 1.25x step", row["x_step"], 1.25))
    if llama_export or op in ("merge-lora", "export-adapter"):
        goals.append((f"RSS ≤ baseline + {bound:.0f} MiB", row["rss_over_baseline_mib"], bound))
    if op == "convert-unroll":
        goals.append(("≤ 3x cp -r", row["x_cp"], 3.0))
    if op == "verify":
        goals.append(("≤ 2x cp -r", row["x_cp"], 2.0))
    if op == "export-hf-2p":
        row["x_one_process"] = round(wall / one, 2) if wall is not None and one else None
        goals.append(("≤ 0.6x 1 process", row["x_one_process"], 0.6))
    row["goals"] = [
        {"goal": g, "value": v, "held": None if v is None else v <= lim} for g, v, lim in goals
    ]
    return row


def report(s: dict) -> None:
    p = s["params"]
    print(
        f"\nllama3.1-8b at {p['layers']} layers, qwen3-30b-a3b at {p['moe_layers']} layers, "
        f"--memory-budget {p['budget']}, {p['repeats']} repeat(s); medians (peak RSS: the largest)\n"
    )
    print(
        "| step | on disk GiB | built in s | builder peak RSS MiB | files (data files) "
        "| stored chunks per array | read back by stock Orbax |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, i in s["steps"].items():
        b, c = i["build"], i["check"]
        keys = sorted({a.get("chunk_keys", 0) for a in b.get("arrays", {}).values()})
        if "arrays_checked" in c:
            n_sh = sum(1 for x in c["arrays_checked"] if x["as"] == "jax.Array")
            check = (
                f"metadata of {c['params_in_metadata']} params; {len(c['arrays_checked'])} "
                f"arrays ({n_sh} as jax.Array) equal to the seed's"
            )
        else:
            check = f"metadata of {c.get('leaves')} leaves"
        print(
            f"| {n} | {b['step_bytes'] / GIB:.2f} | {b['wrapper']['wall']} | "
            f"{b['wrapper']['peak_rss_kib'] / 1024:.0f} | {b['files']} ({b['data_files']}) | "
            f"{', '.join(map(str, keys))} | {check} |"
        )
    print(
        "\n| step | operation | wall s | x cp -r | CPU s | floor s (x cp -r) | x floor "
        "| rchar GiB (over imports) | x step on disk | peak RSS MiB | RSS over baseline MiB "
        "| goal | held |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in s["rows"]:
        op = r["op"] + (" (before)" if r["package"] == "before" else "")
        if r["wall_s"] is None:
            print(f"| {r['step']} | {op} | failed ({r['failed']}) |" + " |" * 10)
            continue
        goals = "; ".join(g["goal"] for g in r["goals"]) or "-"
        held = (
            "; ".join(
                {True: "held", False: "**not held**", None: "?"}[g["held"]] for g in r["goals"]
            )
            or "-"
        )
        rss = (
            r["peak_rss_mib"]
            if len(r["rss_per_process_mib"] or []) < 2
            else "/".join(map(str, r["rss_per_process_mib"]))
        )
        floor = f"{r['floor_s']} ({r['floor_x_cp']})" if r.get("floor_s") else ""
        if r.get("x_one_process_floor"):
            floor = f"{r['x_one_process_floor']} of 1 process (its CPU over 2 cores)"
        print(
            f"| {r['step']} | {op} | {r['wall_s']} | {r['x_cp'] or ''} | {r.get('cpu_s', '')} | "
            f"{floor} | {r.get('x_floor', '')} | "
            f"{r['rchar_gib']} ({r['rchar_over_imports_gib']}) | {r['x_step'] if r['x_step'] is not None else ''} | "
            f"{rss} | {'' if r['rss_over_baseline_mib'] is None else r['rss_over_baseline_mib']} | {goals} | {held} |"
        )
    if s["problems"]:
        print("\nPROBLEMS:")
        for x in s["problems"]:
            print(f"- {x}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/omtl-realsize"),
        help="where the steps are built and kept (default /tmp/omtl-realsize)",
    )
    ap.add_argument("--only", nargs="+", choices=list(STEPS), help="these steps only")
    ap.add_argument(
        "--ops", nargs="+", choices=list(OPS), help="these operations only (cp always runs)"
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget", default="2GiB", help="--memory-budget of every operation")
    ap.add_argument("--layers", type=int, default=LLAMA_LAYERS, help="llama layers (default 32)")
    ap.add_argument("--moe-layers", type=int, default=4, help="qwen3-30b-a3b layers (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-shard-size", help="export-hf's --max-shard-size (default: its own, 3GiB)"
    )
    ap.add_argument(
        "--before",
        type=Path,
        metavar="DIR",
        help="also run every operation with DIR's package (another checkout), side by side",
    )
    ap.add_argument(
        "--package",
        type=Path,
        default=REPO,
        metavar="DIR",
        help="the checkout whose package the operations run (default: this one)",
    )
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per operation")
    ap.add_argument("--json", type=Path, metavar="FILE", help="write every figure here")
    ap.add_argument("--remove-steps", action="store_true", help="delete the built steps at the end")
    args = ap.parse_args(argv)
    parse_size(args.budget)
    if not TOKENIZER.is_dir():
        raise SystemExit(f"no tokenizer at {TOKENIZER}")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    steps = [n for n in STEPS if not args.only or n in args.only]
    ops = list(args.ops or OPS)
    if "verify" in ops and "convert-unroll" not in ops:
        ops.append("convert-unroll")  # verify reads convert's output
    needed = list(steps)
    if "lora16" in steps and "merge-lora" in ops and "llama-fsdp" not in needed:
        needed.insert(0, "llama-fsdp")  # the base, and its cp -r: the floor of merge-lora
    infos = {}
    for name in needed:
        params = step_params(name, args.layers, args.moe_layers, args.seed)
        infos[name] = ensure_step(work, name, params, args.timeout)
    packages = {"": args.package.resolve()}
    if args.before:
        packages["before"] = args.before.resolve()
    for package in packages.values():
        got = _package_of(package)
        if got != package / PKG:
            raise SystemExit(f"{package}: the children import {got}")
    runner = Runner(args, work, infos, packages)
    runner.scratch.mkdir(parents=True, exist_ok=True)
    try:
        if "baseline" in ops:
            runner.baselines()
        for name in needed:
            step_ops = [op for op in APPLICABLE[name] if op in ops]
            if name not in steps and name == "llama-fsdp":
                step_ops = []  # only its cp -r, the floor of merge-lora
            runner.cp(name)
            if step_ops:
                runner.step_ops(name, step_ops)
        runner.check_digests()
    finally:
        _settle(runner.scratch)
    summary = summarize(args, infos, runner)
    report(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if args.remove_steps:
        for name in needed:
            shutil.rmtree(work / name, ignore_errors=True)
            (work / f"{name}.step.json").unlink(missing_ok=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    verb = sys.argv[1:2]
    if verb == ["build"]:
        build(Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), Path(sys.argv[5]))
    elif verb == ["check-step"]:
        check_step(Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), Path(sys.argv[5]))
    elif verb == ["stock"]:
        stock_save(
            Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[5]), sys.argv[4], Path(sys.argv[6])
        )
    elif verb == ["prove"]:
        sys.exit(prove(sys.argv[2:]))
    elif verb == ["baseline"]:
        baseline()
    elif verb == ["wrap"]:
        wrap(Path(sys.argv[2]))
    else:
        sys.exit(main())
