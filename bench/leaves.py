"""Benchmark: cost per leaf of every operation, on steps of many tiny leaves.

    python bench/leaves.py --layers 8 24 96 192 384 --repeats 3 [--before DIR]

Each size is an unscanned tiny model (`tests/writers.py`: ``make_model(scanned=False,
adapter=True, num_layers=L)``, Tunix's RL optimizer) saved as a Tunix step: 12 source
leaves per layer plus 15, every array a few hundred bytes, so the cost measured is the
cost per leaf, not per byte. Its inputs are built once, in a process of their own: the
Tunix step, a converted copy without legacy items (the target, read from its metadata,
and the stock restore's source) and a converted copy beside its legacy items (what
`verify` checks). Each operation then runs in a fresh child process, in rotating order,
from the page cache; figures are medians.

Modes: ``inspect`` (the CLI, ``--target-from`` the converted copy), ``dry_run``,
``convert``, ``inplace`` (``convert --in-place``), ``remove_legacy`` (``convert
--remove-legacy``), ``verify`` (every value), ``restore_tunix`` (the v0
`CheckpointManager` built inside the timing, restoring the Tunix step against the full
items request, abstract leaves without shardings: host arrays, as in ``bench/run.py``)
and ``restore_stock`` (stock Orbax's manager, the same request, from the converted copy);
``restore_tunix_sharded`` and ``restore_stock_sharded`` ask for every leaf with a
sharding and its restore args, as MaxText's ``load_state_if_possible`` does (jax arrays). ``--before DIR`` also runs every mode but the
stock ones with the package of another checkout (``git worktree add DIR <commit>``), as
``MODE@before``.

Printed: wall seconds and ms per source leaf per size and mode; how flat each mode's cost
per leaf is (ms per leaf at the size nearest 1,200 leaves over the size nearest 300);
``verify`` and ``restore_tunix`` over ``restore_stock``; and, with ``--before``, each
mode's wall time over its before.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from inproc import python  # each child a fresh interpreter, but in a smoke run

HERE = Path(__file__).parent
ROOT = HERE.parent

MODES = (
    "inspect",
    "dry_run",
    "convert",
    "inplace",
    "remove_legacy",
    "verify",
    "restore_tunix",
    "restore_stock",
    "restore_tunix_sharded",
    "restore_stock_sharded",
)
STOCK = ("restore_stock", "restore_stock_sharded")  # modes that do not run the package
STEP = 3  # the Tunix step number


# -- inputs (one process per size) ---------------------------------------------------------
def build(work: Path, layers: int) -> None:
    """Writes ``work/src`` (Tunix), ``work/converted`` (items only) and ``work/verify``
    (items beside the legacy items) for a model of ``layers`` unscanned layers."""
    sys.path.insert(0, str(ROOT / "tests"))
    import writers as W

    from orbax_maxtext_layout import Target, convert_step

    model = W.make_model(scanned=False, adapter=True, num_layers=layers)
    opt = W.make_optimizer(model, "rl")
    src = Path(W.write_tunix_step(work / "src", STEP, model, opt, role="actor"))
    # Params and nnx_aux by Variable type, the optimizer in MaxText's canonical form.
    target = Target.from_nnx(model.base)
    for name in ("converted", "verify"):
        step = work / name / "actor" / str(STEP)
        shutil.copytree(src, step)
        convert_step(step, target)
    for legacy in ("model_params", "optimizer_state"):
        shutil.rmtree(work / "converted" / "actor" / str(STEP) / legacy)


def _leaves(step: Path) -> int:
    return sum(
        len(json.loads((step / item / "_METADATA").read_text())["tree_metadata"])
        for item in ("model_params", "optimizer_state")
    )


# -- one measured operation (a fresh process) ---------------------------------------------
def child(mode: str, step: Path, converted: Path) -> dict:
    import jax
    import orbax.checkpoint as ocp

    import orbax_maxtext_layout as oml

    target = oml.Target.from_checkpoint(converted)  # metadata only, outside the timing
    counts = _io_counts()
    with counts as io_counts:
        t = time.perf_counter()
        if mode == "inspect":
            from _internal import run_cli

            with contextlib.redirect_stdout(io.StringIO()):
                rc = run_cli(["inspect", str(step), "--target-from", str(converted)])
            assert rc == 0, rc
        elif mode == "dry_run":
            oml.convert_step(step, target, dry_run=True)
        elif mode in ("convert", "inplace", "remove_legacy"):
            report = oml.convert_step(
                step, target, in_place=mode == "inplace", remove_legacy=mode == "remove_legacy"
            )
            assert report.status == "converted", report
            if mode != "convert":
                assert not (step / "model_params").exists(), report.notes
        elif mode == "verify":
            result = oml.verify_step(step)
            assert result.ok and result.checked, result.problems[:3]
        elif mode.startswith("restore_"):
            tunix = mode.startswith("restore_tunix")
            cls = oml.CheckpointManager if tunix else ocp.CheckpointManager
            item, restore_args = target.items(), None
            if mode.endswith("_sharded"):  # as MaxText asks: every leaf with its sharding
                sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                item = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), item
                )
                restore_args = ocp.checkpoint_utils.construct_restore_args(item)
            restore = ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
            args = ocp.args.Composite(items=restore)
            with cls(step.parent, item_names=("items",)) as mngr:
                restored = mngr.restore(mngr.latest_step(), args=args)["items"]
                jax.block_until_ready(restored)
        else:
            raise SystemExit(f"unknown mode {mode}")
        wall = time.perf_counter() - t
    out = {
        "mode": mode,
        "wall": wall,
        "peak_rss_kib": _vm_hwm_kib(),
        "package": str(Path(oml.__file__).parent),
    }
    if io_counts is not None:  # how often each database was listed (this tree only)
        listings = [n for (kind, _), n in io_counts.items() if kind == "listing"]
        out["max_listings_per_database"] = max(listings, default=0)
    return out


def _io_counts():
    from _internal import io_counts  # a --before tree without the seam counts nothing

    return io_counts()


def _vm_hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    import resource  # gVisor (the TPU host) has no VmHWM: the kernel's own peak then

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# -- the run ---------------------------------------------------------------------------------
def run_once(mode: str, work: Path, before: Path | None) -> dict:
    """One measured child; ``MODE@before`` runs ``MODE`` with the package from ``before``."""
    mode, _, tag = mode.partition("@")
    env = dict(os.environ)
    if tag:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(before), env.get("PYTHONPATH")]))
    converted = work / "converted" / "actor" / str(STEP)
    if mode.startswith("restore_tunix"):
        step = work / "src" / "actor" / str(STEP)
    elif mode.startswith("restore_stock"):
        step = converted
    elif mode == "verify":
        step = work / "verify" / "actor" / str(STEP)
    else:  # a fresh legacy step (not timed)
        step = work / f"{mode}{tag}" / "actor" / str(STEP)
        shutil.rmtree(step.parent.parent, ignore_errors=True)
        shutil.copytree(work / "src" / "actor" / str(STEP), step)
    res = python([str(Path(__file__).resolve()), "child", mode, str(step), str(converted)], env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{mode}@{tag or 'this tree'} failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    want = Path(before if tag else ROOT).resolve() / "orbax_maxtext_layout"
    if Path(out["package"]).resolve() != want:
        raise RuntimeError(f"{mode}@{tag or 'this tree'} imported {out['package']}, not {want}")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        mode, step, converted = argv[1], Path(argv[2]), Path(argv[3])
        print(json.dumps(child(mode, step, converted)))
        return 0
    if argv[:1] == ["build"]:
        build(Path(argv[1]), int(argv[2]))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", nargs="+", type=int, default=[8, 24, 96, 192, 384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), help=f"of {MODES}")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--before",
        type=Path,
        metavar="DIR",
        help="a checkout of another version (e.g. `git worktree add DIR HEAD`): every mode "
        "but restore_stock also runs with its package, as MODE@before, in the same run",
    )
    args = ap.parse_args(argv)
    rows = []
    for layers in args.layers:
        with tempfile.TemporaryDirectory(prefix="omtl-leaves-") as tmp:
            work = Path(tmp)
            t = time.perf_counter()
            python([str(Path(__file__).resolve()), "build", str(work), str(layers)], check=True)
            leaves = _leaves(work / "src" / "actor" / str(STEP))
            print(f"{layers} layers: {leaves} leaves, built in {time.perf_counter() - t:.0f} s")
            modes = list(args.modes)
            if args.before is not None:
                modes += [f"{m}@before" for m in args.modes if m not in STOCK]
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for r in range(args.repeats):
                order = modes[r % len(modes) :] + modes[: r % len(modes)]
                for mode in order:
                    runs[mode].append(run_once(mode, work, args.before))
            for mode, xs in runs.items():
                wall = statistics.median(x["wall"] for x in xs)
                row = {
                    "layers": layers,
                    "leaves": leaves,
                    "mode": mode,
                    "wall_s": round(wall, 3),
                    "ms_per_leaf": round(1000 * wall / leaves, 3),
                    "peak_rss_mib": round(max(x["peak_rss_kib"] for x in xs) / 1024, 1),
                }
                if "max_listings_per_database" in xs[0]:
                    row["max_listings_per_database"] = max(
                        x["max_listings_per_database"] for x in xs
                    )
                rows.append(row)
                print(f"  {mode}: {row['wall_s']} s", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(report(rows))
    return 0


def report(rows: list[dict]) -> str:
    """The tables: per size and mode; flatness; ratios to the stock restore; before/after."""
    by = {(r["layers"], r["mode"]): r for r in rows}
    sizes = sorted({(r["layers"], r["leaves"]) for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    now = [m for m in modes if "@" not in m]
    has_before = any("@" in m for m in modes)
    out = ["| layers | leaves | mode | wall s | ms/leaf | max listings/db |"]
    out[0] += " before s | before ms/leaf | x before |" if has_before else ""
    out.append("|---" * (out[0].count("|") - 1) + "|")
    for layers, leaves in sizes:
        for m in now:
            r = by.get((layers, m))
            if r is None:
                continue
            line = (
                f"| {layers} | {leaves:,} | {m} | {r['wall_s']:.3f} | {r['ms_per_leaf']:.2f} | "
                f"{r.get('max_listings_per_database', '')} |"
            )
            if has_before:
                b = by.get((layers, f"{m}@before"))
                line += (
                    f" {b['wall_s']:.3f} | {b['ms_per_leaf']:.2f} | "
                    f"{r['wall_s'] / b['wall_s']:.2f} |"
                    if b
                    else " | | |"
                )
            out.append(line)
    lo = min(sizes, key=lambda s: abs(s[1] - 300))
    hi = min(sizes, key=lambda s: abs(s[1] - 1200))
    out += [
        "",
        f"Flatness: ms/leaf at {hi[1]:,} leaves over ms/leaf at {lo[1]:,} leaves (goal <= 1.3)",
        "",
        "| mode | " + ("this tree | before |" if has_before else "this tree |"),
        "|---|---|" + ("---|" if has_before else ""),
    ]
    for m in now:
        cells = []
        for mm in [m, f"{m}@before"] if has_before else [m]:
            a, b = by.get((hi[0], mm)), by.get((lo[0], mm))
            cells.append(f"{a['ms_per_leaf'] / b['ms_per_leaf']:.2f}" if a and b else "")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    # (row label, mode, stock mode it is compared with)
    ratios = [
        ("verify", "verify", "restore_stock"),
        ("restore_tunix", "restore_tunix", "restore_stock"),
        ("restore_tunix_sharded", "restore_tunix_sharded", "restore_stock_sharded"),
    ]
    labels = [label for label, _, _ in ratios]
    head = " | ".join(f"{x} x" for x in labels)
    out += [
        "",
        "Against the stock restore of the converted step (goals: verify <= 2, a transparent "
        "restore <= 1.15); sharded modes against the sharded stock restore",
        "",
        "| layers | leaves | stock s | stock sharded s | "
        + head
        + " |"
        + (" " + " | ".join(f"{x} x (before)" for x in labels) + " |" if has_before else ""),
        "|---" * (4 + len(labels) * (2 if has_before else 1)) + "|",
    ]
    for layers, leaves in sizes:
        stock = {m: by.get((layers, m)) for m in STOCK}
        cells = []
        for suffix in ["", "@before"] if has_before else [""]:
            for _, mode, base in ratios:
                r, b = by.get((layers, mode + suffix)), stock[base]
                cells.append(f"{r['wall_s'] / b['wall_s']:.2f}" if r and b else "")
        walls = [f"{stock[m]['wall_s']:.3f}" if stock[m] else "" for m in STOCK]
        out.append(f"| {layers} | {leaves:,} | " + " | ".join(walls + cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
