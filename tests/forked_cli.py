"""The command line forked from a warm interpreter: for tests of what a command does (its
output, exit code and files), not of the process it runs in.

A fresh ``python -m orbax_maxtext_layout`` spends ~4.5 s of CPU importing JAX and Orbax on
the CI machine, and the core suite runs commands ~150 times. `run_cli` forks each one from
the reliability suite's fork server (`tests/reliability/rel_zygote.py`; one per xdist worker,
started on first use), which has imported everything but never started a JAX backend or
touched tensorstore. The child runs exactly what ``python -m orbax_maxtext_layout`` runs,
`orbax_maxtext_layout.cli.main` on the argv (``sys.argv`` set as ``-m`` sets it), with:

- the environment the subprocess would have had (this process's, updated with ``env``, as
  `conftest.child_env` builds it), set exactly: a variable this process lacks is absent;
- the working directory ``cwd``; stdin from /dev/null; stdout and stderr captured apart;
- the exit code Python's would be: ``main``'s return value, a SystemExit's code
  (argparse's 2), 1 after the traceback of an uncaught exception.

What a fork cannot give, and where a test still starts a real interpreter: variables read
when the interpreter or JAX starts (``PYTHON*``, ``JAX_*``, ``XLA_*``, ...: `run_cli`
refuses an environment that changes one), the entry points (``python -m``, the console
script, the heap frozen at exit, the CPU pinning of a process that never imported JAX),
signals and kills of a real process, strace of one, and processes running side by side.
The server's own ``sys.path`` starts with ``tests/reliability`` and ``bench``; `run_call`
runs a function of a module there or of a ``.py`` file (a kill campaign's job).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import child_env

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests" / "reliability") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests" / "reliability"))

from rel_support import zygote  # noqa: E402
from rel_zygote import UNCAUGHT  # noqa: E402

# read when Python, JAX, XLA, the BLAS or the C library starts: a fork keeps the server's
STARTUP = re.compile(
    r"^(PYTHON|JAX_|XLA_|TPU_|LIBTPU|TF_|LD_|MALLOC_|OMP_|OPENBLAS_|MKL_|LC_|LANG)"
)


def _startup_changes(env: dict[str, str], started: dict[str, str]) -> list[str]:
    changed = []
    for key in sorted(set(env) | set(started)):
        if not STARTUP.match(key) or env.get(key) == started.get(key):
            continue
        if key == "JAX_PLATFORMS" and env.get(key) in (None, "cpu") and started[key] == "cpu":
            continue  # the server's JAX is on the CPU, as the command pins it (`cli.on_cpu`)
        if key == "PYTHONPATH" and env.get(key) == os.environ.get(key):
            continue  # this process's own (the server's adds tests/reliability and bench)
        changed.append(key)
    return changed


def run_cli(
    *args: Any,
    env: dict | None = None,
    cwd: Path | str = ROOT,
    timeout: float = 600,
    kill_after: float | None = None,
    trace: list[str] | None = None,
) -> subprocess.CompletedProcess:
    """``python -m orbax_maxtext_layout *args`` with ``env`` added to this process's
    environment (a variable ``None`` there: removed), in ``cwd``, as a `subprocess.run` with
    ``capture_output=True, text=True`` would return it, run in a child forked from the fork
    server (the module's docstring). ``kill_after``: SIGKILL the child that many seconds
    after its fork unless it has exited (a kill campaign: return code -9). ``trace``: a
    tracer's command line (`hostile_support.strace_argv`), attached to the child before it
    starts the command (`hostile_support.attach`): every system call of the command, none of
    an interpreter's start."""
    argv = [str(a) for a in args]
    cmd = [sys.executable, "-m", "orbax_maxtext_layout", *argv]
    job = {"kind": "cli", "argv": argv, "stop": bool(trace)}
    return _run_job(job, cmd, env, Path(cwd), timeout, kill_after, trace)


def run_call(
    func: str,
    *,
    env: dict | None = None,
    timeout: float = 600,
    kill_after: float | None = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """``func(**kwargs)`` (``"module:function"``, a module on the server's path:
    ``tests/reliability``, ``bench``; or ``"FILE.py:function"``) in a forked child, as a script that calls it would run
    in a fresh process: `run_cli`'s environment, kill and result (its exit code: the
    function's int return value, else 0)."""
    cmd = [sys.executable, "-c", f"{func}(**{kwargs!r})"]
    job = {"kind": "call", "func": func, "kwargs": kwargs}
    return _run_job(job, cmd, env, ROOT, timeout, kill_after)


def _run_job(
    job: dict,
    cmd: list,
    env: dict | None,
    cwd: Path,
    timeout: float,
    kill_after: float | None,
    trace: list[str] | None = None,
) -> subprocess.CompletedProcess:
    server = zygote()
    env = env or {}
    full = child_env({k: v for k, v in env.items() if v is not None}, cpu=False)
    full = {k: v for k, v in full.items() if env.get(k, "") is not None}
    changed = _startup_changes(full, server.env)
    if changed:
        raise ValueError(f"{changed} take effect when a process starts: run a real process")
    handle = server.start(job, env=full, cwd=cwd, exact=True)
    tracer = None
    if trace:
        from hostile_support import attach

        tracer = attach(trace, handle[1])
    try:
        res = server.wait(handle, kill_after=kill_after, timeout=timeout)
    finally:
        if tracer is not None:
            tracer.wait(timeout=60)  # it ends with its tracee, the log complete
    if res.timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, res.stdout, res.stderr)
    stderr = res.stderr.replace(UNCAUGHT + "\n", "")  # the server's marker, not Python's
    return subprocess.CompletedProcess(cmd, res.rc, res.stdout, stderr)
