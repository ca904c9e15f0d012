"""The figures of `bench/realsize.py`: each row (medians, ratios to ``cp -r`` and to the
floor, the goals of issue 30, held or not) and the printed tables."""

from __future__ import annotations

import statistics

from export_hf import parse_size  # bench/export_hf.py's (standard library only at its top)
from realsize_ops import Runner
from realsize_steps import APPLICABLE, FLOOR_OF, GIB, MIB, STEPS


class _Runs:
    """A run's measured operations, picked by step, operation and package (``this``, or
    ``before``)."""

    def __init__(self, runs: list[dict]):
        self.all = runs
        self.ok = [r for r in runs if r.get("rc") == 0]

    def pick(self, step: str, op: str, tag: str) -> list[dict]:
        return [r for r in self.ok if r["step"] == step and r["op"] == op and r["package"] == tag]

    def failed(self, step: str, op: str, tag: str) -> list[dict]:
        return [
            r
            for r in self.all
            if r["step"] == step and r["op"] == op and r["package"] == tag and r.get("rc") != 0
        ]

    def floor_wall(self, name: str, op: str) -> float | None:
        """The wall time of ``op``'s floor on step ``name`` (`FLOOR_OF`), if measured."""
        runs = self.pick(name, FLOOR_OF[op], "this") if op in FLOOR_OF else []
        if not runs:
            return None
        wall = _med(runs, "wall")
        if op == "verify":  # both sides decoded: a second pass, without a second start
            wall += statistics.median(r["floor"]["wall_s"] for r in runs)
        return wall


def _med(xs: list[dict], k: str) -> float | None:
    return statistics.median(x[k] for x in xs) if xs else None


def _params(args, runner: Runner) -> dict:
    return {
        "layers": args.layers,
        "moe_layers": args.moe_layers,
        "seed": args.seed,
        "budget": args.budget,
        "repeats": args.repeats,
        "max_shard_size": args.max_shard_size,
        "packages": {k or "this": str(v) for k, v in runner.packages.items()},
    }


def summarize(args, infos: dict, runner: Runner) -> dict:
    budget = parse_size(args.budget)
    runs = _Runs(runner.runs)
    rows = []
    base = {tag: runs.pick("-", "baseline", tag) for tag in ("this", "before")}
    base_rss = {t: max((x["peak_rss_kib"] for x in v), default=0) for t, v in base.items()}
    base_rchar = {t: _med(v, "rchar") or 0 for t, v in base.items()}
    cp_wall = {n: _med(runs.pick(n, "cp", "this"), "wall") for n in infos}
    order = [(n, op) for n in STEPS for op in ("cp", *APPLICABLE[n])]
    for tag in ("this", "before"):
        if base[tag]:
            rows.append(
                _row("-", "baseline", tag, base[tag], cp=None, size=None, one=None, base_rss=0,
                     base_rchar=0, budget=budget)
            )  # fmt: skip
    for name, op in order:
        if name not in infos:
            continue
        for tag in ("this", "before") if op != "cp" else ("this",):
            ok, failed = runs.pick(name, op, tag), runs.failed(name, op, tag)
            if not ok and not failed:
                continue
            floor_step = "llama-fsdp" if op == "merge-lora" else name
            nproc = 2 if op == "export-hf-2p" else 1
            size = infos[name]["build"]["step_bytes"]
            if op == "merge-lora":
                size += infos["llama-fsdp"]["build"]["step_bytes"]
            one_proc = runs.pick(name, "export-hf", tag) if op == "export-hf-2p" else []
            rows.append(
                _row(name, op, tag, ok, cp=cp_wall.get(floor_step), size=size,
                     one=_med(one_proc, "wall"),
                     base_rss=0 if op == "cp" else base_rss[tag],
                     base_rchar=0 if op == "cp" else nproc * base_rchar[tag],
                     budget=budget, failed=len(failed),
                     floors=(runs.floor_wall(name, op), _cpu(one_proc)))
            )  # fmt: skip
    return {
        "params": _params(args, runner),
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


def _floors(row: dict, wall, cp, one, floors: tuple = ()) -> None:
    """What this machine allows: the operation's floor (`FLOOR_OF`), and for 2 processes the
    best split of one process's CPU over 2 cores."""
    floor, one_cpu = (*floors, None, None)[:2]
    if floor:
        row["floor_s"] = round(floor, 2)
        row["x_floor"] = round(wall / floor, 2) if wall is not None else None
        row["floor_x_cp"] = round(floor / cp, 2) if cp else None
    if one and one_cpu:
        row["one_process_cpu_s"] = round(one_cpu, 1)
        row["x_one_process_floor"] = round(one_cpu / 2 / one, 2)


def _row(name, op, tag, runs, *, cp, size, one, base_rss, base_rchar, budget, failed=0, floors=()):
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
    _floors(row, wall, cp, one, floors)
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


def _steps_table(steps: dict) -> None:
    """Each step: its size, build and the check by stock Orbax."""
    print(
        "| step | on disk GiB | built in s | builder peak RSS MiB | files (data files) "
        "| stored chunks per array | read back by stock Orbax |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, i in steps.items():
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


def _row_line(r: dict) -> str:
    """One operation's row of the operations table."""
    op = r["op"] + (" (before)" if r["package"] == "before" else "")
    if r["wall_s"] is None:
        return f"| {r['step']} | {op} | failed ({r['failed']}) |" + " |" * 10
    goals = "; ".join(g["goal"] for g in r["goals"]) or "-"
    held = (
        "; ".join({True: "held", False: "**not held**", None: "?"}[g["held"]] for g in r["goals"])
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
    return (
        f"| {r['step']} | {op} | {r['wall_s']} | {r['x_cp'] or ''} | {r.get('cpu_s', '')} | "
        f"{floor} | {r.get('x_floor', '')} | "
        f"{r['rchar_gib']} ({r['rchar_over_imports_gib']}) | {r['x_step'] if r['x_step'] is not None else ''} | "
        f"{rss} | {'' if r['rss_over_baseline_mib'] is None else r['rss_over_baseline_mib']} | {goals} | {held} |"
    )


def report(s: dict) -> None:
    p = s["params"]
    print(
        f"\nllama3.1-8b at {p['layers']} layers, qwen3-30b-a3b at {p['moe_layers']} layers, "
        f"--memory-budget {p['budget']}, {p['repeats']} repeat(s); medians (peak RSS: the largest)\n"
    )
    _steps_table(s["steps"])
    print(
        "\n| step | operation | wall s | x cp -r | CPU s | floor s (x cp -r) | x floor "
        "| rchar GiB (over imports) | x step on disk | peak RSS MiB | RSS over baseline MiB "
        "| goal | held |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in s["rows"]:
        print(_row_line(r))
    if s["problems"]:
        print("\nPROBLEMS:")
        for x in s["problems"]:
            print(f"- {x}")
