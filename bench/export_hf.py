"""Benchmark: export-hf's time and memory against MaxText 0.2.5's own exporter, side by side.

    V=$(ls -d /root/.cache/orbax-maxtext-layout/interop-venv-*)
    PYTHONPATH=$PWD $V/bin/python bench/export_hf.py --layers 8 --budgets 512MiB --repeats 3

Run it with a Python that has MaxText 0.2.5 (the interop venv); the children run with the
same interpreter. The input is built once per run, in its own process: a MaxText param-only
step, ``<root>/0/items`` holding ``params/params/decoder/...`` (Orbax, OCDBT + zarr3, as
MaxText's save_checkpoint writes it; ``custom_metadata={"scan_layers": true}`` in the step's
``_CHECKPOINT_METADATA``, as MaxText records it), for MaxText's ``llama3.1-8b`` config with
``override_model_config=true`` and these overrides (`model_keys`): emb 1024, mlp 3584, 16
query heads, 8 kv heads, head_dim 64, ``--layers`` decoder layers (default 8), vocab 32768,
``weight_dtype`` ``--weight-dtype`` (default float32), ``scan_layers=true``,
``param_scan_axis=1``. Its tree and shapes are what MaxText builds for that config
(`_internal.abstract_items`: MaxText's own abstract train state);
its values are random. Defaults: 688 MiB of float32 weights. A local tokenizer
(tests/fixtures/hf_tokenizer if present, else one written by
tests/interop/hf_export_support.write_tokenizer) stands in for the Hub's.

Operations, each in a fresh child process, in rotating order within one run, from the page
cache:

- ``maxtext``: ``python -m maxtext.checkpoint_conversion.to_huggingface <base.yml> <model
  keys> hardware=cpu skip_jax_distributed_system=true load_parameters_path=<step>/items
  base_output_directory=<out> --override_model_architecture --hf_model_path=<tokenizer>``
  (Base mode; this library is not on its path);
- ``ours@BUDGET``: ``python -m orbax_maxtext_layout export-hf <step> --out <out>
  --hf-model-path <tokenizer> --override-model-architecture --memory-budget BUDGET
  --maxtext-config <base.yml> <model keys>``, with the package of ``--package`` (default: this
  checkout) first on PYTHONPATH;
- ``baseline``: imports what both import (jax with its CPU backend up, MaxText's exporter
  module with transformers, Orbax, this package) and does nothing.

Each command runs under a small standard-library wrapper: wall time is the command's, start
to exit (imports included: what a user waits for); peak RSS is
``getrusage(RUSAGE_CHILDREN).ru_maxrss`` in the wrapper, the VmHWM of the command and of any
process it waited for. The orchestrating process imports the standard library only, as the
wrapper does: a child's ru_maxrss starts at its parent's high-water mark. Figures are
medians of the repeats (peak RSS: the largest); "over baseline" subtracts the baseline's
peak; the x maxtext columns divide by MaxText's.

Every ``ours`` output is checked against MaxText's (the first MaxText run's output, kept)
before its figures count, in a separate process, one tensor at a time: the same tensor
names, dtypes, shapes and bytes (read from the safetensors headers and data directly; each
file must also open with ``safetensors.safe_open``), the same ``__metadata__``, a
``model.safetensors.index.json`` (where there is more than one file) mapping every tensor to
the file that holds it, and the same ``config.json``.

The claim checked: ours' peak RSS over baseline stays within ``budget + 3 * the largest
per-layer slice`` (one layer of the largest scanned weight, in the output dtype, which is
``weight_dtype``). Exit status 1 if ours is absent or fails, if its output differs from
MaxText's, if it breaks the bound, or if MaxText's exporter fails.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from realsize_steps import TINY, TINY_COMMON, child_env, package_of

# Standard library only at the top (realsize_steps too): the orchestrator and the wrapper
# must stay small.
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STEP = 0
TOKENIZER_FIXTURE = REPO / "tests" / "fixtures" / "hf_tokenizer"
EXPORT_MODULE = "maxtext.checkpoint_conversion.to_huggingface"
TIMEOUT_S = 1800
SIZES = {
    "base_emb_dim": 1024,
    "base_mlp_dim": 3584,
    "base_num_query_heads": 16,
    "base_num_kv_heads": 8,
    "head_dim": 64,
    "vocab_size": 32768,
}
# ``--tiny``: realsize.py's tiny llama (a few MiB: the smoke run's model), every other key as above
TINY_SIZES = {
    **SIZES,
    **{k: int(v) for k, v in (x.split("=") for x in TINY["llama"] + TINY_COMMON)},
}


def model_keys(layers: int, weight_dtype: str, sizes: dict[str, int] = SIZES) -> list[str]:
    """MaxText's config overrides of the benchmarked model (after ``base.yml``)."""
    return [
        "model_name=llama3.1-8b",
        "override_model_config=true",
        *(f"{k}={v}" for k, v in sizes.items()),
        f"base_num_decoder_layers={layers}",
        f"weight_dtype={weight_dtype}",
        "scan_layers=true",
        "param_scan_axis=1",
    ]


def parse_size(text: str) -> int:
    """``512MiB``, ``1GiB``, ``600MB``, ``1024`` -> bytes (the orchestrator imports no package)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * (1024 if m.group(3) or not m.group(2) else 1000) ** power)


def _mib(n: float) -> float:
    return n / 2**20


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


# -- the input (its own process) -------------------------------------------------------------
def base_yml() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("maxtext").origin).parent / "configs" / "base.yml"


def build(work: Path, layers: int, weight_dtype: str, sizes: dict[str, int] = SIZES) -> None:
    """Writes ``work/ckpt/<STEP>`` (the step), ``work/tokenizer`` and ``work/inputs.json``."""
    import contextlib
    import math

    import jax
    import ml_dtypes
    import numpy as np
    import orbax.checkpoint as ocp
    from _internal import abstract_items
    from etils import epath

    t0 = time.perf_counter()
    yml = base_yml()
    keys = model_keys(layers, weight_dtype, sizes)
    abstract = abstract_items([str(yml), *keys])["params"]  # {"params": {"decoder": ..., ...}}
    rng = np.random.default_rng(0)
    weight_bytes, slice_bytes, largest = 0, 0, ("", 0)
    out_itemsize = np.dtype(ml_dtypes.bfloat16 if weight_dtype == "bfloat16" else weight_dtype)
    out_itemsize = out_itemsize.itemsize

    def fill(path, leaf):
        nonlocal weight_bytes, slice_bytes, largest
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        dtype = np.dtype(leaf.dtype)
        x = rng.standard_normal(leaf.shape, np.float32)
        if name.endswith("scale"):  # norms: around 1
            x *= 0.1
            x += 1
        else:
            x *= 0.02
        x = x.astype(dtype, copy=False)
        weight_bytes += x.nbytes
        if x.nbytes > largest[1]:
            largest = (name, x.nbytes)
        if "/layers/" in name:  # scanned: the layer axis is param_scan_axis 1
            assert leaf.shape[1] == layers, (name, leaf.shape)
            slice_bytes = max(slice_bytes, math.prod(leaf.shape) // layers * out_itemsize)
        return x

    params = jax.tree_util.tree_map_with_path(fill, abstract)
    gen_s = time.perf_counter() - t0
    root = epath.Path(work / "ckpt")
    manager = ocp.CheckpointManager(
        root,
        item_handlers={"items": ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)},
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False),
    )
    try:
        manager.save(
            STEP,
            args=ocp.args.Composite(items=ocp.args.PyTreeSave({"params": params})),
            custom_metadata={"scan_layers": True},
            force=True,
        )
        manager.wait_until_finished()
    finally:
        manager.close()
    del params
    if TOKENIZER_FIXTURE.is_dir():
        tokenizer = TOKENIZER_FIXTURE
    else:
        sys.path.insert(0, str(REPO / "tests" / "interop"))
        from hf_export_support import write_tokenizer

        with contextlib.redirect_stdout(sys.stderr):
            tokenizer = write_tokenizer(work / "tokenizer")
    info = {
        "layers": layers,
        "weight_dtype": weight_dtype,
        **sizes,
        "base_yml": str(yml),
        "model_keys": keys,
        "step": str(work / "ckpt" / str(STEP)),
        "tokenizer": str(tokenizer),
        "weight_bytes": weight_bytes,
        "slice_bytes": slice_bytes,  # one layer of the largest scanned weight, output dtype
        "largest_array": {"name": largest[0], "bytes": largest[1]},
        "step_bytes": _du(work / "ckpt" / str(STEP)),
        "build_s": round(time.perf_counter() - t0, 1),
        "generate_s": round(gen_s, 1),
    }
    (work / "inputs.json").write_text(json.dumps(info, indent=1))


# -- the baseline child ------------------------------------------------------------------------
def baseline() -> None:
    """Imports what both exporters import, brings up jax's CPU backend, and does nothing."""
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):
        import jax
        import maxtext.checkpoint_conversion.to_huggingface  # noqa: F401
        import orbax.checkpoint  # noqa: F401
        import safetensors  # noqa: F401

        import orbax_maxtext_layout  # noqa: F401

        jax.numpy.zeros(8).block_until_ready()


# -- the wrapper (standard library only) -------------------------------------------------------
def wrap(log: Path, cwd: Path, cmd: list[str]) -> None:
    """Runs ``cmd``; prints its exit code, wall time and peak RSS (its own and that of anything
    it waited for) as JSON."""
    import resource

    with open(log, "wb") as f:
        t = time.perf_counter()
        try:
            rc = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, timeout=TIMEOUT_S
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -9
        wall = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"rc": rc, "wall": wall, "peak_rss_kib": rss}))


# -- the checker (its own process) -------------------------------------------------------------
def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _tensors(directory: Path, diffs: list[str]) -> tuple[dict, dict]:
    """``{name: (file, offset, nbytes, dtype, shape)}`` and ``{file name: __metadata__}``."""
    from safetensors import safe_open

    out, meta = {}, {}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        diffs.append(f"{directory}: no *.safetensors")
    for path in files:
        start, header = _header(path)
        meta[path.name] = header.pop("__metadata__", None)
        with safe_open(str(path), framework="numpy") as f:  # the file opens as a reader sees it
            if set(f.keys()) != set(header):
                diffs.append(f"{path.name}: safe_open lists other tensors than the header")
        for name, t in header.items():
            if name in out:
                diffs.append(f"{name}: in {out[name][0].name} and {path.name}")
            b, e = t["data_offsets"]
            out[name] = (path, start + b, e - b, t["dtype"], tuple(t["shape"]))
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        if set(weight_map) != set(out):
            diffs.append(f"{directory.name}: the index names other tensors than the files hold")
        for name, (path, *_rest) in out.items():
            if weight_map.get(name) not in (None, path.name):
                diffs.append(f"{name}: the index says {weight_map[name]}, it is in {path.name}")
    elif len(files) > 1:
        diffs.append(f"{directory.name}: {len(files)} files and no model.safetensors.index.json")
    return out, meta


def _same_bytes(a: tuple, b: tuple, chunk: int = 16 << 20) -> bool:
    (pa, oa, n, *_), (pb, ob, *_rest) = a, b
    with open(pa, "rb") as fa, open(pb, "rb") as fb:
        fa.seek(oa)
        fb.seek(ob)
        while n > 0:
            k = min(chunk, n)
            if fa.read(k) != fb.read(k):
                return False
            n -= k
    return True


def check(got_dir: Path, want_dir: Path) -> list[str]:
    """What differs between two HF exports (empty: the same tensors, bytes and config)."""
    diffs: list[str] = []
    got, got_meta = _tensors(got_dir, diffs)
    want, want_meta = _tensors(want_dir, diffs)
    diffs += [f"missing {n}" for n in sorted(set(want) - set(got))]
    diffs += [f"unexpected {n}" for n in sorted(set(got) - set(want))]
    for name in sorted(set(got) & set(want)):
        g, w = got[name], want[name]
        if g[3:] != w[3:]:
            diffs.append(f"{name}: {g[3]}{list(g[4])} vs MaxText's {w[3]}{list(w[4])}")
        elif g[2] != w[2] or not _same_bytes(g, w):
            diffs.append(f"{name}: other bytes")
    for m in {json.dumps(x, sort_keys=True) for x in want_meta.values()}:
        for f, x in got_meta.items():
            if json.dumps(x, sort_keys=True) != m:
                diffs.append(f"{f}: __metadata__ {x} vs MaxText's {json.loads(m)}")
    for name in ("config.json",):
        g, w = got_dir / name, want_dir / name
        if not g.exists():
            diffs.append(f"missing {name}")
        elif json.loads(g.read_text()) != json.loads(w.read_text()):
            a, b = json.loads(g.read_text()), json.loads(w.read_text())
            # Ours names the dtype written (MaxText's keeps its HF default, or none), and
            # keeps one layer_types entry per layer (docs/export-hf.md).
            keys = sorted(
                k
                for k in set(a) | set(b)
                if a.get(k) != b.get(k) and k not in ("dtype", "layer_types")
            )
            if keys:
                diffs.append(f"{name} differs in {keys}")
            if a.get("dtype") not in (None, i_dtype(got_dir)):
                diffs.append(f"{name}: dtype {a.get('dtype')} is not the dtype written")
    return diffs


def i_dtype(directory: Path) -> str:
    """The dtype of the tensors in ``directory``'s first safetensors file, as HF names it."""
    f = sorted(directory.glob("*.safetensors"))[0]
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    st = next(v["dtype"] for k, v in header.items() if k != "__metadata__")
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[st]


# -- the run -----------------------------------------------------------------------------------
def _run_child(cmd: list[str], env: dict, cwd: Path, log: Path) -> dict:
    """``cmd`` under the wrapper, in a fresh process."""
    wrapper = [sys.executable, str(Path(__file__)), "wrap", str(log), str(cwd), "--", *cmd]
    res = subprocess.run(wrapper, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def command(mode: str, info: dict, out: Path, package: Path) -> tuple[list[str], dict]:
    op, _, budget = mode.partition("@")
    py, keys = sys.executable, info["model_keys"]
    if op == "baseline":
        return [py, str(Path(__file__)), "baseline"], child_env([package])
    if op == "maxtext":
        return [
            py,
            "-m",
            EXPORT_MODULE,
            info["base_yml"],
            *keys,
            "hardware=cpu",
            "skip_jax_distributed_system=true",
            f"load_parameters_path={info['step']}/items",
            f"base_output_directory={out}",
            "--override_model_architecture",
            f"--hf_model_path={info['tokenizer']}",
        ], child_env(None)  # stock MaxText: this library is not on its path
    assert op == "ours", mode
    return [
        py,
        "-m",
        "orbax_maxtext_layout",
        "export-hf",
        info["step"],
        "--out",
        str(out),
        "--hf-model-path",
        info["tokenizer"],
        "--override-model-architecture",
        "--memory-budget",
        budget,
        "--maxtext-config",
        info["base_yml"],
        *keys,
    ], child_env([package])


def _tail(log: Path, n: int = 25) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join("    " + x for x in lines[-n:])


def _checked(got: Path, ref: Path, work: Path) -> list[str]:
    """`check` in a fresh process (the orchestrator stays small)."""
    res = subprocess.run(
        [sys.executable, str(Path(__file__)), "check", str(got), str(ref)],
        env=child_env([REPO]),
        capture_output=True,
        text=True,
        cwd=work,
    )
    if res.returncode != 0:
        return [f"the checker failed (exit {res.returncode}): {res.stderr.strip()[-2000:]}"]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _inputs(work: Path, layers: int, weight_dtype: str, tiny: bool) -> tuple[dict, float | None]:
    """The inputs under ``work``, built in a child unless ``work`` already holds them."""
    info_path = work / "inputs.json"
    sizes = TINY_SIZES if tiny else SIZES
    if info_path.exists():
        info = json.loads(info_path.read_text())
        same = (info["layers"], info["weight_dtype"]) == (layers, weight_dtype)
        if same and all(info.get(k) == v for k, v in sizes.items()) and Path(info["step"]).is_dir():
            return info, None
        raise SystemExit(f"{work} holds inputs of another size; give an empty --inputs DIR")
    work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    print(f"building the inputs in {work} ...", file=sys.stderr, flush=True)
    # Built in a child: a process that held the arrays would not be a fair parent.
    log = work / "build.log"
    with open(log, "wb") as f:
        rc = subprocess.run(
            [sys.executable, str(Path(__file__)), "build", str(work), str(layers), weight_dtype]
            + (["tiny"] if tiny else []),
            stdout=f,
            stderr=subprocess.STDOUT,
            env=child_env([REPO]),
            cwd=work,
        ).returncode
    if rc != 0:
        raise SystemExit(f"building the inputs failed (exit {rc}):\n{_tail(log, 40)}")
    return json.loads(info_path.read_text()), time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (default 8: 688 MiB)")
    ap.add_argument("--weight-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="realsize.py's tiny llama, a few MiB (with --min-weights 0): a smoke run, not a measure",
    )
    ap.add_argument("--budgets", nargs="+", default=["512MiB"], help="ours' --memory-budget")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["baseline", "maxtext", "ours"])
    ap.add_argument(
        "--min-weights",
        type=parse_size,
        default=parse_size("600MiB"),
        help="refuse a smaller model (default 600MiB; 0 for a quick smoke run)",
    )
    ap.add_argument(
        "--package",
        type=Path,
        default=REPO,
        metavar="DIR",
        help="the checkout whose orbax_maxtext_layout `ours` runs (default: this one)",
    )
    ap.add_argument(
        "--inputs",
        type=Path,
        metavar="DIR",
        help="build the inputs here and keep them, or reuse the ones built here before "
        "(default: a temporary directory, removed)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for b in args.budgets:
        parse_size(b)
    modes = [m for m in args.modes if m != "ours"]
    modes += [f"ours@{b}" for b in args.budgets] if "ours" in args.modes else []
    package = args.package.resolve()
    with tempfile.TemporaryDirectory(prefix="omtl-bench-export-hf-") as tmp:
        tmp = Path(tmp)
        work = args.inputs.resolve() if args.inputs else tmp
        info, build_s = _inputs(work, args.layers, args.weight_dtype, args.tiny)
        if info["weight_bytes"] < args.min_weights:
            raise SystemExit(
                f"{_mib(info['weight_bytes']):.0f} MiB of weights, below --min-weights "
                f"{_mib(args.min_weights):.0f} MiB: give more --layers"
            )
        if "ours" in args.modes or "baseline" in args.modes:
            imported = package_of(package)
            if imported != package / "orbax_maxtext_layout":
                raise SystemExit(f"--package {package}: the children import {imported}")
        cwd, logs = tmp / "cwd", tmp / "logs"
        cwd.mkdir()
        logs.mkdir()
        ref: Path | None = None  # the first MaxText export, kept for the checks
        pending: list[tuple[str, int, Path]] = []  # ours' outputs made before ref existed
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        failures: dict[str, list[str]] = {m: [] for m in modes}
        diffs: dict[str, list[str]] = {m: [] for m in modes}

        def settle(mode: str, r: int, out: Path) -> None:
            d = _checked(out, ref, tmp)
            shutil.rmtree(out, ignore_errors=True)
            runs[mode][r]["equal"] = not d
            diffs[mode] += d

        for r in range(args.repeats):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                out = tmp / f"out-{mode.replace('@', '-')}-{r}"
                log = logs / f"{mode.replace('@', '-')}-{r}.log"
                cmd, env = command(mode, info, out, package)
                print(f"[repeat {r + 1}/{args.repeats}] {mode} ...", file=sys.stderr, flush=True)
                got = _run_child(cmd, env, cwd, log)
                got["repeat"] = r
                runs[mode].append(got)
                if got["rc"] != 0:
                    failures[mode].append(f"repeat {r + 1}: exit {got['rc']}\n{_tail(log)}")
                    shutil.rmtree(out, ignore_errors=True)
                    continue
                if mode == "maxtext":
                    if ref is None:
                        ref = tmp / "maxtext-reference"
                        out.rename(ref)
                        for p in pending:
                            settle(*p)
                        pending.clear()
                    else:
                        shutil.rmtree(out, ignore_errors=True)
                elif mode.startswith("ours@"):
                    if ref is None:
                        pending.append((mode, len(runs[mode]) - 1, out))
                    else:
                        settle(mode, len(runs[mode]) - 1, out)
        for mode, _i, out in pending:  # MaxText never succeeded: nothing to compare against
            shutil.rmtree(out, ignore_errors=True)
            if "maxtext" in modes:  # else not asked for (a smoke run: --modes ours)
                diffs[mode].append("not checked: MaxText's exporter produced no output")

    summary = summarize(args, info, build_s, modes, runs, failures, diffs)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        report(summary)
    return 0 if summary["ok"] else 1


def summarize(args, info, build_s, modes, runs, failures, diffs) -> dict:
    def ok_runs(mode: str) -> list[dict]:
        return [x for x in runs.get(mode, []) if x["rc"] == 0]

    def med_wall(mode: str) -> float | None:
        xs = ok_runs(mode)
        return statistics.median(x["wall"] for x in xs) if xs else None

    def peak(mode: str) -> int | None:
        xs = ok_runs(mode)
        return max(x["peak_rss_kib"] for x in xs) if xs else None

    base = peak("baseline") or 0
    mt_wall, mt_peak = med_wall("maxtext"), peak("maxtext")
    mt_over = mt_peak - base if mt_peak is not None else None
    slice_mib = _mib(info["slice_bytes"])
    rows, problems = [], []
    for mode in modes:
        wall, pk = med_wall(mode), peak(mode)
        row: dict = {
            "op": mode,
            "runs": len(runs[mode]),
            "failed": len(failures[mode]),
            "wall_s": round(wall, 2) if wall is not None else None,
            "peak_rss_mib": round(pk / 1024, 1) if pk is not None else None,
            "rss_over_baseline_mib": round((pk - base) / 1024, 1) if pk is not None else None,
        }
        if wall is not None and mt_wall and mode != "baseline":
            row["x_maxtext_wall"] = round(wall / mt_wall, 2)
        if pk is not None and mt_over and mode != "baseline":
            row["x_maxtext_peak_rss"] = round(pk / mt_peak, 2)
            row["x_maxtext_rss_over_baseline"] = round((pk - base) / mt_over, 3)
        if failures[mode]:
            row["failures"] = failures[mode]
            problems.append(f"{mode}: failed in {len(failures[mode])} of {len(runs[mode])} runs")
        if mode.startswith("ours@"):
            budget_mib = _mib(parse_size(mode.partition("@")[2]))
            row["budget_mib"] = round(budget_mib, 1)
            row["bound_mib"] = round(budget_mib + 3 * slice_mib, 1)
            # None: not compared (MaxText's exporter not among the modes)
            compared = "maxtext" in modes
            row["equal_to_maxtext"] = (
                (bool(ok_runs(mode)) and not diffs[mode]) if compared else None
            )
            if diffs[mode]:
                row["diffs"] = sorted(set(diffs[mode]))[:40]
                problems.append(f"{mode}: its output differs from MaxText's")
            if pk is None:
                row["bound_holds"] = None
                if not failures[mode]:
                    problems.append(f"{mode}: no run")
            elif "baseline" not in modes:  # not checked: no floor to measure it over
                row["bound_holds"] = None
            else:
                row["bound_holds"] = row["rss_over_baseline_mib"] <= row["bound_mib"]
                if not row["bound_holds"]:
                    problems.append(f"{mode}: RSS over baseline above the bound")
            if row["equal_to_maxtext"] is False or not row["bound_holds"]:
                row["counts"] = False  # its figures do not count
        rows.append(row)
    if "maxtext" in modes and mt_wall is None:
        problems.append("maxtext: MaxText's exporter never succeeded")
    return {
        "inputs": {**info, "build_s_this_run": round(build_s, 1) if build_s else None},
        "largest_layer_slice_mib": round(slice_mib, 2),
        "repeats": args.repeats,
        "rows": rows,
        "problems": problems,
        "ok": not problems,
    }


def report(s: dict) -> None:
    i = s["inputs"]
    print(
        f"model: MaxText llama3.1-8b overridden: emb {i['base_emb_dim']}, mlp {i['base_mlp_dim']}, "
        f"{i['base_num_query_heads']} query / {i['base_num_kv_heads']} kv heads x "
        f"{i['head_dim']}, {i['layers']} layers (scanned, axis 1), vocab {i['vocab_size']}, "
        f"{i['weight_dtype']}: {_mib(i['weight_bytes']):.0f} MiB of weights, "
        f"{_mib(i['step_bytes']):.0f} MiB on disk (param-only step); largest array "
        f"{i['largest_array']['name']} {_mib(i['largest_array']['bytes']):.0f} MiB; largest "
        f"per-layer slice {s['largest_layer_slice_mib']} MiB ({i['weight_dtype']})"
        + (
            f"; built in {i['build_s_this_run']} s"
            if i.get("build_s_this_run")
            else " (inputs reused)"
        )
    )
    print(
        f"{s['repeats']} repeats, each op a fresh process, rotating order: medians of wall "
        "time, largest peak RSS (VmHWM of the command and its children); bound = budget + 3 x "
        "slice, against RSS over baseline\n"
    )
    print(
        "| op | wall s | x maxtext time | peak RSS MiB | RSS over baseline MiB "
        "| x maxtext RSS (over baseline) | bound MiB | bound holds | output = MaxText's |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in s["rows"]:
        if r["wall_s"] is None:
            print(f"| {r['op']} | failed ({r['failed']} of {r['runs']} runs) | | | | | | | |")
            continue
        fails = f" ({r['failed']} of {r['runs']} failed)" if r["failed"] else ""
        cells = [
            f"{r['op']}{fails}",
            r["wall_s"],
            r.get("x_maxtext_wall", ""),
            r["peak_rss_mib"],
            r["rss_over_baseline_mib"] if r["op"] != "baseline" else "",
            r.get("x_maxtext_rss_over_baseline", ""),
            r.get("bound_mib", ""),
            {True: "held", False: "**not held**", None: ""}.get(r.get("bound_holds"), ""),
            {True: "yes", False: "**no**"}.get(r.get("equal_to_maxtext"), ""),
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    for r in s["rows"]:
        for f in r.get("failures", [])[:1]:
            print(f"\n{r['op']} failed, {f}")
        if r.get("diffs"):
            print(f"\n{r['op']}: differs from MaxText's export:")
            for d in r["diffs"]:
                print(f"  - {d}")
    if s["problems"]:
        print("\nNOT OK: " + "; ".join(s["problems"]))


if __name__ == "__main__":
    verb = sys.argv[1:2]
    if verb == ["build"]:
        tiny = sys.argv[5:6] == ["tiny"]
        build(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], TINY_SIZES if tiny else SIZES)
    elif verb == ["baseline"]:
        baseline()
    elif verb == ["wrap"]:
        assert sys.argv[4] == "--", sys.argv
        wrap(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[5:])
    elif verb == ["check"]:
        print(json.dumps(check(Path(sys.argv[2]), Path(sys.argv[3]))))
    else:
        sys.exit(main())
