"""``realsize.py prove``: the builder of `realsize_build` against stock Orbax saves of the same
values (and MaxText 0.2.5's own ``save_checkpoint``), byte for byte, at a small size."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from export_hf import parse_size  # bench/export_hf.py's (standard library only at its top)
from realsize_build import orbax_save, step_tree
from realsize_steps import FSDP, REALSIZE, REPO, child_env, du, step_params, vm_hwm_kib
from realsize_wrap import tail, wrapped


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
        orbax_save(
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
    out_json.write_text(json.dumps({"peak_rss_kib": vm_hwm_kib()}))


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
        "bytes": [du(mine), du(stock)],
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
        "--tiny",
        action="store_true",
        help="models cut to a few MiB (realsize_steps.TINY): a smoke run, not a measure",
    )
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
        params = step_params(name, args.layers, args.moe_layers, args.seed, args.tiny)
        if size:
            params["target_file_size"] = parse_size(size)
        hows = ["v0", "maxtext"] if name == "llama-fsdp" else ["v0"]
        dirs = {}
        for how in ["lazy", *hows]:
            d = work / how / spec.replace("@", "-")
            d.mkdir(parents=True)
            verb = ["build", str(d), name] if how == "lazy" else ["stock", str(d), name, how]
            res = wrapped(
                [[sys.executable, REALSIZE, *verb, json.dumps(params), d / f"{how}.json"]],
                child_env([REPO], devices=FSDP),
                d,
                [d / f"{how}.log"],
            )
            p = res["procs"][0]
            if p["rc"] != 0:
                print(f"{spec} {how}: failed\n{tail(d / f'{how}.log')}", file=sys.stderr)
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
