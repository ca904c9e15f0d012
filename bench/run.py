"""Benchmark: cp -r vs naive restore+save vs convert (shared data files) vs convert --copy vs
convert --in-place, side by side.

    python bench/run.py --sizes 1GiB 4GiB --repeats 3 --budget 1GiB \
        --modes baseline cp convert copy inplace

Each operation runs in a fresh child process (peak RSS is that process's
ru_maxrss), in rotating order within one run, from the page cache. Figures are
medians; ratios are against ``cp -r`` of the same step in the same run.
``baseline`` is a child that imports everything and builds the target but
converts nothing; "RSS over baseline" is what the conversion itself added.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from inproc import python  # noqa: E402  (each child a fresh interpreter, but in a smoke run)

MODES = ("baseline", "cp", "naive", "convert", "copy", "inplace")
RESTORE_MODES = ("restore_tunix", "restore_stock", "restore_tunix_v1", "restore_stock_v1")
COMPARED = ("convert", "copy", "inplace", "restore_tunix")  # modes that run the package


def _size(text: str) -> int:
    from _internal import parse_size

    return parse_size(text)


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _files(data_files: dict) -> str:
    """``31 hard-linked`` / ``31 copied``: how a conversion placed the source data files."""
    words = {"reflink": "reflinked", "hardlink": "hard-linked", "copy": "copied"}
    got = [f"{data_files[k]['files']} {w}" for k, w in words.items() if k in data_files]
    return ", ".join(g for g in got if not g.startswith("0 ")) or "-"


def run_once(
    mode: str,
    src: Path,
    work: Path,
    budget: int,
    before: Path | None = None,
    durable: bool = False,
) -> dict:
    """One measured child. ``mode@before`` runs ``mode`` with the package from ``before``;
    ``durable``: the timed region ends with sync(2) (the written data is on the disk)."""
    mode, _, tag = mode.partition("@")
    env = dict(os.environ)
    if tag:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(before), env.get("PYTHONPATH")]))
    if mode in RESTORE_MODES:
        converted = work / "converted" / "actor" / src.name
        if not converted.exists():  # a converted copy for the stock manager (not timed)
            shutil.copytree(src, converted)
            python(
                [str(HERE / "child.py"), "convert", str(converted), "-", str(budget)], check=True
            )
            for legacy in ("model_params", "optimizer_state"):
                shutil.rmtree(converted / legacy)
        args = [mode, str(src), str(converted), str(budget)]
    elif mode in ("convert", "copy", "inplace"):
        step = work / f"{mode}{tag}" / "actor" / src.name
        shutil.rmtree(step.parent.parent, ignore_errors=True)
        shutil.copytree(src, step)  # a fresh legacy step (not timed)
        args = [mode, str(step), str(work / "unused"), str(budget)]
    else:
        out = work / f"{mode}-out"
        shutil.rmtree(out, ignore_errors=True)
        source = src
        if mode == "cp":  # copies a fresh legacy step too, prepared as the convert modes' is
            source = work / "cp-src" / "actor" / src.name
            shutil.rmtree(source.parent.parent, ignore_errors=True)
            shutil.copytree(src, source)
        args = [mode, str(source), str(out), str(budget)]
    # Every timed child starts with nothing dirty: the untimed preparation (a fresh legacy
    # step is a full copy) and earlier modes would otherwise throttle its writes by theirs.
    os.sync()
    res = python(
        [str(HERE / "child.py"), *args, *(["sync"] if durable else [])], check=True, env=env
    )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    want = Path(before if tag else HERE.parent).resolve() / "orbax_maxtext_layout"
    if "package" in out and Path(out["package"]).resolve() != want:
        raise RuntimeError(f"{mode}@{tag or 'this tree'} imported {out['package']}, not {want}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["1GiB", "4GiB"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--modes", nargs="+", default=list(MODES), help=f"of {MODES + RESTORE_MODES}")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--sync",
        action="store_true",
        help="end each timed operation with sync(2): time until the written data is on the "
        "disk, not in the page cache (steadier where writeback throttles large writes)",
    )
    ap.add_argument(
        "--before",
        type=Path,
        metavar="DIR",
        help="a checkout of another version (e.g. `git worktree add DIR main`): convert, "
        "inplace and restore_tunix also run with its package, as MODE@before, in the same run",
    )
    args = ap.parse_args(argv)
    budget = _size(args.budget)
    rows = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="omtl-bench-") as tmp:
            work = Path(tmp)
            # Built in a child: a parent that held the arrays would hand its RSS
            # high-water mark to every measured child (ru_maxrss survives exec).
            python(
                [
                    "-c",
                    f"import sys; sys.path.insert(0, {str(HERE)!r}); import synth; "
                    f"synth.make_step(__import__('pathlib').Path({str(work / 'src')!r}), 3, {_size(size)})",
                ],
                check=True,
            )
            src = work / "src" / "actor" / "3"
            step_bytes = _du(src)
            weights = sum(
                s.nbytes
                for p, s in __import__("orbax_maxtext_layout")
                .read_specs(src / "model_params")
                .items()
                if "rngs" not in p
            )
            modes = list(args.modes)
            if args.before is not None:
                modes += [f"{m}@before" for m in args.modes if m in COMPARED]
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for r in range(args.repeats):
                order = modes[r % len(modes) :] + modes[: r % len(modes)]
                for mode in order:
                    runs[mode].append(run_once(mode, src, work, budget, args.before, args.sync))
            cp = statistics.median(x["wall"] for x in runs["cp"]) if "cp" in runs else None
            base = max(x["peak_rss_kib"] for x in runs["baseline"]) if "baseline" in runs else 0
            for mode, xs in runs.items():
                wall = statistics.median(x["wall"] for x in xs)
                rows.append(
                    {
                        "size": size,
                        "step_bytes": step_bytes,
                        "weight_bytes": weights,
                        "mode": mode,
                        "wall_s": round(wall, 3),
                        "best_s": round(min(x["wall"] for x in xs), 3),
                        "x_cp": round(wall / cp, 3) if cp else None,
                        "peak_rss_mib": round(max(x["peak_rss_kib"] for x in xs) / 1024, 1),
                        "rss_over_baseline_mib": round(
                            (max(x["peak_rss_kib"] for x in xs) - (0 if mode == "cp" else base))
                            / 1024,
                            1,
                        ),
                        "written_mib": round(
                            statistics.median(x["written"] for x in xs) / 2**20, 2
                        ),
                        "data_files": _files(xs[-1].get("data_files") or {}),
                    }
                )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    sync = ", each ended by sync(2)" if args.sync else ""
    print(f"budget {args.budget}, {args.repeats} repeats, medians{sync}\n")
    print(
        "| size | on disk | mode | wall s | best s | x cp -r | peak RSS MiB "
        "| RSS over baseline MiB | written MiB | data files |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['size']} | {r['step_bytes'] / 2**20:.0f} MiB | {r['mode']} | {r['wall_s']} | "
            f"{r['best_s']} | {r['x_cp']} | {r['peak_rss_mib']} | {r['rss_over_baseline_mib']} | "
            f"{r['written_mib']} | {r['data_files']} |"
        )
    before = {(r["size"], r["mode"].removesuffix("@before")): r for r in rows if "@" in r["mode"]}
    if before:
        print("\n| size | mode | wall x before | peak RSS x before |\n|---|---|---|---|")
        for r in rows:
            b = before.get((r["size"], r["mode"]))
            if b is not None and "@" not in r["mode"]:
                print(
                    f"| {r['size']} | {r['mode']} | {r['wall_s'] / b['wall_s']:.2f} | "
                    f"{r['peak_rss_mib'] / b['peak_rss_mib']:.2f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
