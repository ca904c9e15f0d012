"""The bench's smoke run: every script of ``bench/`` once, at its smallest size, so that none
breaks silently (issue 59). A check that each still runs to its end, not a measure: the
figures it prints mean nothing.

    python bench/smoke.py [--only NAME...] [--maxtext-python PY] [--keep DIR]

Each script runs in a fresh process from the repository root, with this checkout first on
``PYTHONPATH``, writing under a temporary directory of its own (``{t}`` in its command line,
and its ``TMPDIR``; removed after), two at a time (``--jobs``). Printed per
script: ``ok``, ``FAILED`` (with the tail of its output) or ``skipped: <why>``, and its wall
time; then the total. Exit status 1 if any script failed (a skip is not a failure).

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
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TIMEOUT_S = 600  # per script: a hang fails the run instead of holding CI


@dataclass(frozen=True)
class Script:
    """A script's smallest run: ``argv`` after ``python bench/<name>`` (``{t}``: its own
    temporary directory; ``{shared}``: the inputs ``prepare(shared, python)`` made, once for
    every script that names the same ``prepare``, read only), with the ``venv`` (``core`` or
    ``maxtext``) it needs."""

    venv: str
    argv: str
    prepare: Callable[[Path, str], None] | None = None


def _synth_step(shared: Path, python: str) -> None:
    """A synthetic Tunix step of 1 MiB at ``shared/src/actor/1`` (bench/synth.py): the input
    of the scripts that read a step."""
    code = "import sys, synth, pathlib; synth.make_step(pathlib.Path(sys.argv[1]), 1, 1 << 20)"
    _run_checked([python, "-c", code, str(shared / "src")], env=_env(), cwd=HERE)


# Modes: one of each kind of code path (a flag variant, e.g. convert --copy, is left to the
# tests), each mode being a process of its own that imports the package. lora.py checks its
# memory bound against the baseline's RSS: without a baseline, the bound fails.
RUN_MODES = "naive convert restore_tunix restore_stock_v1"
LEAVES_MODES = "inspect convert verify restore_tunix_sharded restore_stock"
SCRIPTS: dict[str, Script | str] = {
    # -- the package's own venv -------------------------------------------------------------
    "_internal.py": Script("core", ""),
    "run.py": Script("core", f"--sizes 2MiB --repeats 1 --budget 64MiB --modes {RUN_MODES}"),
    "leaves.py": Script("core", f"--layers 1 --repeats 1 --modes {LEAVES_MODES}"),
    "lora.py": Script(
        "core",
        "--size 4MiB --layers 2 --rank 4 --budgets 64MiB --repeats 1 --modes baseline naive merge",
    ),
    "restore.py": Script(
        "core", "--work {t} --params 2e5 --chunks 1 2 --devices 2 --rounds 1 --full-state 2e6"
    ),
    "floor.py": Script("core", "{shared}/src/actor/1 --encode 1", _synth_step),
    "walk.py": Script("core", "-- convert {shared}/src --out {t}/walked -q", _synth_step),
    "hf_headers.py": Script("core", "--scale 0.001 --repeats 1"),
    "gcs.py": Script("core", "--size 2MiB"),
    "gcs_restore.py": Script("core", "--work {t} --params 2e5 --chunks 1 2 --latency 0 --rounds 1"),
    # -- MaxText 0.2.5 (the interop venv) ---------------------------------------------------
    "export_hf.py": Script(
        "maxtext",
        "--layers 1 --weight-dtype bfloat16 --repeats 1 --modes baseline ours --min-weights 0",
    ),
    "realsize.py": Script(
        "maxtext", "--tiny --layers 1 --work {t} --only llama-fsdp --ops cp export-hf floor-decode"
    ),
    "import_hf.py": Script(
        "maxtext", "--tiny --layers 1 --work {t} --ops cp floor import-hf --quiet-wait 0"
    ),
    "import_as_lora.py": Script("maxtext", "--tiny --layers 2 --rank 4 --repeats 1 --work {t}"),
    # -- modules: run by the scripts named ---------------------------------------------------
    "smoke.py": "this driver",
    "child.py": "run.py (each mode's measured child)",
    "synth.py": "run.py, leaves.py, restore.py, floor.py and walk.py (their steps)",
    "realsize_steps.py": "realsize.py, import_hf.py",
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
    return env


def _run_checked(cmd: list[str], *, env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exit {done.returncode}\n{done.stderr[-3000:]}")


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


def run_one(name: str, python: str, root: Path, keep: bool) -> tuple[bool, float, str]:
    """Runs one script in a fresh directory under ``root``: ``(ok, wall s, output tail)``."""
    script = SCRIPTS[name]
    assert isinstance(script, Script), name
    tmp = Path(tempfile.mkdtemp(prefix=f"{name[:-3]}-", dir=root))
    argv = script.argv.format(t=tmp, shared=root / "shared").split()
    cmd = [python, str(HERE / name), *argv]
    env = {**_env(), "TMPDIR": str(tmp)}  # the scripts' own temporary directories too
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S
        )
        ok, out = done.returncode == 0, f"exit {done.returncode}\n{done.stdout}{done.stderr}"
    except subprocess.TimeoutExpired as e:
        ok, out = False, f"timed out after {TIMEOUT_S} s\n{e.stdout or ''}{e.stderr or ''}"
    wall = time.perf_counter() - t0
    if not keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return ok, wall, f"$ {' '.join(cmd)}\n{out[-4000:]}"


def pythons(given: str | None) -> tuple[dict[str, str | None], dict[str, str]]:
    """``({venv: python or None}, {venv: why it is missing})``."""
    if given:
        return {"core": sys.executable, "maxtext": given}, {}
    mt, why_not = maxtext_python()
    return {"core": sys.executable, "maxtext": mt}, {"maxtext": why_not}


def run_all(names: list[str], jobs: int, root: Path, given: str | None, *, keep: bool) -> list[str]:
    """Prepares the shared inputs, then runs ``names``, ``jobs`` at a time, printing each
    result as it comes; returns the names that failed."""
    found, why = pythons(given)
    todo = []
    for name in names:
        script = SCRIPTS[name]
        assert isinstance(script, Script), name
        if found[script.venv] is None:
            print(f"{name:16} skipped: {why[script.venv]}", flush=True)
        else:
            todo.append((name, found[script.venv]))
    (root / "shared").mkdir()
    failed: list[str] = []
    for prepare in {SCRIPTS[n].prepare for n, _ in todo} - {None}:  # type: ignore[union-attr]
        t0 = time.perf_counter()
        try:
            prepare(root / "shared", sys.executable)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"input {prepare.__name__} FAILED\n{e}", flush=True)
            return [n for n, _ in todo]
        print(f"{'(' + prepare.__name__ + ')':16} ok {time.perf_counter() - t0:6.1f} s", flush=True)
    with ThreadPoolExecutor(max(jobs, 1)) as pool:
        futures = {pool.submit(run_one, n, py, root, keep): n for n, py in todo}
        for f in as_completed(futures):
            ok, wall, out = f.result()
            print(f"{futures[f]:16} {'ok' if ok else 'FAILED'} {wall:6.1f} s", flush=True)
            if not ok:
                failed.append(futures[f])
                print("    " + out.replace("\n", "\n    "), flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runnable = [n for n, s in SCRIPTS.items() if isinstance(s, Script)]
    ap.add_argument("--only", nargs="+", choices=runnable, metavar="NAME", help="these scripts")
    ap.add_argument("--maxtext-python", help="MaxText 0.2.5's python (default: the interop venv)")
    ap.add_argument("--jobs", type=int, default=2, help="scripts at a time (default 2)")
    ap.add_argument("--keep", type=Path, metavar="DIR", help="leave every script's files here")
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
    print(f"smoke run: {len(failed)} failed ({' '.join(failed) or '-'}), {total:.0f} s in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
