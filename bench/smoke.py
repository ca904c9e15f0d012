"""The bench's smoke run: every script of ``bench/`` once, at its smallest size, so that none
breaks silently (issue 59). A check that each still runs to its end, not a measure: the
figures it prints mean nothing.

    python bench/smoke.py [--only NAME...] [--maxtext-python PY] [--jobs 2] [--keep DIR]

Each script runs from the repository root, with this checkout first on ``PYTHONPATH``,
writing under a temporary directory of its own (``{t}`` in its command line, and its
``TMPDIR``; removed after), two at a time (``--jobs``), MaxText's (the longest) first. Printed
per script: ``ok``, ``FAILED`` (with the tail of its output) or ``skipped: <why>``, its wall
time and its CPU time (with every process it waited for); then the totals. A script past
``TIMEOUT_S`` is killed with its whole session. Exit status 1 if any script failed (a skip is
not a failure).

What a smoke run spends is interpreters starting, each importing JAX, Orbax and the package
(4 s of CPU; MaxText's scripts 10 to 15 s more), not the work at these sizes. So, with
``OMTL_BENCH_SMOKE=1`` in every script's environment (`inproc.smoke_run`):

- a script runs each of its Python children (its measured modes, its input builder) in its
  own process, through `inproc.python`: the same command line, argument parsing and output,
  without a new interpreter. Not MaxText's scripts, whose children need other environments
  (a device count, no package on the path) and are measured from outside by a wrapper;
- the scripts marked ``together`` run one after another in a single process (``smoke.py
  together``, the same `inproc.python`), each still reported on its own, after the inputs
  they need.

Interpreters: ``core`` scripts run with this Python (the project's own venv, with the test
extra: the GCS scripts start the fake-gcs-server emulator of ``tests/gcs``). ``maxtext``
scripts need MaxText 0.2.5 (Python 3.12): the interop venv that ``.ci/interop.sh`` builds,
found under its cache (``$ORBAX_MAXTEXT_LAYOUT_CACHE``, else
``${XDG_CACHE_HOME:-~/.cache}/orbax-maxtext-layout``, the newest complete ``interop-venv-*``)
or given with ``--maxtext-python``; without one they are skipped, saying so.

``SCRIPTS`` lists every ``bench/*.py``: a script with its smallest command line, or a module
with the script that runs it (``tests/test_bench.py`` fails on a file missing from it). Among
the scripts, ``bench/_internal.py`` imports every package internal the bench reaches (a rename
fails there, by name).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from inproc import ENV as SMOKE  # the scripts' switch: children in process, no measuring care
from inproc import python

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TIMEOUT_S = 600  # per script: a hang fails the run instead of holding CI


@dataclass(frozen=True)
class Script:
    """A script's smallest run: ``argv`` after ``python bench/<name>`` (``{t}``: its own
    temporary directory; ``{shared}``: the inputs ``prepare(shared, python)`` made, once for
    every script that names the same ``prepare``, before them), with the ``venv`` (``core`` or
    ``maxtext``) it needs. ``together``: it runs in one process with the other such scripts,
    one after another (`run_together`): their imports, not their work, would cost the most."""

    venv: str
    argv: str
    prepare: Callable[[Path, str], float] | None = None  # its CPU seconds (nan: not known)
    together: bool = False


@dataclass(frozen=True)
class Result:
    """How a script's run (or an input's making, ``(name)``) went."""

    name: str
    ok: bool
    wall: float
    cpu: float
    tail: str = ""  # its command line and the end of its output


def _synth_step(shared: Path, py: str) -> float:
    """A synthetic Tunix step of 1 MiB at ``shared/src/actor/1`` (bench/synth.py), the input
    of the scripts that read a step, and it converted at ``shared/target/actor/1`` (their
    ``--target-from``). In a fresh interpreter, or in this one where it runs the scripts
    `together` (`inproc.python`; ``py`` is this one's)."""
    code = (
        "import sys, synth, pathlib; root = pathlib.Path(sys.argv[1]); "
        "src = synth.make_step(root / 'src', 1, 1 << 20); "
        "synth.converted_copy(src, root / 'target' / 'actor' / '1')"
    )
    done = python(["-c", code, str(shared)], env=_env(), cwd=HERE, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"synth.make_step: exit {done.returncode}\n{done.stderr[-3000:]}")
    return float("nan")


def _llama_step(shared: Path, py: str) -> float:
    """realsize.py's tiny ``llama-fsdp`` (``--tiny --layers 1``), built and checked once
    (`realsize_ops.ensure_step`) under ``shared/llama``, and a work directory for each script
    that reuses it: ``shared/realsize.py`` and ``shared/import_hf.py``, each with the step (a
    link) and its marker. Its CPU seconds."""
    name, work = "llama-fsdp", shared / "llama"
    code = (
        "import sys, pathlib, realsize_ops as ro, realsize_steps as rs; "
        f"ro.ensure_step(pathlib.Path(sys.argv[1]), {name!r}, "
        f"rs.step_params({name!r}, 1, 4, 0, True), {TIMEOUT_S})"
    )
    work.mkdir()
    why, cpu = _spawn([py, "-c", code, str(work)], _env(), shared / "llama.log", cwd=HERE)
    if why:
        log = (shared / "llama.log").read_text(errors="replace")
        raise RuntimeError(f"realsize_ops.ensure_step: {why}\n{log[-3000:]}")
    for script in ("realsize.py", "import_hf.py"):
        (shared / script).mkdir()
        (shared / script / name).symlink_to(work / name, target_is_directory=True)
        shutil.copy(work / f"{name}.step.json", shared / script)
    return cpu


# Modes: every mode of run.py and leaves.py (in their own process, a mode costs a fraction of
# a second at these sizes). lora.py checks its memory bound against the baseline's RSS:
# without a baseline, the bound fails.
RUN_MODES = "baseline cp naive convert copy inplace"
RUN_MODES += " restore_tunix restore_stock restore_tunix_v1 restore_stock_v1"
SCRIPTS: dict[str, Script | str] = {
    # -- the package's own venv -------------------------------------------------------------
    "_internal.py": Script("core", "", together=True),
    "run.py": Script(
        "core", f"--sizes 2MiB --repeats 1 --budget 64MiB --modes {RUN_MODES}", together=True
    ),
    "leaves.py": Script("core", "--layers 1 --repeats 1", together=True),  # every mode
    "lora.py": Script(
        "core",
        "--size 4MiB --layers 2 --rank 4 --budgets 64MiB --repeats 1",  # every mode
        together=True,
    ),
    "restore.py": Script(
        "core", "--work {t} --params 2e5 --chunks 1 2 --devices 2 --rounds 1 --full-state 2e6"
    ),
    "floor.py": Script("core", "{shared}/src/actor/1 --encode 1", _synth_step, together=True),
    "walk.py": Script(
        "core",
        "-- convert {shared}/src --target-from {shared}/target/actor/1 --out {t}/walked -q",
        _synth_step,
        together=True,
    ),
    "hf_headers.py": Script("core", "--scale 0.001 --repeats 1", together=True),
    "gcs.py": Script("core", "--size 2MiB", together=True),
    "gcs_restore.py": Script(
        "core", "--work {t} --params 2e5 --chunks 1 2 --latency 0 --rounds 1", together=True
    ),
    # -- MaxText 0.2.5 (the interop venv); the pool starts them first, in this order -----------
    "export_hf.py": Script(
        "maxtext",
        "--tiny --layers 1 --weight-dtype bfloat16 --repeats 1 --modes ours --min-weights 0",
    ),
    "import_hf.py": Script(
        "maxtext",
        "--tiny --layers 1 --work {shared}/import_hf.py --step llama-fsdp"
        " --ops cp floor import-hf import-hf-adapter --adapter --quiet-wait 0",
        _llama_step,
    ),
    "realsize.py": Script(
        "maxtext",
        "--tiny --layers 1 --work {shared}/realsize.py --only llama-fsdp"
        " --ops cp export-hf floor-decode",
        _llama_step,
    ),
    "import_as_lora.py": Script("maxtext", "--tiny --layers 2 --rank 4 --repeats 1 --work {t}"),
    # -- modules: run by the scripts named ---------------------------------------------------
    "smoke.py": "this driver",
    "child.py": "run.py (each mode's measured child)",
    "inproc.py": "run.py, leaves.py, lora.py, hf_headers.py, gcs_restore.py, smoke.py (children)",
    "synth.py": "run.py, leaves.py, restore.py, floor.py and walk.py (their steps)",
    "realsize_steps.py": "realsize.py, import_hf.py, export_hf.py, lora.py, synth.py (shared helpers)",
    "realsize_build.py": "realsize.py, import_hf.py (the step builder)",
    "realsize_ops.py": "realsize.py, import_hf.py",
    "realsize_wrap.py": "realsize.py, import_hf.py (the measuring wrapper)",
    "realsize_report.py": "realsize.py",
    "realsize_prove.py": "realsize.py prove (not in the smoke run: it saves stock steps twice)",
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE)])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)
    env[SMOKE] = "1"
    return env


def maxtext_python() -> tuple[str | None, str]:
    """The interop venv's python (see the module's docstring), or ``(None, why not)``."""
    cache = os.environ.get("ORBAX_MAXTEXT_LAYOUT_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "orbax-maxtext-layout"
    )
    venvs = [d for d in Path(cache).glob("interop-venv-*") if (d / ".complete").is_file()]
    if not venvs:
        return None, f"no MaxText venv: no complete interop-venv-* in {cache} (.ci/interop.sh)"
    newest = max(venvs, key=lambda d: (d / ".complete").stat().st_mtime)
    return str(newest / "bin" / "python"), ""


def _spawn(cmd: list[str], env: dict[str, str], log: Path, cwd: Path = REPO) -> tuple[str, float]:
    """Runs ``cmd`` (output to ``log``) in a session of its own: ``(exit status words, CPU s)``,
    the CPU seconds of it and of every process it waited for (``wait4``'s rusage). Past
    ``TIMEOUT_S`` its whole session is killed."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    timer = threading.Timer(TIMEOUT_S, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    rc = proc.returncode
    why = f"exit {rc}" if rc != -signal.SIGKILL else f"killed: over {TIMEOUT_S} s, or the kernel"
    return why if rc else "", usage.ru_utime + usage.ru_stime


def _argv(name: str, root: Path) -> tuple[list[str], Path]:
    """``name``'s command line after ``python``, and its fresh directory under ``root``."""
    script = SCRIPTS[name]
    assert isinstance(script, Script), name
    tmp = Path(tempfile.mkdtemp(prefix=f"{name[:-3]}-", dir=root))
    return [str(HERE / name), *script.argv.format(t=tmp, shared=root / "shared").split()], tmp


def run_one(name: str, py: str, root: Path, keep: bool) -> list[Result]:
    """Runs one script in a fresh process and directory under ``root``."""
    argv, tmp = _argv(name, root)
    env = {**_env(), "TMPDIR": str(tmp)}  # the scripts' own temporary directories too
    log = root / f"{name[:-3]}.log"
    t0 = time.perf_counter()
    why, cpu = _spawn([py, *argv], env, log)
    wall = time.perf_counter() - t0
    out = log.read_text(errors="replace")
    if not keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return [Result(name, not why, wall, cpu, f"$ {py} {' '.join(argv)}\n{why}\n{out[-4000:]}")]


def run_group(names: list[str], py: str, root: Path, prepares: list[str]) -> list[Result]:
    """Runs ``names`` `together` in one fresh process (after the ``prepares`` their inputs
    need), each reported as `run_together` prints it."""
    log = root / "together.log"
    cmd = [py, str(HERE / "smoke.py"), "together", str(root), *names, "--prepare", *prepares]
    t0 = time.perf_counter()
    why, cpu = _spawn(cmd, _env(), log)
    out = log.read_text(errors="replace")
    got = [Result(**json.loads(x)) for x in out.splitlines() if x.startswith('{"name": ')]
    missing = [n for n in [*(f"({p})" for p in prepares), *names] if n not in {r.name for r in got}]
    if why or missing:  # died on the way: the rest of the group did not run
        wall, spent = time.perf_counter() - t0 - sum(r.wall for r in got), sum(r.cpu for r in got)
        got += [Result(n, False, wall, cpu - spent, f"{why}\n{out[-4000:]}") for n in missing]
    return got


def run_together(root: Path, names: list[str], prepares: list[str]) -> None:
    """In the child of `run_group`: the ``prepares``, then ``names``, one after another in this
    process (`inproc.python`: as ``python bench/NAME ARGV``), each printed as a JSON line."""
    for p in prepares:
        usage, t0 = _cpu_self(), time.perf_counter()
        try:
            _prepares()[p](root / "shared", sys.executable)
            ok, tail = True, ""
        except Exception as e:  # reported as the input's failure
            ok, tail = False, f"{type(e).__name__}: {e}"
        _print_result(Result(f"({p})", ok, time.perf_counter() - t0, _cpu_self() - usage, tail))
        if not ok:
            return
    for name in names:
        argv, tmp = _argv(name, root)
        usage, t0 = _cpu_self(), time.perf_counter()
        done = python(argv, env={**os.environ, "TMPDIR": str(tmp)}, cwd=REPO)
        tail = f"$ python {' '.join(argv)}\nexit {done.returncode}\n{done.stdout}{done.stderr}"
        wall, cpu = time.perf_counter() - t0, _cpu_self() - usage
        _print_result(Result(name, done.returncode == 0, wall, cpu, tail[-4000:]))


def _prepares() -> dict[str, Callable[[Path, str], float]]:
    scripts = [s for s in SCRIPTS.values() if isinstance(s, Script) and s.prepare]
    return {s.prepare.__name__: s.prepare for s in scripts}  # type: ignore[union-attr]


def _print_result(r: Result) -> None:
    print(json.dumps(dataclasses.asdict(r)), flush=True)


def _cpu_self() -> float:
    """CPU seconds of this process and of the children it waited for."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def pythons(given: str | None) -> tuple[dict[str, str | None], dict[str, str]]:
    """``({venv: python or None}, {venv: why it is missing})``."""
    if given:
        return {"core": sys.executable, "maxtext": given}, {}
    mt, why_not = maxtext_python()
    return {"core": sys.executable, "maxtext": mt}, {"maxtext": why_not}


def _script(name: str) -> Script:
    script = SCRIPTS[name]
    assert isinstance(script, Script), name
    return script


def make_input(prepare: Callable[[Path, str], float], root: Path, py: str) -> list[Result]:
    """Makes an input of the scripts (``prepare``) in this process's turn of the pool."""
    t0 = time.perf_counter()
    try:
        cpu, ok, tail = prepare(root / "shared", py), True, ""
    except Exception as e:  # reported as the input's failure
        cpu, ok, tail = float("nan"), False, f"{type(e).__name__}: {e}"
    return [Result(f"({prepare.__name__})", ok, time.perf_counter() - t0, cpu, tail)]


def after(made: Future | None, run: Callable[..., list[Result]], name: str, *a) -> list[Result]:
    """``run(name, *a)`` once its input is ``made`` (a failed input fails it, not run)."""
    if made is not None and not all(r.ok for r in made.result()):
        return [Result(name, False, 0.0, 0.0, "not run: its input failed")]
    return run(name, *a)


def run_all(names: list[str], jobs: int, root: Path, given: str | None, *, keep: bool) -> list[str]:
    """Runs ``names`` ``jobs`` at a time (the inputs they share first, then MaxText's scripts,
    the longest; the `together` ones in one process), printing each result as it comes;
    returns the names that failed."""
    found, why = pythons(given)
    todo = []
    for name in names:
        if found[_script(name).venv] is None:
            print(f"{name:16} skipped: {why[_script(name).venv]}", flush=True)
        else:
            todo.append(name)
    group = [n for n in todo if _script(n).together]
    group = group if len(group) > 1 else []
    alone = sorted((n for n in todo if n not in group), key=lambda n: _script(n).venv != "maxtext")
    first = {p: found[_script(n).venv] for n in alone if (p := _script(n).prepare)}
    inside = sorted({p.__name__ for n in group if (p := _script(n).prepare) and p not in first})
    (root / "shared").mkdir()
    failed: list[str] = []
    with ThreadPoolExecutor(max(jobs, 1)) as pool:
        made = {p: pool.submit(make_input, p, root, py) for p, py in first.items()}
        futures = list(made.values())
        for n in alone:  # the group after MaxText's scripts, before the others
            if group and _script(n).venv != "maxtext":
                futures.append(pool.submit(run_group, group, sys.executable, root, inside))
                group = []
            py = found[_script(n).venv]
            futures.append(
                pool.submit(after, made.get(_script(n).prepare), run_one, n, py, root, keep)
            )  # type: ignore[arg-type]
        if group:
            futures.append(pool.submit(run_group, group, sys.executable, root, inside))
        for f in as_completed(futures):
            for r in f.result():
                _report(r)
                failed += [] if r.ok else [r.name]
    return failed


def _report(r: Result) -> None:
    cpu = "" if r.cpu != r.cpu else f"  (CPU {r.cpu:6.1f} s)"  # nan: not measured
    print(f"{r.name:16} {'ok' if r.ok else 'FAILED':6} {r.wall:6.1f} s{cpu}", flush=True)
    if not r.ok:
        print("    " + r.tail.replace("\n", "\n    "), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runnable = [n for n, s in SCRIPTS.items() if isinstance(s, Script)]
    ap.add_argument("--only", nargs="+", choices=runnable, metavar="NAME", help="these scripts")
    ap.add_argument("--maxtext-python", help="MaxText 0.2.5's python (default: the interop venv)")
    ap.add_argument("--jobs", type=int, default=2, help="scripts at a time (default 2)")
    ap.add_argument("--keep", type=Path, metavar="DIR", help="leave every script's files here")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["together"]:  # run_group's child
        cut = argv.index("--prepare")
        run_together(Path(argv[1]), argv[2:cut], argv[cut + 1 :])
        return 0
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="omtl-smoke-", dir=args.keep))
    try:
        failed = run_all(
            args.only or runnable, args.jobs, root, args.maxtext_python, keep=bool(args.keep)
        )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    total = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    names = " ".join(failed) or "-"
    print(f"smoke run: {len(failed)} failed ({names}), {total:.0f} s in all (CPU {cpu:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
