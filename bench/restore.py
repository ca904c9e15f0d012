"""Benchmark: params restore, stock Orbax against the library's restore engine, side by side.

    python bench/restore.py --work /tmp/omtl-restore [--params 671e6] [--chunks 1 8]
        [--devices 8] [--rounds 3] [--json out.json]

One process, one step per layout: a MaxText-shaped scanned float32 model (``--params``
parameters; 671 M = 2.5 GiB, issue 45's step) saved with stock Orbax as a MaxText step
(``<step>/items``, ``params/params/...``) and as a Tunix step (``<step>/model_params``, a
``value`` level on every leaf), with one chunk per array and with ``N`` chunks per array
(saved from an ``N``-device fsdp mesh where the host has ``N`` devices, else with Orbax's
``chunk_byte_size``). For each chunking and target (one device; an ``N``-device fsdp mesh
where there are ``N`` devices), in interleaved rounds, page cache warm:

- ``stock``: MaxText 0.2.5's ``load_params_from_path`` call with stock Orbax
  (``Checkpointer(PyTreeCheckpointHandler)``, ``transforms={}``, its restore args);
- ``oml maxtext`` / ``oml tunix``: ``oml.load_params_from_path`` on each layout;
- ``floor read``: every byte of the step's files read from the page cache;
- ``floor h2d``: ``jax.device_put`` of preallocated host arrays of the same shapes;
- ``floor decode``: the step's stored chunks as zstd frames (made once, outside the timing,
  from the same values at Orbax's level 3), each decoded once into a fresh buffer in small
  pages, a thread per core: what any restore must do on the host before placing a byte. One
  frame decodes on one thread, so the largest chunk bounds it from below (``floor largest``:
  that frame alone); a restore onto a device also copies to it (``decode+h2d``, the sum).

``--model stacked`` is issue 57's step of large stacked arrays: 16 layers, emb 2048, MLP 8192,
vocab 32768, each stacked MLP kernel one 1 GiB chunk when saved whole. ``--in-a-row N``
then restores each layout N times in a row onto the first target, with no collection
between (a trainer's loop): each time, and the device memory in use after each ``del``.

Each figure is the median over rounds; the peak host RSS of each is VmHWM over the RSS
before it (VmHWM reset through ``/proc/self/clear_refs``). Runs unchanged on a CPU host and
on the TPU machine (``../shared/notes/TPU.md``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from inproc import smoke_run  # noqa: E402 - bench/ on the path first
from realsize_steps import unflat_tree  # noqa: E402


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--params", type=float, default=671e6)
    p.add_argument(
        "--model",
        choices=["llama", "stacked"],
        default="llama",
        help="llama: widened to --params; stacked: issue 57's 1 GiB stacked MLP kernels",
    )
    p.add_argument("--in-a-row", type=int, default=0, help="restores in a row, no collection")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 8])
    p.add_argument("--devices", type=int, default=8, help="host devices on a CPU host")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--full-state",
        type=float,
        default=0,
        help="also a full-state restore (params, Adam moments, RNG, step) of a step of this "
        "many bytes through CheckpointManager: bench/synth's Tunix step, and it converted",
    )
    return p.parse_args(argv)


def _shapes(n_params: float, model: str = "llama") -> dict[tuple[str, ...], tuple[int, ...]]:
    """A MaxText llama-like scanned decoder (layers on axis 1), about ``n_params`` big; or
    (``stacked``) 16 layers of emb 2048, MLP 8192, vocab 32768."""
    layers, emb = 8, 256
    while model == "llama":  # widen until the size is reached: emb a multiple of 256
        mlp, vocab = 4 * emb, 16 * emb
        total = 2 * vocab * emb + layers * (4 * emb * emb + 3 * emb * mlp + 2 * emb) + emb
        if total >= n_params:
            break
        emb += 256
    if model == "stacked":
        layers, emb, mlp, vocab = 16, 2048, 8192, 32768
    lay = ("params", "decoder", "layers")
    return {
        ("params", "token_embedder", "embedding"): (vocab, emb),
        ("params", "decoder", "decoder_norm", "scale"): (emb,),
        ("params", "decoder", "logits_dense", "kernel"): (emb, vocab),
        (*lay, "mlp", "wi_0", "kernel"): (emb, layers, mlp),
        (*lay, "mlp", "wi_1", "kernel"): (emb, layers, mlp),
        (*lay, "mlp", "wo", "kernel"): (mlp, layers, emb),
        (*lay, "self_attention", "query", "kernel"): (emb, layers, emb),
        (*lay, "self_attention", "key", "kernel"): (emb, layers, emb),
        (*lay, "self_attention", "value", "kernel"): (emb, layers, emb),
        (*lay, "self_attention", "out", "kernel"): (emb, layers, emb),
        (*lay, "pre_self_attention_layer_norm", "scale"): (emb, layers),
        (*lay, "post_self_attention_layer_norm", "scale"): (emb, layers),
    }


def _fsdp(shape, mesh):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.size
    axes = [a for a in range(len(shape)) if a != 1 and shape[a] % n == 0] or [
        a for a in range(len(shape)) if shape[a] % n == 0
    ]
    spec = [None] * len(shape)
    if axes and len(shape) > 1:
        spec[max(axes, key=lambda a: shape[a])] = "fsdp"
    del jax
    return NamedSharding(mesh, P(*spec))


def _write(root: Path, shapes, chunks: int, mesh) -> dict[str, Path]:
    """The MaxText and the Tunix step of the model, ``chunks`` chunks per array."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    steps = {"maxtext": root / "maxtext" / "0", "tunix": root / "tunix" / "0"}
    if all((s / "_CHECKPOINT_METADATA").exists() for s in steps.values()):
        return steps
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(0)
    flat = {}
    for path, shape in shapes.items():
        x = rng.standard_normal(shape, dtype=np.float32)
        if chunks > 1 and mesh is not None and mesh.size == chunks:
            x = jax.device_put(x, _fsdp(shape, mesh))
        flat[path] = x
    save_args = {}
    for path, shape in shapes.items():
        nbytes = math.prod(shape) * 4
        if chunks > 1 and (mesh is None or mesh.size != chunks):
            save_args[path] = ocp.SaveArgs(chunk_byte_size=max(1, nbytes // chunks))
        else:
            save_args[path] = ocp.SaveArgs()
    items = {
        "maxtext": ("items", {"params": unflat_tree(flat)}, {"params": unflat_tree(save_args)}),
        "tunix": (
            "model_params",
            unflat_tree({p[1:] + ("value",): v for p, v in flat.items()}),
            unflat_tree({p[1:] + ("value",): v for p, v in save_args.items()}),
        ),
    }
    for layout, (item, tree, sargs) in items.items():
        manager = ocp.CheckpointManager(
            steps[layout].parent,
            item_handlers={item: ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)},
            options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
        )
        manager.save(
            0,
            args=ocp.args.Composite(**{item: ocp.args.PyTreeSave(tree, save_args=sargs)}),
            force=True,
        )
        manager.wait_until_finished()
        manager.close()
    del flat, items
    gc.collect()
    return steps


def _rss_kib() -> tuple[int, int]:
    rss = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return rss, hwm


def _measure(fn) -> tuple[float, float]:
    """Seconds and peak host RSS over the start (GiB) of ``fn()``, its result dropped.

    The peak is VmHWM, reset through ``/proc/self/clear_refs`` where this user may write
    it, else the most of VmRSS sampled every 2 ms on a thread (the TPU machine refuses
    ``clear_refs`` to an ordinary user)."""
    import threading

    import jax

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        sampler = None
    except PermissionError:
        sampler = threading.Event()
    before, _ = _rss_kib()
    most = [before]

    def sample():
        while not sampler.is_set():
            most[0] = max(most[0], _rss_kib()[0])
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True) if sampler else None
    if thread:
        thread.start()
    t = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    wall = time.perf_counter() - t
    if thread:
        sampler.set()
        thread.join()
        peak = max(most[0], _rss_kib()[0])
    else:
        _, peak = _rss_kib()
    del out
    gc.collect()
    return wall, (peak - before) / 2**20


def _rounds(ops: dict, rounds: int) -> tuple[dict[str, list], dict[str, list]]:
    """Each operation's seconds and peak RSS, ``rounds`` times, each round in its own order
    (a shuffle seeded by the round). A rotation keeps each operation's predecessor (the
    library's MaxText restore always ran right after stock's), and on this VM the restore
    that follows stock's is up to 1.5 s slower, whichever it is."""
    import random

    times: dict[str, list] = {k: [] for k in ops}
    rss: dict[str, list] = {k: [] for k in ops}
    for r in range(rounds):
        order = list(ops)
        random.Random(r).shuffle(order)
        for k in order:
            wall, peak = _measure(ops[k])
            times[k].append(wall)
            rss[k].append(peak)
    return times, rss


def _frames(shapes, chunks: int) -> list[bytes]:
    """``floor decode``'s input: the step's values (`_write`'s seed) as the zstd frames of its
    stored chunks, each array's bytes cut into ``chunks`` runs (the step's chunk size),
    compressed at level 3 as Orbax writes zarr3 arrays; largest first."""
    import numpy as np
    import zstandard

    rng, cctx, frames = np.random.default_rng(0), zstandard.ZstdCompressor(level=3), []
    for shape in shapes.values():
        x = rng.standard_normal(shape, dtype=np.float32).reshape(-1).view(np.uint8)
        step = -(-x.size // chunks)
        frames += [cctx.compress(x[i : i + step]) for i in range(0, x.size, step)]
    return sorted(frames, key=len, reverse=True)


def _decode_all(frames: list[bytes]) -> list:
    """``floor decode``: every frame decoded once into a fresh buffer in small pages (as the
    library's are: `scratch.small_pages`), a thread per core."""
    from concurrent.futures import ThreadPoolExecutor

    import zstandard
    from _internal import small_pages

    def one(frame: bytes):
        n = zstandard.get_frame_parameters(frame).content_size
        out, done = small_pages(n), 0
        with zstandard.ZstdDecompressor().stream_reader(frame) as reader:
            view = memoryview(out)
            while done < n and (got := reader.readinto(view[done:])):
                done += got
        assert done == n, (done, n)
        return out

    with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
        return list(pool.map(one, frames))


def _in_a_row(restore, n: int, device) -> dict:
    """``restore()`` ``n`` times in a row, each result dropped with ``del`` and no collection
    between (as a trainer's loop): each time, and the device bytes in use after each ``del``
    (``memory_stats``; the distinct buffers of ``jax.live_arrays()`` where it has none)."""
    import jax

    def in_use() -> int:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if stats and "bytes_in_use" in stats:
            return int(stats["bytes_in_use"])
        seen = {}
        for x in jax.live_arrays():
            for sh in x.addressable_shards:
                seen[sh.data.unsafe_buffer_pointer()] = sh.data.nbytes
        return sum(seen.values())

    gc.collect()
    base = in_use()
    times, held = [], []
    for _ in range(n):
        t = time.perf_counter()
        out = restore()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
        del out
        held.append(in_use() - base)
    return {"times": times, "held after del": held}


def _read_all(step: Path) -> int:
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    n = 0
    for f in sorted(step.rglob("*")):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while got := fh.readinto(view):
                    n += got
    return n


def _full_state(a, devices) -> dict:
    """Params, optimizer, RNG and step through `CheckpointManager`, as MaxText restores them:
    stock's manager on the converted MaxText step, ours on it and on the Tunix step."""
    import jax
    import orbax.checkpoint as ocp
    import synth

    import orbax_maxtext_layout as oml

    root = a.work / "full"
    tunix = root / "tunix" / "actor" / "2"
    native = root / "maxtext" / "actor" / "2"
    if not (native / "items").exists():
        shutil.rmtree(root, ignore_errors=True)
        synth.make_step(root / "tunix", 2, int(a.full_state))
        synth.converted_copy(tunix, native)
    one = jax.sharding.SingleDeviceSharding(devices[0])
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one),
        synth.target_for(tunix).items(),
    )
    rargs = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), abstract)
    args = ocp.args.Composite(items=ocp.args.PyTreeRestore(item=abstract, restore_args=rargs))

    def restore(cls, directory, step):
        with cls(directory, item_names=("items",)) as m:
            return m.restore(step, args=args)["items"]

    ops = {
        "stock": lambda: restore(ocp.CheckpointManager, native.parent, 2),
        "oml maxtext": lambda: restore(oml.CheckpointManager, native.parent, 2),
        "oml tunix": lambda: restore(oml.CheckpointManager, tunix.parent, 1),
    }
    times, rss = _rounds(ops, a.rounds)
    row = {
        "full state": int(a.full_state),
        **{k: statistics.median(v) for k, v in times.items()},
        **{f"{k} rss GiB": max(v) for k, v in rss.items()},
    }
    s = row["stock"]
    print(
        f"full state {a.full_state / 2**30:.1f} GiB, 1 device: stock {s:.2f} s | oml maxtext "
        f"{row['oml maxtext']:.2f} s ({row['oml maxtext'] / s:.2f}x) | oml tunix "
        f"{row['oml tunix']:.2f} s ({row['oml tunix'] / s:.2f}x) | peak RSS GiB: stock "
        f"{row['stock rss GiB']:.2f}, oml {row['oml maxtext rss GiB']:.2f} / "
        f"{row['oml tunix rss GiB']:.2f}",
        flush=True,
    )
    return row


def main(argv=None) -> int:
    a = _args(argv)
    if "JAX_PLATFORMS" not in os.environ or os.environ["JAX_PLATFORMS"] == "cpu":
        flags = os.environ.get("XLA_FLAGS", "")
        if "device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={a.devices}"
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, SingleDeviceSharding

    import orbax_maxtext_layout as oml

    devices = jax.devices()
    if smoke_run():  # the collections around each operation then skip what the imports made
        gc.freeze()
    shapes = _shapes(a.params, a.model)
    n_params = sum(math.prod(s) for s in shapes.values())
    print(
        f"{jax.default_backend()}: {len(devices)} devices; {n_params / 1e6:.0f} M params, "
        f"{n_params * 4 / 2**30:.2f} GiB float32",
        flush=True,
    )
    results = []
    for chunks in a.chunks:
        mesh = Mesh(np.array(devices[:chunks]), ("fsdp",)) if len(devices) >= chunks > 1 else None
        steps = _write(a.work / f"chunks{chunks}", shapes, chunks, mesh)
        frames = _frames(shapes, chunks)
        targets = {"1 device": lambda shape: SingleDeviceSharding(devices[0])}
        n = max(a.chunks)
        if len(devices) >= n > 1:
            fsdp_mesh = Mesh(np.array(devices[:n]), ("fsdp",))
            targets[f"{n}-device fsdp"] = lambda shape, m=fsdp_mesh: _fsdp(shape, m)
        for tname, place in targets.items():
            abstract = unflat_tree(
                {
                    p: jax.ShapeDtypeStruct(s, np.float32, sharding=place(s))
                    for p, s in shapes.items()
                }
            )
            items_dir = steps["maxtext"] / "items"

            def stock(abstract=abstract, items_dir=items_dir):
                ckptr = ocp.Checkpointer(
                    ocp.PyTreeCheckpointHandler(
                        restore_concurrent_gb=96, use_ocdbt=True, use_zarr3=True
                    )
                )
                try:
                    return ckptr.restore(
                        items_dir,
                        item={"params": abstract},
                        transforms={},
                        restore_args={
                            "params": ocp.checkpoint_utils.construct_restore_args(abstract)
                        },
                    )
                finally:
                    ckptr.close()

            host = {
                p: np.full(s, 1.0, np.float32) for p, s in shapes.items()
            }  # preallocated, touched

            ops = {
                "stock": stock,
                "oml maxtext": lambda abstract=abstract, d=items_dir: oml.load_params_from_path(
                    d, abstract
                ),
                "oml tunix": lambda abstract=abstract, d=steps["tunix"]: oml.load_params_from_path(
                    d / "model_params", abstract
                ),
                "floor read": lambda d=steps["maxtext"]: _read_all(d),
                "floor h2d": lambda host=host, place=place: [
                    jax.device_put(host[p], place(s)) for p, s in shapes.items()
                ],
                "floor decode": lambda frames=frames: _decode_all(frames),
                "floor largest": lambda frames=frames: _decode_all(frames[:1]),
            }
            times, rss = _rounds(ops, a.rounds)
            del host
            row = {
                "chunks": chunks,
                "target": tname,
                **{k: statistics.median(v) for k, v in times.items()},
                **{f"{k} rss GiB": max(v) for k, v in rss.items()},
            }
            row["decode+h2d"] = row["floor decode"] + row["floor h2d"]
            results.append(row)
            s = row["stock"]
            print(
                f"chunks {chunks}, {tname}: stock {s:.2f} s | oml maxtext "
                f"{row['oml maxtext']:.2f} s ({row['oml maxtext'] / s:.2f}x) | oml tunix "
                f"{row['oml tunix']:.2f} s ({row['oml tunix'] / s:.2f}x) | floors: read "
                f"{row['floor read']:.2f} s, h2d {row['floor h2d']:.2f} s, decode "
                f"{row['floor decode']:.2f} s (largest chunk {row['floor largest']:.2f} s), "
                f"oml over decode+h2d {row['oml maxtext'] / row['decode+h2d']:.2f} / "
                f"{row['oml tunix'] / row['decode+h2d']:.2f} | peak RSS GiB: stock "
                f"{row['stock rss GiB']:.2f}, oml {row['oml maxtext rss GiB']:.2f} / "
                f"{row['oml tunix rss GiB']:.2f}",
                flush=True,
            )
            if a.in_a_row and tname == "1 device":
                for layout, restore in (
                    ("oml maxtext", ops["oml maxtext"]),
                    ("oml tunix", ops["oml tunix"]),
                ):
                    got = _in_a_row(restore, a.in_a_row, devices[0])
                    row[f"{layout} in a row"] = got
                    t = got["times"]
                    print(
                        f"chunks {chunks}, {layout}, {a.in_a_row} in a row: first {t[0]:.2f} s, "
                        f"median {statistics.median(t):.2f} s, slowest {max(t):.2f} s; device "
                        f"bytes held after del: most {max(got['held after del'])}",
                        flush=True,
                    )
    if a.full_state:
        results.append(_full_state(a, devices))
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "backend": jax.default_backend(),
                    "devices": len(devices),
                    "params": n_params,
                    "model": a.model,
                    "cores": len(os.sched_getaffinity(0)),
                    "rows": results,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
