"""Benchmark (issue 43): ``import-hf`` of a real-size llama3.1-8b Hugging Face directory, against
``cp -r``, this machine's read-and-encode floor and MaxText's own ``to_maxtext``.

    V=$(ls -d /root/.cache/orbax-maxtext-layout/interop-venv-*)
    # the real-size run: an 11.7 GiB step (15 GiB of bf16 values) and its 15 GiB export kept under --work for
    # the next run (--remove-step drops the step once exported), and up to 15 GiB of
    # output at a time (deleted after each operation)
    PYTHONPATH=$PWD $V/bin/python bench/import_hf.py --work /tmp/omtl-importhf --json importhf.json
    # a quick run on a cut model (2 layers, about 2.5 GB)
    PYTHONPATH=$PWD $V/bin/python bench/import_hf.py --layers 2 --work /tmp/omtl-importhf-2

``--package DIR`` runs ``import-hf`` (and its dry run) with another checkout's package (e.g. a copy
with a fix).

``--adapter`` (issue 60) adds ``import-hf-adapter``: the same import with a rank-``--adapter-rank``
(16) PEFT adapter of every linear module merged in (``import-hf HF --adapter A ...``; the
adapter's files as `bench/import_as_lora.py` makes them, float32, random values, 160 MiB at
8B, made once under ``--work``), alternated with ``import-hf`` of the base alone, each in a
fresh process; it prints the ratio of their walls and the merge's peak RSS against issue 60's
goals (≤ 1.2x the base's import, peak RSS ≤ imports + the budget + 512 MiB, the base import's
own RSS goal). Its default operations are then ``dry-run import-hf import-hf-adapter``::

    PYTHONPATH=$PWD $V/bin/python bench/import_hf.py --work /tmp/omtl-importhf --adapter \
        --repeats 3 --remove-step --no-check [--package DIR] ``python bench/import_hf.py phases HF OUT -- <base.yml> KEY=VALUE ...`` (with
``JAX_PLATFORMS=cpu``) runs the import in-process with timers around its phases (`phases`): where
its time and memory go.

Run it with the interop venv's Python (MaxText 0.2.5, Python 3.12); every child runs with the
same interpreter, on JAX's CPU backend. The orchestrator imports the standard library only
(and `bench/realsize_*.py`, which do too).

**The input**, built once in ``--work`` and reused while its marker records the same
parameters:

- the step: `bench/realsize.py`'s ``llama-onechunk`` (``<work>/llama-onechunk/0``): MaxText's
  unmodified ``llama3.1-8b``, ``weight_dtype=bfloat16``, ``scan_layers=true``, values drawn
  from the seed, saved by stock Orbax as from one device (`realsize_ops.ensure_step`: built,
  then read back by stock Orbax and compared with the seed's values); ``--step llama-fsdp``
  takes realsize.py's ``llama-fsdp`` instead (the same values in 8 chunks a param: the same
  export, byte for byte; the smoke run shares that step with realsize.py);
- the Hugging Face directory (``<work>/hf``): ``orbax-maxtext-layout export-hf STEP --out HF
  --hf-model-path tests/fixtures/hf_tokenizer --memory-budget 2GiB --maxtext-config <base.yml>
  model_name=llama3.1-8b weight_dtype=bfloat16 scan_layers=true``: bf16, sharded safetensors
  (export-hf's default 3 GiB shards) with ``model.safetensors.index.json``, ``config.json``.

**The operations**, in one run, each in a fresh child process from a warm page cache (every
file of the Hugging Face directory read once, untimed, before each), its output deleted right
after (then ``sync``):

- ``cp``: ``cp -r HF OUT`` (once untimed first): the I/O floor;
- ``floor``: ``bench/import_hf.py floor HF``: every safetensors byte read once (``os.preadv``
  into a reused buffer per thread) and encoded once at zstd level 1 (what ``import-hf`` writes:
  `item_writer.create_array`, zarr3 ``bytes`` + ``zstd`` level 1), in pieces of at most 64 MiB
  (``import_hf.CHUNK_BYTES``, a written chunk at most), cut on each tensor's first axis,
  2 threads (one per core), largest tensor first; nothing written;
- ``dry-run``: ``import-hf HF --out OUT --dry-run --json ...``: MaxText's config and abstract
  model, every header read and checked, the plan; its peak RSS is "imports" in the RSS goal,
  and its ``rchar`` what the imports read;
- ``import-hf``: ``python -m orbax_maxtext_layout import-hf HF --out OUT --save-dtype bfloat16
  --memory-budget 2GiB --json --maxtext-config <base.yml> model_name=llama3.1-8b
  scan_layers=true``; after its first run, untimed, a child (``check``) restores params of
  its output with stock Orbax and compares them with the source step's (restored with stock
  Orbax, or drawn again from the seed once ``--remove-step`` removed it): every param's
  shape and dtype, and the values of the embedding, the logits kernel, both norms, the MLP
  kernels and the attention kernels: equal bit for bit, except the query kernel (MaxText's
  hooks scale it by sqrt(head_dim) on export and back on import: at most 1 bf16 ulp);
- ``import-hf-adapter`` (with ``--adapter``): ``import-hf`` as above with ``--adapter A``; its
  report must name every linear weight of every layer as merged;
- ``to-maxtext``: ``python -m maxtext.checkpoint_conversion.to_maxtext <base.yml>
  model_name=llama3.1-8b scan_layers=true base_output_directory=OUT hardware=cpu
  skip_jax_distributed_system=True --hf_model_path=HF --save_dtype=bfloat16
  --simulated_cpu_devices_count=2`` (no ``PYTHONPATH``), killed after ``--maxtext-timeout``.

Each runs under `bench/realsize_wrap.py`'s wrapper: wall time from start to exit; peak RSS from
``wait4``'s rusage (the VmHWM of the process and of any process it reaped); ``rchar``,
``read_bytes``, ``wchar``, ``write_bytes`` of ``/proc/<pid>/io`` read after it exited,
before it is reaped. Around each, ``/proc/stat`` gives the CPU seconds every other process
spent meanwhile (``others_cpu_s``: the machine's busy time less the child's) and the
hypervisor's ``steal``, and ``/proc/loadavg`` the load before it. Medians of ``--repeats``
(peak RSS: the largest).

**The timed runs wait for a quiet machine**: until the 1-minute load average is below
``--quiet-load`` (1.5), at most ``--quiet-wait`` seconds (900), then they run anyway and the
report says the load.

**The goals** (issue 43): ``import-hf`` wall ≤ 2x the floor's and ≤ 34 s (3x faster than
to_maxtext's 103 s measured here before; also against this run's to_maxtext); peak RSS ≤
imports (the dry run's peak) + the budget + 512 MiB; ``rchar`` over the dry run's ≤ 1.05x
the safetensors bytes.

Exit status 1 if a build, the export, ``import-hf`` or the check fails (a goal not held, or
to_maxtext killed, does not fail the run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import import_as_lora as ial  # bench/import_as_lora.py's adapter (standard library at its top)
import realsize_build as rb  # bench/realsize_*.py: standard library only at their tops
import realsize_ops as ro
import realsize_steps as rs
import realsize_wrap as rw
from export_hf import parse_size  # bench/export_hf.py's

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PKG = "orbax_maxtext_layout"
STEP_NAME = "llama-onechunk"
HF_VERSION = 1  # bump when the export's command changes
CHUNK_BYTES = 64 << 20  # import_hf.CHUNK_BYTES (checked by the floor child)
OPS = ("cp", "floor", "dry-run", "import-hf", "import-hf-adapter", "to-maxtext")
DEFAULT_OPS = ("cp", "floor", "dry-run", "import-hf", "to-maxtext")
ADAPTER_OPS = ("dry-run", "import-hf", "import-hf-adapter")  # --adapter's default
ADAPTER_RATIO = 1.2  # issue 60: the merge at most this times the base's import
MIB, GIB = 1 << 20, 1 << 30
TO_MAXTEXT_BEFORE_S = 103.0  # issue 43: to_maxtext on this directory, measured here before
# params compared by the check (model paths); the query kernel within 1 bf16 ulp
CHECKED = (
    ("token_embedder", "embedding"),
    ("decoder", "logits_dense", "kernel"),
    ("decoder", "decoder_norm", "scale"),
    ("decoder", "layers", "pre_self_attention_layer_norm", "scale"),
    ("decoder", "layers", "post_self_attention_layer_norm", "scale"),
    ("decoder", "layers", "self_attention", "query", "kernel"),
    ("decoder", "layers", "self_attention", "key", "kernel"),
    ("decoder", "layers", "self_attention", "value", "kernel"),
    ("decoder", "layers", "self_attention", "out", "kernel"),
    ("decoder", "layers", "mlp", "wi_0", "kernel"),
    ("decoder", "layers", "mlp", "wo", "kernel"),
)
ULP_OK = {("decoder", "layers", "self_attention", "query", "kernel"): 1}


def model_keys(params: dict) -> list[str]:
    """import-hf's and to_maxtext's MaxText keys (after ``base.yml``): the step's, but its
    ``weight_dtype`` (the import's own default)."""
    return [k for k in params["model_keys"] if not k.startswith("weight_dtype=")]


def _safetensors(hf: Path) -> list[Path]:
    return sorted(hf.glob("*.safetensors"))


# == the floor (its own process) =================================================================
def _headers(hf: Path) -> list[tuple[int, str, int, int]]:
    """``(bytes, file, absolute offset, row bytes)`` of every tensor of ``hf``'s safetensors."""
    import struct

    out = []
    for f in _safetensors(hf):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, e in header.items():
            if name == "__metadata__":
                continue
            begin, end = e["data_offsets"]
            rows = e["shape"][0] if e["shape"] else 1
            nbytes = end - begin
            out.append((nbytes, str(f), 8 + n + begin, nbytes // max(rows, 1) or nbytes))
    return sorted(out, reverse=True)


def floor(hf: Path, threads: int, level: int) -> dict:
    """Every safetensors byte read once and encoded once at zstd ``level``, ``threads`` tensors
    at a time, largest first, in pieces of at most `CHUNK_BYTES` (whole rows); nothing written."""
    import resource
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import zstandard

    try:  # the piece size must be import-hf's largest written chunk
        from _internal import import_hf_rooms

        ih = import_hf_rooms()["import_hf"]
        assert ih.CHUNK_BYTES == CHUNK_BYTES, (ih.CHUNK_BYTES, CHUNK_BYTES)
    except ImportError:  # a --package checkout without it
        pass
    t0 = time.perf_counter()
    tensors = _headers(hf)
    fds = {f: os.open(f, os.O_RDONLY) for f in {t[1] for t in tensors}}
    local = threading.local()
    lock, totals = threading.Lock(), [0, 0]

    def task(t) -> None:
        nbytes, f, at, row = t
        if not hasattr(local, "buf"):
            local.buf = memoryview(bytearray(CHUNK_BYTES))
            local.comp = zstandard.ZstdCompressor(level=level)
        step = max(row, CHUNK_BYTES // row * row) if row <= CHUNK_BYTES else CHUNK_BYTES
        read = wrote = 0
        for lo in range(0, nbytes, step):
            n = min(step, nbytes - lo)
            view, done = local.buf[:n], 0
            while done < n:
                got = os.preadv(fds[f], [view[done:]], at + lo + done)
                if got <= 0:
                    raise OSError(f"{f}: short read at {at + lo + done}")
                done += got
            read += n
            wrote += len(local.comp.compress(view))
        with lock:
            totals[0] += read
            totals[1] += wrote

    t1 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(task, tensors))
    wall = time.perf_counter() - t1
    for fd in fds.values():
        os.close(fd)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "tensors": len(tensors),
        "threads": threads,
        "level": level,
        "read_bytes": totals[0],
        "encoded_bytes": totals[1],
        "headers_s": round(t1 - t0, 3),
        "wall_s": round(wall, 2),
        "user_s": round(ru.ru_utime, 2),
        "sys_s": round(ru.ru_stime, 2),
    }


# == the check (its own process) =================================================================
def _ulps(a, b) -> int:
    """The largest distance in bf16 ulps between ``a`` and ``b`` (same sign-magnitude order)."""
    import numpy as np

    def ordered(x):
        i = x.view(np.int16).astype(np.int32)
        return np.where(i < 0, -32768 - i, i)

    best = 0
    fa, fb = a.reshape(-1), b.reshape(-1)
    for lo in range(0, fa.size, 1 << 24):
        d = np.abs(ordered(fa[lo : lo + (1 << 24)]) - ordered(fb[lo : lo + (1 << 24)]))
        best = max(best, int(d.max(initial=0)))
    return best


def check(out_step: Path, step: Path, params: dict, out_json: Path) -> None:
    """Stock Orbax reads ``out_step/items``: every param of the source model with its shape and
    dtype, and the params of `CHECKED`, compared with the source step's (stock Orbax restore of
    ``step/items``, or the seed's values where ``step`` is gone). Raises on a difference."""
    import contextlib
    import logging

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from etils import epath

    logging.getLogger("absl").setLevel(logging.ERROR)
    flat, _aux, axes = rb.abstract(params["model_keys"])
    handler = ocp.PyTreeCheckpointHandler()
    problems, checked = [], []
    meta = json.loads((out_step / "_CHECKPOINT_METADATA").read_text())
    if (meta.get("custom_metadata") or {}).get("scan_layers") is not True:
        problems.append(f"_CHECKPOINT_METADATA: custom_metadata {meta.get('custom_metadata')}")
    got = rs.flat_tree(handler.metadata(epath.Path(out_step / "items")).tree)
    got_params = {p[2:]: m for p, m in got.items() if p[:2] == ("params", "params")}
    for path, x in flat.items():
        m = got_params.get(path)
        if m is None:
            problems.append(f"{'/'.join(path)}: missing")
        elif tuple(m.shape) != tuple(x.shape) or np.dtype(m.dtype) != np.dtype(x.dtype):
            problems.append(f"{'/'.join(path)}: {m.shape} {m.dtype}, want {x.shape} {x.dtype}")
    problems += [f"{'/'.join(p)}: not in the model" for p in got_params if p not in flat]
    from_step = (step / "items" / "_METADATA").is_file()

    def restore(item: Path, path: tuple[str, ...]):
        q = ("params", "params", *path)
        with contextlib.redirect_stdout(sys.stderr):
            r = handler.restore(
                epath.Path(item),
                args=ocp.args.PyTreeRestore(
                    item=rs.unflat_tree({q: got[q]}),
                    restore_args=rs.unflat_tree({q: ocp.RestoreArgs(restore_type=np.ndarray)}),
                    partial_restore=True,
                ),
            )
        return np.asarray(rs.flat_tree(r)[q])

    for path in CHECKED:
        if path not in flat:
            continue
        t0 = time.perf_counter()
        a = restore(out_step / "items", path)
        if from_step:
            want = restore(step / "items", path)
        else:
            x = flat[path]
            v = rb.Values(path, x.shape, x.dtype, axes.get(path), params["seed"])
            want = v.region(tuple(slice(0, n) for n in v.shape))
        name = "/".join(path)
        row = {"param": name, "shape": list(a.shape), "bytes": int(a.nbytes)}
        if a.shape != want.shape or a.dtype != want.dtype:
            problems.append(f"{name}: {a.shape} {a.dtype}, the source's {want.shape} {want.dtype}")
        else:
            same = a.tobytes() == want.tobytes()
            row["bit_equal"] = same
            if not same:
                row["differing"] = int(np.count_nonzero(a.view(np.int16) != want.view(np.int16)))
                row["max_ulps"] = _ulps(a, want)
                if row["max_ulps"] > ULP_OK.get(path, 0):
                    problems.append(
                        f"{name}: {row['differing']} values differ, up to {row['max_ulps']} ulps"
                    )
        row["s"] = round(time.perf_counter() - t0, 1)
        checked.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        del a, want
    result = {
        "against": "the source step (stock Orbax)" if from_step else "the seed's values",
        "params_in_metadata": len(got_params),
        "checked": checked,
        "problems": problems,
    }
    out_json.write_text(json.dumps(result))
    if problems:
        raise SystemExit("\n".join(problems))
    del jax


# == where import-hf's time and memory go (its own process) =====================================
def phases(argv: list[str]) -> None:
    """``import_hf(...)`` run in this process with timers around its phases (main thread: the
    config, the plan, the arrays made, the slices, the metadata, the commit; each worker
    thread: the budget's wait, the range read, the cast, MaxText's hooks, the row-block copies
    and tensorstore's writes, in thread CPU seconds and wall seconds), and this process's RSS
    sampled every 50 ms (its peak, and which phase was running then). Prints one JSON line.

        python bench/import_hf.py phases HF OUT [--memory-budget 2GiB] -- <base.yml> KEY=VALUE ...
    """
    import resource
    import threading
    import types

    ap = argparse.ArgumentParser(prog="import_hf.py phases")
    ap.add_argument("hf")
    ap.add_argument("out")
    ap.add_argument("--memory-budget", default="2GiB")
    ap.add_argument("config", nargs="+")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    from _internal import import_hf_rooms
    from maxtext.checkpoint_conversion.utils import tensor_handling as th

    rooms = import_hf_rooms()
    ih, hf_mapping = rooms["import_hf"], rooms["hf_mapping"]
    si, stepdir = rooms["safetensors_in"], rooms["stepdir"]

    t_imported = time.perf_counter()
    lock = threading.Lock()
    stats: dict[str, list[float]] = {}  # name -> [calls, wall s, thread CPU s, bytes]
    current = {"phase": "imports"}

    def add(name, wall, cpu, nbytes=0):
        with lock:
            s = stats.setdefault(name, [0, 0.0, 0.0, 0])
            s[0] += 1
            s[1] += wall
            s[2] += cpu
            s[3] += nbytes

    by_shape: dict[
        tuple, list[float]
    ] = {}  # (phase, shape, C-contiguous) -> [calls, wall, cpu, bytes]

    def timed(name, fn, *, main=False, size=None, shape_of=None):
        def wrapper(*args, **kw):
            if main:
                current["phase"] = name
            w, c = time.perf_counter(), time.thread_time()
            try:
                out = fn(*args, **kw)
            finally:
                n = 0
                if size is not None:
                    try:
                        n = size(args, out)
                    except Exception:
                        n = 0
                dw, dc = time.perf_counter() - w, time.thread_time() - c
                add(name, dw, dc, n)
                if shape_of is not None:
                    x = shape_of(args)
                    key = (name, str(tuple(x.shape)), bool(x.flags.c_contiguous))
                    with lock:
                        v = by_shape.setdefault(key, [0, 0.0, 0.0, 0])
                        v[0] += 1
                        v[1] += dw
                        v[2] += dc
                        v[3] += n
            return out

        return wrapper

    def out_bytes(args, out):
        return int(getattr(out, "nbytes", 0))

    # main-thread phases
    hf_mapping.load_config = timed("load the MaxText config", hf_mapping.load_config, main=True)
    hf_mapping.load_import = timed("MaxText's mapping", hf_mapping.load_import, main=True)
    si.HfDir.open = classmethod(timed("open and check HF_DIR", si.HfDir.open.__func__, main=True))
    ih.plan_import = timed("plan (MaxText's abstract model)", ih.plan_import, main=True)
    ih._run_slices = timed("slices (all)", ih._run_slices, main=True)
    ih.orbax_files = types.SimpleNamespace(
        **{k: getattr(ih.orbax_files, k) for k in dir(ih.orbax_files) if not k.startswith("__")}
    )
    ih.orbax_files.write_metadata = timed("metadata", ih.orbax_files.write_metadata, main=True)
    ih.stepdir = types.SimpleNamespace(
        **{k: getattr(stepdir, k) for k in dir(stepdir) if not k.startswith("__")}
    )
    ih.stepdir.commit = timed("commit", stepdir.commit, main=True)
    ih.stepdir.publish_step = timed("publish", stepdir.publish_step, main=True)
    ih.item_writer = types.SimpleNamespace(
        **{k: getattr(ih.item_writer, k) for k in dir(ih.item_writer) if not k.startswith("__")}
    )
    ih.item_writer.create_array = timed("create arrays", ih.item_writer.create_array)
    # worker phases
    si.HfDir.read = timed("read (preadv)", si.HfDir.read, size=out_bytes)
    ih.cast = timed("cast", ih.cast)
    th.apply_hook_fns = timed("MaxText's hooks", th.apply_hook_fns, size=out_bytes)
    ih._slice = timed("slice made (read + cast + hooks)", ih._slice)
    ih._write_slice = timed(
        "write slice (copies + tensorstore)",
        ih._write_slice,
        size=lambda a, o: a[3].nbytes,
        shape_of=lambda a: a[3],
    )
    # the row blocks a transposed slice is copied into (`import_hf._copy`)
    ih._copy = timed(
        "row-block copy", ih._copy, size=lambda a, o: a[0].nbytes, shape_of=lambda a: a[1]
    )

    waits: list[tuple[float, float, int]] = []  # (at s, waited s, bytes asked)

    class TimedBudget(ih.Gate):
        def take(self, n, **kw):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return super().take(n, **kw)
            finally:
                add("budget wait", time.perf_counter() - w, time.thread_time() - c)
                with lock:
                    waits.append((round(w - t_start, 2), round(time.perf_counter() - w, 2), n))

    ih.Gate = TimedBudget
    samples, stop = [], threading.Event()

    def sample():
        while not stop.wait(0.05):
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1])
            samples.append((time.perf_counter() - t_start, rss, current["phase"]))

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    report = ih.import_hf(
        a.hf,
        a.out,
        maxtext_config=a.config,
        save_dtype="bfloat16",
        memory_budget=parse_size(a.memory_budget),
    )
    wall = time.perf_counter() - t0
    stop.set()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    peak = max(samples, key=lambda x: x[1]) if samples else (0, 0, "")
    by_phase: dict[str, int] = {}
    for _, rss, ph in samples:
        by_phase[ph] = max(by_phase.get(ph, 0), rss)
    print(
        json.dumps(
            {
                "imports_s": round(t_imported - t_start, 2),
                "import_hf_s": round(wall, 2),
                "user_s": round(ru.ru_utime, 1),
                "sys_s": round(ru.ru_stime, 1),
                "vm_hwm_mib": round(rs.vm_hwm_kib() / 1024),
                "rss_peak_sampled": {
                    "at_s": round(peak[0], 1),
                    "mib": round(peak[1] / 1024),
                    "phase": peak[2],
                },
                "rss_peak_by_phase_mib": {k: round(v / 1024) for k, v in by_phase.items()},
                "bytes_read": report.bytes_read,
                "budget_waits_over_1s": [x for x in waits if x[1] > 1],
                "by_shape": [
                    {
                        "phase": k[0],
                        "shape": k[1],
                        "c_contiguous": k[2],
                        "calls": v[0],
                        "wall_s": round(v[1], 2),
                        "thread_cpu_s": round(v[2], 2),
                        "gib": round(v[3] / GIB, 2),
                    }
                    for k, v in sorted(by_shape.items(), key=lambda kv: -kv[1][2])
                ],
                "phases": {
                    k: {
                        "calls": v[0],
                        "wall_s": round(v[1], 2),
                        "thread_cpu_s": round(v[2], 2),
                        "gib": round(v[3] / GIB, 2),
                    }
                    for k, v in stats.items()
                },
            }
        ),
        flush=True,
    )


# == the orchestrator ============================================================================
def _cpu_ticks() -> tuple[int, int]:
    """(busy ticks, steal ticks) of the whole machine, from /proc/stat."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    v = [int(x) for x in f]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return user + nice + system + irq + softirq, steal


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_quiet(limit: float, wait: float) -> dict:
    """Waits until the 1-minute load average is below ``limit``, at most ``wait`` seconds."""
    t0 = time.monotonic()
    load = _load()
    while load >= limit and time.monotonic() - t0 < wait:
        print(f"load {load:.2f} >= {limit}: waiting ...", file=sys.stderr, flush=True)
        time.sleep(15)
        load = _load()
    waited = time.monotonic() - t0
    quiet = load < limit
    print(
        f"load {load:.2f} after {waited:.0f} s: {'quiet' if quiet else 'running anyway'}",
        file=sys.stderr,
        flush=True,
    )
    return {"load_1min": load, "waited_s": round(waited), "quiet": quiet}


class Bench:
    def __init__(self, args, work: Path, step: Path, hf: Path, params: dict):
        self.args, self.work, self.step, self.hf, self.params = args, work, step, hf, params
        self.scratch = work / "scratch"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.logs = work / "logs" / time.strftime("%Y%m%d-%H%M%S")
        self.logs.mkdir(parents=True, exist_ok=True)
        self.st_bytes = sum(f.stat().st_size for f in _safetensors(hf))
        self.runs: list[dict] = []
        self.problems: list[str] = []
        self.check: dict | None = None
        self.adapter: Path | None = None  # --adapter: the PEFT adapter directory

    def _mt(self) -> list[str]:
        return ["--maxtext-config", str(rs.base_yml()), *model_keys(self.params)]

    def commands(self, op: str, out: Path) -> tuple[list[str], dict]:
        a = self.args
        py = sys.executable
        env = rs.child_env([REPO])
        if op == "cp":
            return ["cp", "-r", str(self.hf), str(out)], rs.child_env(None)
        if op == "floor":
            return [py, str(Path(__file__)), "floor", str(self.hf)], env
        if op in ("dry-run", "import-hf", "import-hf-adapter"):
            env = rs.child_env([self.args.package])
            cmd = [py, "-m", PKG, "import-hf", str(self.hf), "--out", str(out)]
            cmd += ["--save-dtype", "bfloat16", "--memory-budget", a.budget, "--json"]
            cmd += ["--dry-run"] if op == "dry-run" else []
            cmd += ["--adapter", str(self.adapter)] if op == "import-hf-adapter" else []
            return [*cmd, *self._mt()], env
        if op == "to-maxtext":
            cmd = [py, "-m", "maxtext.checkpoint_conversion.to_maxtext", str(rs.base_yml())]
            cmd += model_keys(self.params)
            cmd += [
                f"base_output_directory={out}",
                "hardware=cpu",
                "skip_jax_distributed_system=True",
            ]
            cmd += [f"--hf_model_path={self.hf}", "--save_dtype=bfloat16"]
            cmd += ["--simulated_cpu_devices_count=2"]
            return cmd, rs.child_env(None)
        raise ValueError(op)

    def measure(self, op: str, repeat: int) -> dict:
        out = self.scratch / f"out-{op}"
        ro.settle(out)
        run = {"op": op, "repeat": repeat}
        writes = op in ("cp", "import-hf", "import-hf-adapter", "to-maxtext")
        free = shutil.disk_usage(self.work).free
        if writes and free < self.st_bytes + 2 * GIB:
            run.update(rc="disk", error=f"{free / GIB:.1f} GiB free")
            self.problems.append(f"{op} #{repeat}: not run, {run['error']}")
            self.runs.append(run)
            return run
        cmd, env = self.commands(op, out)
        ro.warm_cache(self.hf)
        label = f"{op}-{repeat}"
        log = self.logs / f"{label}.log"
        timeout = self.args.maxtext_timeout if op == "to-maxtext" else self.args.timeout
        print(f"[{label}] {' '.join(cmd[:8])} ...", file=sys.stderr, flush=True)
        load, (busy0, steal0) = _load(), _cpu_ticks()
        res = rw.wrapped([cmd], env, self.scratch, [log], timeout)
        busy1, steal1 = _cpu_ticks()
        hz = os.sysconf("SC_CLK_TCK")
        p = res["procs"][0]
        run.update(
            rc=p["rc"],
            wall=res["wall"],
            peak_rss_kib=p["maxrss_kib"],
            user_s=p["user_s"],
            sys_s=p["sys_s"],
            minflt=p["minflt"],
            load_before=load,
            others_cpu_s=round((busy1 - busy0) / hz - p["user_s"] - p["sys_s"], 1),
            steal_s=round((steal1 - steal0) / hz, 1),
            **{k: p.get(k, 0) for k in ("rchar", "read_bytes", "wchar", "write_bytes")},
        )
        lines = log.read_text(errors="replace").splitlines()
        if op in ("floor", "dry-run", "import-hf", "import-hf-adapter") and p["rc"] == 0:
            run["report"] = _last_json(lines)
        if op == "import-hf-adapter" and p["rc"] == 0:
            self.check_merged(run)
        if op == "to-maxtext" and p["rc"] != 0:
            # killed for memory shows as -9 (SIGKILL); record how far it got
            run["error"] = rw.tail(log, 15)[-3000:]
            run["output_bytes"] = rs.du(out) if out.exists() else 0
        elif p["rc"] != 0:
            run["error"] = rw.tail(log, 30)[-4000:]
            self.problems.append(f"{label}: exit {p['rc']} (log {log})\n{run['error']}")
        if op in ("import-hf", "import-hf-adapter", "to-maxtext", "cp") and out.exists():
            run["output_bytes"] = rs.du(out)
        print(
            f"[{label}] rc {p['rc']}, {res['wall']:.1f} s, peak RSS {p['maxrss_kib'] / 1024:.0f} MiB, "
            f"rchar {p.get('rchar', 0) / GIB:.2f} GiB, CPU {p['user_s']} + {p['sys_s']} s, "
            f"others' CPU {run['others_cpu_s']} s, load before {load:.2f}",
            file=sys.stderr,
            flush=True,
        )
        self.runs.append(run)
        if op == "import-hf" and p["rc"] == 0 and self.check is None and not self.args.no_check:
            self.run_check(out)
        ro.settle(out)
        return run

    def check_merged(self, run: dict) -> None:
        """The merge's report names every linear weight of every layer as merged."""
        got = ((run.get("report") or {}).get("adapter") or {}).get("tensors")
        want = len(ial.shapes(ial.TINY)) * self.params["layers"]
        if got != want:
            self.problems.append(
                f"import-hf-adapter #{run['repeat']}: merged {got} tensors, not {want}"
            )

    def run_check(self, out: Path) -> None:
        log = self.logs / "check.log"
        out_json = self.logs / "check.json"
        cmd = [sys.executable, str(Path(__file__)), "check", str(out / "0"), str(self.step)]
        cmd += [json.dumps(self.params), str(out_json)]
        print(
            "[check] stock Orbax restores of the import's params ...", file=sys.stderr, flush=True
        )
        res = rw.wrapped([cmd], rs.child_env([REPO]), self.scratch, [log], self.args.timeout)
        p = res["procs"][0]
        self.check = json.loads(out_json.read_text()) if out_json.exists() else {"problems": []}
        self.check.update(rc=p["rc"], wall=round(res["wall"], 1), peak_rss_kib=p["maxrss_kib"])
        if p["rc"] != 0:
            self.problems.append(f"check: exit {p['rc']} (log {log})\n{rw.tail(log, 30)}")
        print(
            f"[check] rc {p['rc']} in {res['wall']:.0f} s: {self.check.get('problems')}",
            file=sys.stderr,
        )


def _last_json(lines: list[str]) -> dict | None:
    """The last JSON object a child printed: one line, or indented over lines ``{`` .. ``}``."""
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                pass
        if line == "}":
            start = max((j for j in range(i) if lines[j] == "{"), default=None)
            if start is not None:
                try:
                    return json.loads("\n".join(lines[start : i + 1]))
                except ValueError:
                    pass
    return None


def ensure_hf(work: Path, params: dict, step: Path, budget: str, timeout: float) -> dict:
    """``<work>/hf``: export-hf of the step, reused while ``<work>/hf.json`` records the same
    step parameters."""
    hf, marker = work / "hf", work / "hf.json"
    want = {"step": params, "version": HF_VERSION}
    if marker.exists():
        info = json.loads(marker.read_text())
        if info.get("for") == want and (hf / "config.json").is_file() and _safetensors(hf):
            print(f"reusing {hf}", file=sys.stderr)
            return info
    marker.unlink(missing_ok=True)
    shutil.rmtree(hf, ignore_errors=True)
    cmd = [sys.executable, "-m", PKG, "export-hf", str(step), "--out", str(hf)]
    cmd += ["--hf-model-path", str(rs.TOKENIZER), "--memory-budget", budget]
    if params["layers"] != rs.LLAMA_LAYERS:
        cmd.append("--override-model-architecture")
    cmd += ["--maxtext-config", str(rs.base_yml()), *params["model_keys"]]
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"exporting {step} to {hf} ...", file=sys.stderr, flush=True)
    res = rw.wrapped([cmd], rs.child_env([REPO]), work, [logs / "export-hf.log"], timeout)
    p = res["procs"][0]
    if p["rc"] != 0:
        shutil.rmtree(hf, ignore_errors=True)
        raise SystemExit(
            f"export-hf failed (exit {p['rc']}):\n{rw.tail(logs / 'export-hf.log', 40)}"
        )
    files = _safetensors(hf)
    info = {
        "for": want,
        "command": cmd,
        "export_s": round(res["wall"], 1),
        "export_peak_rss_kib": p["maxrss_kib"],
        "safetensors_files": len(files),
        "safetensors_bytes": sum(f.stat().st_size for f in files),
        "dir_bytes": rs.du(hf),
    }
    marker.write_text(json.dumps(info, indent=1))
    print(
        f"exported in {res['wall']:.0f} s: {len(files)} safetensors files, "
        f"{info['safetensors_bytes'] / GIB:.2f} GiB",
        file=sys.stderr,
    )
    return info


def ensure_adapter(work: Path, layers: int, rank: int, tiny: bool) -> Path:
    """``<work>/adapter-...``: `bench/import_as_lora.py`'s PEFT adapter of the model, made in a
    child (NumPy and the adapter's 160 MiB of values stay out of this process, whose peak RSS
    a child's ``ru_maxrss`` would start from)."""
    d = work / f"adapter-{layers}-{rank}-{int(tiny)}"
    code = (
        "import sys, pathlib, import_as_lora as ial; "
        f"ial.make_adapter(pathlib.Path(sys.argv[1]), ial.{'TINY' if tiny else 'FULL'}, "
        f"{layers}, {rank})"
    )
    env = rs.child_env([REPO])
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", code, str(d)], env=env, check=True, cwd=HERE)
    return d


def summarize(b: Bench, hfinfo: dict, quiet: dict) -> dict:
    budget = parse_size(b.args.budget)

    def ok(op):
        return [r for r in b.runs if r["op"] == op and r.get("rc") == 0]

    def med(runs, k):
        vals = [r[k] for r in runs if r.get(k) is not None]
        return statistics.median(vals) if vals else None

    dry, floor_runs = ok("dry-run"), ok("floor")
    imports_kib = max((r["peak_rss_kib"] for r in dry), default=None)
    imports_rchar = med(dry, "rchar") or 0
    floor_wall = med(floor_runs, "wall")
    cp_wall = med(ok("cp"), "wall")
    mt = ok("to-maxtext")
    mt_wall = med(mt, "wall")
    base_wall = med(ok("import-hf"), "wall")
    rows = []
    for op in OPS:
        runs = ok(op)
        failed = [r for r in b.runs if r["op"] == op and r.get("rc") != 0]
        if not runs and not failed:
            continue
        src = runs or failed
        wall = med(src, "wall")
        rchar = med(src, "rchar")
        row = {
            "op": op,
            "runs": len(runs),
            "failed": [str(r.get("rc")) for r in failed],
            "wall_s": round(wall, 2) if wall is not None else None,
            "cpu_s": round(statistics.median(r["user_s"] + r["sys_s"] for r in src), 1)
            if src and "user_s" in src[0]
            else None,
            "user_s": med(src, "user_s"),
            "sys_s": med(src, "sys_s"),
            "x_cp": round(wall / cp_wall, 2) if wall and cp_wall else None,
            "x_floor": round(wall / floor_wall, 2) if wall and floor_wall else None,
            "peak_rss_mib": round(max(r["peak_rss_kib"] for r in src) / 1024)
            if src and "peak_rss_kib" in src[0]
            else None,
            "rchar_gib": round(rchar / GIB, 3) if rchar is not None else None,
            "rchar_over_imports_gib": round((rchar - imports_rchar) / GIB, 3)
            if rchar is not None and op in ("import-hf", "import-hf-adapter", "to-maxtext")
            else None,
            "write_bytes_gib": round(med(src, "write_bytes") / GIB, 3)
            if med(src, "write_bytes") is not None
            else None,
            "load_before": [r.get("load_before") for r in src],
            "others_cpu_s": [r.get("others_cpu_s") for r in src],
            "steal_s": [r.get("steal_s") for r in src],
        }
        if op in ("import-hf", "to-maxtext") and rchar is not None:
            read = rchar - imports_rchar
            if op == "import-hf":
                # pages mapped by an import before issue 58 (HfDir.view) were read without a
                # read(2): rchar missed them, the report counts them
                reps = [r["report"] for r in runs if r.get("report")]
                read = max([read] + [r.get("bytes_read", 0) for r in reps])
            row["x_safetensors"] = round(read / b.st_bytes, 3)
        if op == "floor":
            row["floor_pass_s"] = med([r["report"] for r in runs if r.get("report")], "wall_s")
        if op in ("dry-run", "import-hf", "import-hf-adapter"):
            reps = [r["report"] for r in runs if r.get("report")]
            row["report"] = reps[-1] if reps else None
        if op == "to-maxtext" and failed:
            row["error"] = failed[-1].get("error")
        goals = []
        if op == "import-hf" and wall is not None:
            goals.append(("≤ 2x the floor", row["x_floor"], 2.0))
            goals.append(("≤ 34 s", row["wall_s"], 34.0))
            if mt_wall:
                row["x_to_maxtext"] = round(wall / mt_wall, 3)
                goals.append(("≤ 1/3 of this run's to_maxtext", row["x_to_maxtext"], 1 / 3))
            if imports_kib is not None:
                bound = imports_kib / 1024 + (budget + 512 * MIB) / MIB
                row["rss_bound_mib"] = round(bound)
                row["rss_over_imports_mib"] = round(row["peak_rss_mib"] - imports_kib / 1024)
                goals.append(
                    (
                        f"peak RSS ≤ imports + budget + 512 MiB ({bound:.0f} MiB)",
                        row["peak_rss_mib"],
                        bound,
                    )
                )
            goals.append(
                (
                    "bytes read (rchar over imports; the report's, mapped) ≤ 1.05x safetensors",
                    row.get("x_safetensors"),
                    1.05,
                )
            )
        if op == "import-hf-adapter" and wall is not None:
            goals += _adapter_goals(row, wall, base_wall, imports_kib, budget)
        row["goals"] = [
            {"goal": g, "value": v, "held": None if v is None else v <= lim} for g, v, lim in goals
        ]
        rows.append(row)
    return {
        "params": {
            "layers": b.params["layers"],
            "seed": b.params["seed"],
            "budget": b.args.budget,
            "repeats": b.args.repeats,
            "ops": b.args.ops,
            "package": str(b.args.package),
            "adapter_rank": b.args.adapter_rank if b.args.adapter else None,
        },
        "hf": {**hfinfo, "dir": str(b.hf)},
        "safetensors_bytes": b.st_bytes,
        "imports_peak_rss_mib": round(imports_kib / 1024) if imports_kib else None,
        "imports_rchar_gib": round(imports_rchar / GIB, 3),
        "to_maxtext_before_s": TO_MAXTEXT_BEFORE_S,
        "quiet": quiet,
        "check": b.check,
        "rows": rows,
        "runs": b.runs,
        "problems": b.problems,
        "ok": not b.problems,
    }


def _adapter_goals(row: dict, wall: float, base_wall, imports_kib, budget: int) -> list:
    """Issue 60's goals of the merge: its wall over the base's import (this run's medians),
    its peak RSS over the imports (the dry run's peak) + the budget + 512 MiB."""
    goals = []
    if base_wall:
        row["x_import_hf"] = round(wall / base_wall, 3)
        goals.append((f"≤ {ADAPTER_RATIO}x import-hf", row["x_import_hf"], ADAPTER_RATIO))
    if imports_kib is not None:
        bound = imports_kib / 1024 + (budget + 512 * MIB) / MIB
        row["rss_bound_mib"] = round(bound)
        row["rss_over_imports_mib"] = round(row["peak_rss_mib"] - imports_kib / 1024)
        goals.append((f"peak RSS ≤ imports + budget + 512 MiB ({bound:.0f} MiB)",
                      row["peak_rss_mib"], bound))  # fmt: skip
    return goals


def report(s: dict) -> None:
    gib = s["safetensors_bytes"] / GIB
    print(
        f"\nllama3.1-8b at {s['params']['layers']} layers, {s['hf']['safetensors_files']} bf16 "
        f"safetensors files ({gib:.2f} GiB), --memory-budget {s['params']['budget']}, "
        f"{s['params']['repeats']} repeat(s), medians (peak RSS: the largest); load before the "
        f"timed runs {s['quiet']['load_1min']:.2f} after waiting {s['quiet']['waited_s']} s\n"
    )
    print(
        "| operation | wall s | x `cp -r` | x floor | CPU s (user + kernel) | peak RSS MiB "
        "| rchar GiB (over imports) | written GiB | goal | held |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in s["rows"]:
        if r["wall_s"] is None or r["runs"] == 0:
            why = ", ".join(r["failed"])
            extra = f" after {r['wall_s']} s" if r["wall_s"] is not None else ""
            rss = f"{r['peak_rss_mib']:,}" if r.get("peak_rss_mib") else ""
            print(f"| {r['op']} | failed ({why}){extra} | | | | {rss} | | | | |")
            continue
        goals = "; ".join(g["goal"] for g in r["goals"]) or ""
        held = "; ".join(
            {True: "held", False: "**not held**", None: "?"}[g["held"]] for g in r["goals"]
        )
        over = (
            f" ({r['rchar_over_imports_gib']})"
            if r.get("rchar_over_imports_gib") is not None
            else ""
        )
        cpu = f"{r['user_s']:.1f} + {r['sys_s']:.1f}" if r.get("user_s") is not None else ""
        print(
            f"| {r['op']} | {r['wall_s']} | {r['x_cp'] or ''} | {r['x_floor'] or ''} | {cpu} | "
            f"{r['peak_rss_mib']:,} | {r['rchar_gib']}{over} | {r['write_bytes_gib']} | {goals} | {held} |"
        )
    merged = next((r for r in s["rows"] if r["op"] == "import-hf-adapter" and r["runs"]), None)
    if merged is not None:
        print(
            f"\nimport-hf --adapter (rank {s['params']['adapter_rank']}, every linear module): "
            f"{merged['wall_s']} s, {merged.get('x_import_hf')}x import-hf's wall; peak RSS "
            f"{merged['peak_rss_mib']:,} MiB ({merged.get('rss_over_imports_mib')} over imports, "
            f"bound {merged.get('rss_bound_mib')})"
        )
    c = s.get("check")
    if c:
        print(
            f"\ncheck (against {c.get('against')}): {len(c.get('checked', []))} params, problems: {c.get('problems')}"
        )
        for x in c.get("checked", []):
            print(f"  {x}")
    if s["problems"]:
        print("\nPROBLEMS:")
        for x in s["problems"]:
            print(f"- {x}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/omtl-importhf"))
    ap.add_argument("--layers", type=int, default=rs.LLAMA_LAYERS, help="llama layers (default 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--step",
        default=STEP_NAME,
        choices=[STEP_NAME, "llama-fsdp"],
        help=f"the realsize.py step exported to the input (default {STEP_NAME})",
    )
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="the model cut to a few MiB (realsize_steps.TINY): a smoke run, not a measure",
    )
    ap.add_argument(
        "--budget", default="2GiB", help="--memory-budget of import-hf (and of the export)"
    )
    ap.add_argument("--ops", nargs="+", choices=OPS, help=f"default: {' '.join(DEFAULT_OPS)}")
    ap.add_argument(
        "--adapter",
        action="store_true",
        help="merge a PEFT adapter of every linear module too (import-hf-adapter), "
        f"default ops then: {' '.join(ADAPTER_OPS)}",
    )
    ap.add_argument("--adapter-rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per operation")
    ap.add_argument("--maxtext-timeout", type=float, default=900, help="seconds for to_maxtext")
    ap.add_argument("--quiet-load", type=float, default=1.5)
    ap.add_argument("--quiet-wait", type=float, default=900)
    ap.add_argument("--remove-step", action="store_true", help="delete the step once exported")
    ap.add_argument("--prepare-only", action="store_true", help="build and export only")
    ap.add_argument("--no-check", action="store_true", help="skip the check of import-hf's output")
    ap.add_argument(
        "--package",
        type=Path,
        default=REPO,
        metavar="DIR",
        help="the checkout whose package import-hf (and its dry run) runs (default: this one)",
    )
    ap.add_argument("--json", type=Path, metavar="FILE", help="write every figure here")
    args = ap.parse_args(argv)
    args.ops = args.ops or list(ADAPTER_OPS if args.adapter else DEFAULT_OPS)
    if "import-hf-adapter" in args.ops and not args.adapter:
        raise SystemExit("--ops import-hf-adapter needs --adapter")
    parse_size(args.budget)
    args.package = args.package.resolve()
    if rs.package_of(args.package) != args.package / PKG:
        raise SystemExit(f"{args.package}: the children import another {PKG}")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    params = rs.step_params(args.step, args.layers, 4, args.seed, args.tiny)
    step = rs.step_path(work, args.step)
    marker = json.loads((work / "hf.json").read_text()) if (work / "hf.json").exists() else {}
    hf_ok = marker.get("for") == {"step": params, "version": HF_VERSION} and (work / "hf").is_dir()
    if not hf_ok or (step.parent.exists() and not args.remove_step):
        ro.ensure_step(work, args.step, params, args.timeout)
    hfinfo = ensure_hf(work, params, step, args.budget, args.timeout)
    if args.remove_step and step.parent.exists():
        shutil.rmtree(step.parent)
        (work / f"{args.step}.step.json").unlink(missing_ok=True)
        os.sync()
    if args.prepare_only:
        return 0
    b = Bench(args, work, step, work / "hf", params)
    if args.adapter:
        b.adapter = ensure_adapter(work, params["layers"], args.adapter_rank, args.tiny)
    quiet = wait_quiet(args.quiet_load, args.quiet_wait)
    try:
        for r in range(args.repeats):
            for op in args.ops:
                b.measure(op, r)
    finally:
        ro.settle(b.scratch)
    s = summarize(b, hfinfo, quiet)
    report(s)
    if args.json:
        args.json.write_text(json.dumps(s, indent=1))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    verb = sys.argv[1:2]
    if verb == ["floor"]:
        ap = argparse.ArgumentParser(prog="import_hf.py floor")
        ap.add_argument("hf", type=Path)
        ap.add_argument("--threads", type=int, default=2)
        ap.add_argument("--level", type=int, default=1)
        a = ap.parse_args(sys.argv[2:])
        print(json.dumps(floor(a.hf, a.threads, a.level)), flush=True)
    elif verb == ["phases"]:
        phases(sys.argv[2:])
    elif verb == ["check"]:
        check(Path(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[4]), Path(sys.argv[5]))
    else:
        sys.exit(main())
