"""A bench script's Python children: fresh interpreters, or, in the smoke run, this one.

Each measured operation of a bench script runs in a fresh interpreter (its peak RSS is its
own, and no import is warm). `python` starts such a child, as ``subprocess.run([sys.executable,
*argv], ...)`` would. In the smoke run (``OMTL_BENCH_SMOKE=1`` in the environment, which
`bench/smoke.py` sets; `smoke_run`) it runs the same command in this process instead: the script's child code, its argument parsing and its JSON output,
without a new interpreter that imports JAX, Orbax and the package again (about 4 s of CPU a
child). A smoke run's figures mean nothing anyway: they are not a measure.

In this process: ``sys.argv``, ``sys.path``, the working directory and the environment are
the command's while it runs (then restored), its stdout and stderr are captured (Python's
own writes; a library writing to the file descriptors directly writes to this process's),
``SystemExit`` is its exit status, an exception exit status 1 with its traceback on its
stderr. The peak RSS (``VmHWM``) is reset before it (``/proc/self/clear_refs``), so a child's
own reading starts from what this process holds now. Standard library only.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
import traceback
from collections.abc import Mapping, Sequence

ENV = "OMTL_BENCH_SMOKE"


def smoke_run() -> bool:
    """Whether this is `bench/smoke.py`'s run (its figures are not a measure): `python` then
    runs its commands in this process, and a script may skip what only keeps figures clean."""
    return os.environ.get(ENV) == "1"


def python(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    check: bool = False,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python ARGV...`` (``script.py ARGS``, ``-c CODE ARGS`` or ``-m MODULE ARGS``), its
    stdout and stderr captured as text: a fresh interpreter, or this one (`smoke_run`)."""
    if not smoke_run():
        cmd = [sys.executable, *argv]
        return subprocess.run(
            cmd, env=env, cwd=cwd, check=check, capture_output=True, text=True, timeout=timeout
        )
    rc, out, err = _here(list(argv), env, cwd)
    if check and rc:
        raise subprocess.CalledProcessError(rc, [sys.executable, *argv], out, err)
    return subprocess.CompletedProcess([sys.executable, *argv], rc, out, err)


def _here(argv: list[str], env: Mapping[str, str] | None, cwd) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    saved = (sys.argv[:], sys.path[:], os.getcwd(), dict(os.environ))
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        _reset_peak_rss()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = _run(argv)
    finally:
        sys.argv[:], sys.path[:] = saved[0], saved[1]
        os.chdir(saved[2])
        os.environ.clear()
        os.environ.update(saved[3])
    return rc, out.getvalue(), err.getvalue()


def _run(argv: list[str]) -> int:
    """Runs the command as ``__main__``: its exit status."""
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, os.getcwd())
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception:  # a crash of the child: its exit status, as a fresh interpreter's
        traceback.print_exc()
        return 1
    return 0


def _reset_peak_rss() -> None:
    """VmHWM back to the current RSS (Linux 4.0 and later; elsewhere it stays)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
