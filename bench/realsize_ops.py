"""The operations of `bench/realsize.py`: each operation's command line (`COMMANDS`, one
function per operation), the runner that measures them, and the building or reuse of the steps.

Standard library only at the top (the orchestrator stays small).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from realsize_steps import (
    ALPHA,
    FLOOR_OF,
    FSDP,
    GIB,
    HERE,
    OPS,
    PKG,
    REALSIZE,
    REPO,
    TOKENIZER,
    base_yml,
    child_env,
    step_path,
)
from realsize_wrap import tail, wrapped


def baseline() -> None:
    """Imports what the operations import, brings up jax's CPU backend, and does nothing."""
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):
        import jax
        import maxtext.checkpoint_conversion.to_huggingface  # noqa: F401
        import orbax.checkpoint  # noqa: F401
        import safetensors  # noqa: F401
        import tensorstore  # noqa: F401
        from _internal import load_cli

        load_cli()  # the package and its CLI

        jax.numpy.zeros(8).block_until_ready()


def warm_cache(*paths: Path) -> None:
    """Reads every file once (untimed): the operation starts from the page cache."""
    buf = bytearray(8 << 20)
    for p in paths:
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file() and not f.is_symlink():
                with open(f, "rb", buffering=0) as fh:
                    while fh.readinto(buf):
                        pass


def digest(d: Path) -> dict[str, str]:
    out = {}
    for f in sorted(d.rglob("*")):
        if f.is_file():
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                while chunk := fh.read(16 << 20):
                    h.update(chunk)
            out[str(f.relative_to(d))] = h.hexdigest()
    return out


def settle(*dirs: Path) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    os.sync()


# == each operation's command lines =============================================================
class Op:
    """What an operation's command lines are made of: the run's options, the step, the output."""

    def __init__(self, args, work: Path, infos: dict, name: str, out: Path):
        self.args, self.work, self.infos, self.name, self.out = args, work, infos, name, out

    @property
    def step(self) -> Path:
        return step_path(self.work, self.name)  # not for the baseline, which has no step ("-")

    def cli(self, *a: object) -> list[str]:
        return [sys.executable, "-m", PKG, *map(str, a)]

    def maxtext(self) -> list[str]:
        """``--maxtext-config <base.yml> <the step's model keys>``."""
        return ["--maxtext-config", str(base_yml()), *self.keys()]

    def keys(self) -> list[str]:
        return self.infos[self.name]["params"]["model_keys"]

    def overridden(self) -> list[str]:
        """``--override-model-architecture`` where the model is cut (its config overridden)."""
        cut = any(k.startswith("override_model_config") for k in self.keys())
        return ["--override-model-architecture"] if cut else []

    def budget(self) -> list[str]:
        return ["--memory-budget", self.args.budget]


def _cp(o: Op) -> list[list[str]]:
    return [["cp", "-r", str(o.step), str(o.out)]]


def _export_hf_args(o: Op) -> list[object]:
    extra: list[object] = [o.step, "--out", o.out, "--hf-model-path", TOKENIZER, *o.budget()]
    extra += o.overridden()
    if o.args.max_shard_size:
        extra += ["--max-shard-size", o.args.max_shard_size]
    return extra


def _export_hf(o: Op) -> list[list[str]]:
    return [o.cli("export-hf", *_export_hf_args(o), *o.maxtext())]


def _export_hf_2p(o: Op) -> list[list[str]]:
    two = ["--process-count", 2]
    return [
        o.cli("export-hf", *_export_hf_args(o), "--process-index", i, *two, *o.maxtext())
        for i in range(2)
    ]


def _export_adapter(o: Op) -> list[list[str]]:
    args = [o.step, "--adapter", "--alpha", ALPHA, "--out", o.out, *o.overridden()]
    return [o.cli("export-hf", *args, *o.maxtext())]


def _merge_lora(o: Op) -> list[list[str]]:
    base = step_path(o.work, "llama-fsdp")
    return [
        o.cli("merge-lora", o.step, "--base", base, "--alpha", ALPHA, "--out", o.out, *o.budget())
    ]


def _convert_unroll(o: Op) -> list[list[str]]:
    root = o.work / o.name
    args = [root, "--unroll", "--out", o.out, "--optimizer", "drop", *o.budget(), "-q"]
    return [o.cli("convert", *args, *o.maxtext())]


def _verify(o: Op) -> list[list[str]]:
    return [o.cli("verify", o.out)]


def _floor(level: list[str]) -> Callable[[Op], list[list[str]]]:
    def cmds(o: Op) -> list[list[str]]:
        return [[sys.executable, str(HERE / "floor.py"), str(o.step), *level]]

    return cmds


def _baseline(o: Op) -> list[list[str]]:
    return [[sys.executable, str(REALSIZE), "baseline"]]


COMMANDS: dict[str, Callable[[Op], list[list[str]]]] = {
    "cp": _cp,
    "export-hf": _export_hf,
    "export-hf-2p": _export_hf_2p,
    "merge-lora": _merge_lora,
    "export-adapter": _export_adapter,
    "convert-unroll": _convert_unroll,
    "verify": _verify,
    "floor-decode": _floor([]),
    "floor-codec": _floor(["--encode", "1"]),  # the writers' zarr2 level
    "baseline": _baseline,
}
assert set(COMMANDS) == set(OPS), set(COMMANDS) ^ set(OPS)


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
    def commands(self, op: str, name: str, out: Path) -> list[list[str]]:
        """The command lines of ``op`` on step ``name``, writing to ``out`` (several: started
        together)."""
        return COMMANDS[op](Op(self.args, self.work, self.infos, name, out))

    # -- one measured operation -------------------------------------------------------------
    def measure(
        self, op: str, name: str, tag: str, repeat: int, *, out: Path, warm: list[Path]
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
        warm_cache(*warm)
        env = child_env([package] if op != "cp" else None)
        logs = [self.logs / f"{label}-p{i}.log" for i in range(len(cmds))]
        print(f"[{label}] {' '.join(cmds[0][:6])} ...", file=sys.stderr, flush=True)
        res = wrapped(cmds, env, self.scratch, logs, self.args.timeout)
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
            tails = "\n".join(tail(x) for x in logs)
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
        settle(out)
        subprocess.run(["cp", "-r", str(step), str(out)], check=True)  # once, untimed
        settle(out)
        for r in range(self.args.repeats):
            self.measure("cp", name, "", r, out=out, warm=[step])
            settle(out)

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
                    settle(out)
                    warm = [step]
                    if op == "merge-lora":
                        warm = [step, step_path(self.work, "llama-fsdp")]
                    run = self.measure(op, name, tag, r, out=out, warm=warm)
                    if run["rc"] == 0 and op.startswith("export-hf"):
                        self.digests[(name, op, tag, r)] = digest(out)
                    if op == "convert-unroll" and "verify" in ops and run["rc"] == 0:
                        self.verify(name, tag, r, out)
                    settle(out)

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
        self.measure("verify", name, tag, r, out=out, warm=[out])

    def baselines(self) -> None:
        for tag in self.packages:
            for r in range(self.args.repeats):
                self.measure("baseline", "-", tag, r, out=self.scratch / "out-baseline", warm=[])

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
def _step_child(verb: str, work: Path, params: dict, timeout: float) -> tuple[dict, dict]:
    """``realsize.py build`` or ``check-step`` of step ``params["name"]`` in a child under the
    wrapper: ``(its process's figures, the JSON it wrote)``; exits naming the log on a failure."""
    name, logs = params["name"], work / "logs"
    out, log = logs / f"{verb.split('-')[0]}-{name}.json", logs / f"{verb.split('-')[0]}-{name}.log"
    # the builder saves as from 8 devices (fsdp chunks); the check and the lora step need one
    devices = FSDP if verb == "build" and params["layout"] != "lora" else None
    cmd = [sys.executable, REALSIZE, verb, work, name, json.dumps(params), out]
    res = wrapped([cmd], child_env([REPO], devices=devices), work, [log], timeout)
    p = res["procs"][0]
    if p["rc"] != 0:
        raise SystemExit(f"{verb} of {name} failed (exit {p['rc']}):\n{tail(log, 40)}")
    return {"wall": res["wall"], **p}, json.loads(out.read_text())


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
    (work / "logs").mkdir(parents=True, exist_ok=True)
    print(f"{name}: building {step} ...", file=sys.stderr, flush=True)
    p, built = _step_child("build", work, params, timeout)
    built["wrapper"] = {
        "wall": round(p["wall"], 1),
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
        f"{name}: built in {p['wall']:.0f} s, peak RSS {p['maxrss_kib'] / 1024:.0f} MiB, "
        f"{built['step_bytes'] / GIB:.2f} GiB on disk; checking it with stock Orbax ...",
        file=sys.stderr,
        flush=True,
    )
    cp, check = _step_child("check-step", work, params, timeout)
    check["wall"] = round(cp["wall"], 1)
    check["peak_rss_kib"] = cp["maxrss_kib"]
    info = {"params": params, "step": str(step), "build": built, "check": check}
    marker.write_text(json.dumps(info, indent=1))
    return info
