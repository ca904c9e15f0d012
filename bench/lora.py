"""Benchmark: merge-lora's memory and time, against cp -r and a naive merge, side by side.

    python bench/lora.py --size 1GiB --layers 8 --rank 16 --budgets 512MiB 1GiB --repeats 3

The inputs are built once per run in their own process: a llama-shaped MaxText base step
(bf16, scanned on axis 1, ``items`` written by Orbax as MaxText's save_checkpoint writes
it, at least ``--size`` of weights) and a Tunix LoRA adapter step (float32 qwix factors of
all 7 modules, rank ``--rank``), both with `tests/lora_writers.py`'s writers.

Each operation runs in a fresh child process (peak RSS is the process's own VmHWM), in
rotating order within one run, from the page cache. Figures are medians of the repeats
(peak RSS: the largest). ``baseline`` is a child that imports everything and plans the
merge from metadata but merges nothing; "RSS over baseline" is what the operation itself
added. ``naive`` restores the whole base params and the adapters with stock Orbax to host
numpy, merges each adapted kernel (per layer, float32, cast once, then stacked) and saves
the params with stock Orbax. Every merge's output is checked against numpy (one layer of
the largest kernel and of ``out``, whose layer axis sits among its contracting dims, plus
a grafted leaf) before its figures count.

The claim checked: a merge's peak RSS over baseline stays within
``memory_budget + 3 * the largest per-layer kernel slice`` (in the base dtype). It needs a
budget that holds the largest stored chunk of an adapted kernel, compressed and decoded:
Orbax writes an array saved from one host as one chunk, and any reader decodes a whole
chunk to get one layer of it (here 175 MiB compressed + 225 MiB decoded). A budget below
that (``--budgets 256MiB``) is reported as not holding: the chunk, not the budget, sets
the peak. Exit status 1 if any row's bound fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if not os.environ.get("OMTL_BENCH_BEFORE"):  # a MODE@before child imports from PYTHONPATH
    sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from child import _du, _vm_hwm_kib  # noqa: E402  (the bench's one VmHWM reader)
from inproc import python  # noqa: E402  (each child a fresh interpreter, but in a smoke run)
from realsize_steps import LORA_MODULES as MODULES  # noqa: E402  (module -> contracting dims)

HEAD_DIM, VOCAB = 128, 32000
ALPHA = 32.0
ADAPTER_STEP = 2
CHECKED = ("mlp/wi_0", "self_attention/out")  # merged kernels compared against numpy
GRAFTED = ("decoder", "layers", "pre_self_attention_layer_norm", "scale")  # never decoded


# -- the inputs ----------------------------------------------------------------------------
def dims(size: int, layers: int) -> dict:
    """Llama-shaped dims (MHA, head_dim 128, mlp 4 * emb) whose bf16 weights are >= ``size``."""

    def nbytes(emb: int) -> int:
        return 2 * (16 * layers * emb * emb + 2 * VOCAB * emb + (layers + 1) * 2 * emb)

    emb = HEAD_DIM
    while nbytes(emb) < size:
        emb += HEAD_DIM
    return {"emb": emb, "heads": emb // HEAD_DIM, "mlp": 4 * emb, "layers": layers}


def kernel_shapes(d: dict) -> dict[str, tuple[int, ...]]:
    """Per-layer kernel shape of each adapted module."""
    e, h, m = d["emb"], d["heads"], d["mlp"]
    return {
        "self_attention/query": (e, h, HEAD_DIM),
        "self_attention/key": (e, h, HEAD_DIM),
        "self_attention/value": (e, h, HEAD_DIM),
        "self_attention/out": (h, HEAD_DIM, e),
        "mlp/wi_0": (e, m),
        "mlp/wi_1": (e, m),
        "mlp/wo": (m, e),
    }


def _mod(name: str, leaf: str) -> tuple[str, ...]:
    return ("decoder", "layers", *name.split("/"), leaf)


def build(work: Path, size: int, layers: int, rank: int, seed: int = 0) -> None:
    """Writes ``work/base/0`` and ``work/sft/<ADAPTER_STEP>``, and ``work/inputs.json``."""
    import ml_dtypes
    import numpy as np

    sys.path.insert(0, str(HERE.parent / "tests"))
    from lora_writers import write_adapters, write_base

    d = dims(size, layers)
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16

    def normal(shape, std):
        x = rng.standard_normal(shape, np.float32)
        x *= std
        return x

    e, L = d["emb"], layers
    base = {
        ("token_embedder", "embedding"): normal((VOCAB, e), 1.0).astype(bf16),
        ("decoder", "decoder_norm", "scale"): (1 + normal((e,), 0.1)).astype(bf16),
        ("decoder", "logits_dense", "kernel"): normal((e, VOCAB), 0.02).astype(bf16),
        ("decoder", "layers", "pre_self_attention_layer_norm", "scale"): (
            1 + normal((e, L), 0.1)
        ).astype(bf16),
        ("decoder", "layers", "post_self_attention_layer_norm", "scale"): (
            1 + normal((e, L), 0.1)
        ).astype(bf16),
    }
    factors = {}
    # factor std s: |scale * (a @ b)| ~ (alpha / r) * sqrt(r) * s^2 = 0.02, the weights' std
    s = math.sqrt(0.02 / ((ALPHA / rank) * math.sqrt(rank)))
    for name, shape in kernel_shapes(d).items():
        k = MODULES[name]
        stacked = shape[:1] + (L,) + shape[1:]  # MaxText's param_scan_axis 1
        base[_mod(name, "kernel")] = normal(stacked, 0.02).astype(bf16)
        rows, cols = math.prod(shape[:k]), math.prod(shape[k:])
        factors[_mod(name, "kernel_lora_a")] = normal((rows, L, rank), s)
        factors[_mod(name, "kernel_lora_b")] = normal((rank, L, cols), s)
    write_base(work / "base", 0, base)
    write_adapters(work / "sft", ADAPTER_STEP, factors)
    info = {
        **d,
        "rank": rank,
        "alpha": ALPHA,
        "weight_bytes": sum(v.nbytes for v in base.values()),
        "adapter_bytes": sum(v.nbytes for v in factors.values()),
        # the largest per-layer slice of an adapted kernel, in the base dtype (bf16)
        "slice_bytes": max(2 * math.prod(s) for s in kernel_shapes(d).values()),
    }
    info["kernel_bytes"] = info["slice_bytes"] * L  # the largest adapted kernel, decoded
    info["stored_chunk_bytes"] = _largest_stored_chunk(work / "base" / "0" / "items")
    (work / "inputs.json").write_text(json.dumps(info))


def _largest_stored_chunk(item_dir: Path) -> int:
    """The largest stored (compressed) chunk of an adapted kernel. Orbax writes an array of
    one host as one chunk, so reading any part of a kernel reads and decodes all of it."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item_dir.resolve()}/"}).result()
    names = tuple(".".join(("params", "params", *_mod(n, "kernel"))).encode() for n in MODULES)
    keys = [k for k in kv.list().result() if k.startswith(names) and not k.endswith(b".json")]
    return max(len(kv.read(k).result().value) for k in keys)


# -- one measured child --------------------------------------------------------------------
def _ts_layer(item_dir: Path, name: str, axis: int | None = None, index: int | None = None):
    """One stored array (or its layer ``index`` on ``axis``) read with tensorstore directly,
    not through the package: the checker must not share the code it checks."""
    import numpy as np
    import tensorstore as ts

    kv = {"driver": "ocdbt", "base": f"file://{item_dir.resolve()}/", "path": name + "/"}
    last = None
    for driver in ("zarr3", "zarr"):
        try:
            store = ts.open({"driver": driver, "kvstore": kv}, open=True).result()
        except ValueError as e:
            last = e
            continue
        if axis is not None:
            store = store[ts.d[axis][index]]
        return np.asarray(store.read().result())
    raise RuntimeError(f"{item_dir}: cannot read {name}: {last}")


def check(out_item: Path, base_item: Path, lora_item: Path, info: dict) -> None:
    """Raises unless ``out_item`` holds the merge (one layer of each of CHECKED) and the
    base's bytes for a grafted leaf."""
    import numpy as np

    L, scale = info["layers"], info["alpha"] / info["rank"]
    shapes = kernel_shapes(info)
    for n, name in enumerate(CHECKED):
        i = (3 + 2 * n) % L
        key = ".".join(("params", "params", *_mod(name, "kernel")))
        got = _ts_layer(out_item, key, 1, i)
        stored = _ts_layer(base_item, key, 1, i)
        assert got.dtype == stored.dtype, (name, got.dtype, stored.dtype)
        got, w = got.astype(np.float32), stored.astype(np.float32)
        lora = ".".join(_mod(name, "kernel_lora"))
        a = _ts_layer(lora_item, f"{lora}_a.value", 1, i)
        b = _ts_layer(lora_item, f"{lora}_b.value", 1, i)
        want = w + np.float32(scale) * (a @ b).reshape(shapes[name])
        want = want.astype(stored.dtype).astype(np.float32)  # float32, cast to bf16 once
        assert got.shape == want.shape, (name, got.shape, want.shape)
        # bf16 rounding: about one ulp where the float32 sums round differently
        bad = ~np.isclose(got, want, rtol=2**-7, atol=1e-6)
        if bad.any():
            raise AssertionError(f"{out_item}: {name} layer {i}: {bad.sum()} of {bad.size} off")
        moved = float(np.abs(got - w).mean())
        if moved < 0.2 * float(np.abs(want - w).mean()):
            raise AssertionError(f"{out_item}: {name} layer {i}: the delta was not added")
    key = ".".join(("params", "params", *GRAFTED))
    a, b = _ts_layer(out_item, key), _ts_layer(base_item, key)
    if a.tobytes() != b.tobytes():
        raise AssertionError(f"{out_item}: {key} is not the base's")


def child(mode: str, work: Path, out: Path, budget: int) -> None:
    if mode == "cp":  # before any import: cp's ru_maxrss starts from this process's RSS
        import resource

        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(work / "base" / "0"), str(out)], check=True)
        wall = time.perf_counter() - t
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        import orbax_maxtext_layout as oml

        print(
            json.dumps(
                {
                    "mode": mode,
                    "wall": wall,
                    "peak_rss_kib": rss,
                    "written": _du(out),
                    "package": str(Path(oml.__file__).parent),
                }
            )
        )
        return
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    import tensorstore  # noqa: F401
    from etils import epath

    import orbax_maxtext_layout as oml

    info = json.loads((work / "inputs.json").read_text())
    base, sft = work / "base" / "0", work / "sft" / str(ADAPTER_STEP)
    # metadata only, outside the timed region, in every mode (the baseline's work)
    oml.merge_lora(sft, base, alpha=info["alpha"], out=out, dry_run=True)
    written = 0
    t = time.perf_counter()
    if mode == "merge":
        report = oml.merge_lora(sft, base, alpha=info["alpha"], out=out, memory_budget=budget)
        written = report.bytes_written
    elif mode == "naive":
        h = ocp.PyTreeCheckpointHandler()

        def whole(item: Path):
            meta = h.metadata(epath.Path(item)).tree
            args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
            return h.restore(epath.Path(item), args=ocp.args.PyTreeRestore(restore_args=args))

        params = whole(base / "items")["params"]["params"]
        lora = whole(sft / "model_params")
        scale = np.float32(info["alpha"] / info["rank"])
        for name in MODULES:
            node, fac = params["decoder"]["layers"], lora["decoder"]["layers"]
            for k in name.split("/"):
                node, fac = node[k], fac[k]
            w = node["kernel"]
            a, b = fac["kernel_lora_a"]["value"], fac["kernel_lora_b"]["value"]
            layers = []
            for i in range(w.shape[1]):
                wi = np.take(w, i, 1)
                delta = (a[:, i] @ b[:, i]).reshape(wi.shape)
                layers.append((wi.astype(np.float32) + scale * delta).astype(w.dtype))
            node["kernel"] = np.stack(layers, axis=1)
            del w, wi, delta, layers
        (out / "0").mkdir(parents=True)
        saver = ocp.PyTreeCheckpointHandler(use_ocdbt=True)
        saver.save(
            epath.Path(out / "0" / "items"),
            args=ocp.args.PyTreeSave({"params": {"params": params}}),
        )
        saver.finalize(epath.Path(out / "0" / "items"))
    else:
        assert mode == "baseline", mode
    wall = time.perf_counter() - t
    rss = _vm_hwm_kib()  # before the check, which reads outside the measurement
    if mode in ("merge", "naive"):
        if mode == "naive":
            written = _du(out)
        check(out / "0" / "items", base / "items", sft / "model_params", info)
    print(
        json.dumps(
            {
                "mode": mode,
                "wall": wall,
                "peak_rss_kib": rss,
                "written": written,
                "package": str(Path(oml.__file__).parent),
            }
        )
    )


# -- the run -------------------------------------------------------------------------------
def _size(text: str) -> int:
    from _internal import parse_size

    return parse_size(text)


def run_once(mode: str, work: Path, before: Path | None = None) -> dict:
    """One measured child; ``merge@SIZE`` merges with ``memory_budget=SIZE``, and
    ``merge@SIZE@before`` does so with the package from ``before``."""
    op, _, rest = mode.partition("@")
    budget, _, tag = rest.partition("@")
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ}
    env.setdefault("JAX_PLATFORMS", "cpu")
    if tag:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(before), env.get("PYTHONPATH")]))
        env["OMTL_BENCH_BEFORE"] = "1"
    cmd = [__file__, "child", op, str(work), str(out)]
    cmd.append(str(_size(budget)) if budget else "0")
    try:
        res = python(cmd, check=True, env=env)
    except subprocess.CalledProcessError as e:
        sys.stderr.write(e.stderr)
        raise
    finally:
        shutil.rmtree(out, ignore_errors=True)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    want = (Path(before) if tag else HERE.parent).resolve() / "orbax_maxtext_layout"
    if Path(got["package"]).resolve() != want:
        raise RuntimeError(f"{mode} imported {got['package']}, not {want}")
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1GiB", help="base weights at least this big")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--budgets", nargs="+", default=["512MiB", "1GiB"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["baseline", "cp", "naive", "merge"])
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--before",
        type=Path,
        metavar="DIR",
        help="a checkout of another version (e.g. `git worktree add DIR main`): each merge "
        "also runs with its package, as merge@BUDGET@before, in the same run",
    )
    args = ap.parse_args(argv)
    modes = [m for m in args.modes if m != "merge"]
    modes += [f"merge@{b}" for b in args.budgets] if "merge" in args.modes else []
    if args.before is not None and "merge" in args.modes:
        modes += [f"merge@{b}@before" for b in args.budgets]
    with tempfile.TemporaryDirectory(prefix="omtl-bench-lora-") as tmp:
        work = Path(tmp)
        t = time.perf_counter()
        # Built in a child: a process that held the arrays would not be a fair baseline.
        built = python(
            [__file__, "build", str(work), str(_size(args.size)), str(args.layers), str(args.rank)],
            env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")},
        )
        sys.stdout.write(built.stdout)
        sys.stderr.write(built.stderr)
        built.check_returncode()
        build_s = time.perf_counter() - t
        info = json.loads((work / "inputs.json").read_text())
        step_bytes = _du(work / "base" / "0")
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(args.repeats):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                runs[mode].append(run_once(mode, work, args.before))
    cp = statistics.median(x["wall"] for x in runs["cp"]) if "cp" in runs else None
    base = max(x["peak_rss_kib"] for x in runs["baseline"]) if "baseline" in runs else 0
    naive = max(x["peak_rss_kib"] for x in runs["naive"]) - base if "naive" in runs else None
    naive_s = statistics.median(x["wall"] for x in runs["naive"]) if "naive" in runs else None
    slice_mib = info["slice_bytes"] / 2**20
    rows = []
    for mode, xs in runs.items():
        peak = max(x["peak_rss_kib"] for x in xs)
        over = peak - (0 if mode == "cp" else base)  # cp's peak is cp's own
        wall = statistics.median(x["wall"] for x in xs)
        row = {
            "mode": mode,
            "wall_s": round(wall, 2),
            "x_cp": round(wall / cp, 2) if cp else None,
            "x_naive_wall": round(wall / naive_s, 2) if naive_s and mode != "baseline" else None,
            "peak_rss_mib": round(peak / 1024, 1),
            "rss_over_baseline_mib": round(over / 1024, 1),
            "x_naive_rss": round(over / naive, 3) if naive and mode != "baseline" else None,
            "written_mib": round(statistics.median(x["written"] for x in xs) / 2**20, 1),
        }
        if mode.startswith("merge@"):
            budget_mib = _size(mode.split("@")[1]) / 2**20
            row["budget_mib"] = budget_mib
            row["bound_mib"] = round(budget_mib + 3 * slice_mib, 1)
            row["bound_holds"] = row["rss_over_baseline_mib"] <= row["bound_mib"]
        rows.append(row)
    summary = {
        "inputs": {**info, "base_step_bytes": step_bytes, "build_s": round(build_s, 1)},
        "largest_layer_slice_mib": round(slice_mib, 2),
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"base: emb {info['emb']}, {info['heads']} heads x {HEAD_DIM}, mlp {info['mlp']}, "
            f"{info['layers']} layers (axis 1), vocab {VOCAB}, bf16: "
            f"{info['weight_bytes'] / 2**20:.0f} MiB of weights, {step_bytes / 2**20:.0f} MiB "
            f"on disk; adapters rank {info['rank']} on {len(MODULES)} modules, float32, "
            f"{info['adapter_bytes'] / 2**20:.1f} MiB; largest per-layer kernel slice "
            f"{slice_mib:.1f} MiB, of a kernel of {info['kernel_bytes'] / 2**20:.0f} MiB stored "
            f"as one chunk of {info['stored_chunk_bytes'] / 2**20:.0f} MiB; built in "
            f"{build_s:.0f} s\n"
            f"{args.repeats} repeats: medians of wall time, largest peak RSS; bound = budget "
            "+ 3 x slice\n"
        )
        print(
            "| mode | wall s | x cp -r | x naive time | peak RSS MiB | RSS over baseline MiB "
            "| x naive RSS | written MiB | budget MiB | bound MiB | bound holds |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            cells = [r.get(k, "") for k in ("budget_mib", "bound_mib", "bound_holds")]
            cells = ["" if c is None else c for c in cells]
            print(
                f"| {r['mode']} | {r['wall_s']} | {r['x_cp'] or ''} | {r['x_naive_wall'] or ''} | "
                f"{r['peak_rss_mib']} | "
                f"{r['rss_over_baseline_mib']} | {r['x_naive_rss'] or ''} | {r['written_mib']} | "
                + " | ".join(str(c) for c in cells)
                + " |"
            )
        by_mode = {r["mode"]: r for r in rows}
        pairs = [
            (r, by_mode[r["mode"] + "@before"]) for r in rows if r["mode"] + "@before" in by_mode
        ]
        if pairs:
            print(
                "\n| merge | wall s | wall s before | x before | RSS over baseline MiB (before) |"
            )
            print("|---|---|---|---|---|")
            for r, b in pairs:
                print(
                    f"| {r['mode']} | {r['wall_s']} | {b['wall_s']} | "
                    f"{r['wall_s'] / b['wall_s']:.2f} | {r['rss_over_baseline_mib']} "
                    f"({b['rss_over_baseline_mib']}) |"
                )
    held = all(r.get("bound_holds", True) for r in rows)
    return 0 if held else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["build"]:
        w, size, layers, rank = sys.argv[2:6]
        build(Path(w), int(size), int(layers), int(rank))
    elif sys.argv[1:2] == ["child"]:
        mode, w, out, budget = sys.argv[2:6]
        child(mode, Path(w), Path(out), int(budget))
    else:
        sys.exit(main())
