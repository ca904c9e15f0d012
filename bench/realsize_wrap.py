"""The measuring wrapper of `bench/realsize.py` (and `bench/import_hf.py`): commands started
together, each one's wall time, peak RSS and ``/proc/<pid>/io``.

    python bench/realsize_wrap.py SPEC_JSON

Standard library only (a child's ru_maxrss starts from its parent's high-water mark).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from realsize_steps import child_env


def _proc_io(pid: int) -> dict:
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("rchar", "wchar", "read_bytes", "write_bytes"):
            out[k] = int(v)
    return out


def wrap(spec_file: Path) -> None:
    """Starts the commands of ``spec_file`` together; prints, as JSON, the wall time until the
    last exits and, per command, its exit code, wall time, peak RSS (``wait4``'s rusage: its
    VmHWM and that of any process it reaped) and its ``/proc/<pid>/io`` read after it exited,
    before it is reaped."""
    spec = json.loads(spec_file.read_text())
    procs, results = {}, [None] * len(spec["cmds"])
    t0 = time.perf_counter()
    for i, (cmd, log) in enumerate(zip(spec["cmds"], spec["logs"], strict=True)):
        f = open(log, "wb")  # closed when the process is reaped
        p = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=spec["cwd"],
            env=spec["env"],
            start_new_session=True,
        )
        procs[p.pid] = (i, p, f, time.perf_counter())
    killed = []

    def kill() -> None:
        for _i, p, _f, _t in procs.values():
            if p.returncode is None:
                killed.append(p.pid)
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass

    timer = threading.Timer(spec["timeout"], kill)
    timer.daemon = True
    timer.start()
    end = t0
    while any(r is None for r in results):
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        pid = info.si_pid
        t = time.perf_counter()
        io = _proc_io(pid)  # the exited process, not yet reaped
        _, status, ru = os.wait4(pid, 0)
        if pid not in procs:
            continue
        i, p, f, start = procs[pid]
        p.returncode = os.waitstatus_to_exitcode(status)
        f.close()
        end = max(end, t)
        results[i] = {
            "rc": p.returncode if pid not in killed else "timeout",
            "wall": t - start,
            "maxrss_kib": ru.ru_maxrss,
            "minflt": ru.ru_minflt,
            "majflt": ru.ru_majflt,
            "user_s": round(ru.ru_utime, 2),
            "sys_s": round(ru.ru_stime, 2),
            **io,
        }
    timer.cancel()
    print(json.dumps({"wall": end - t0, "procs": results}))


def wrapped(
    cmds: list[list[str]], env: dict, cwd: Path, logs: list[Path], timeout: float = 7200
) -> dict:
    """``cmds`` started together under the wrapper, in a fresh process."""
    spec = {
        "cmds": [[str(c) for c in cmd] for cmd in cmds],
        "env": env,
        "cwd": str(cwd),
        "logs": [str(x) for x in logs],
        "timeout": timeout,
    }
    spec_file = logs[0].with_suffix(".wrap.json")
    spec_file.write_text(json.dumps(spec))
    res = subprocess.run(
        [sys.executable, str(Path(__file__)), str(spec_file)],
        capture_output=True,
        text=True,
        env=child_env(None),
    )
    if res.returncode != 0:
        raise RuntimeError(f"the wrapper failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def tail(log: Path, n: int = 25) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join("    " + x for x in lines[-n:])


if __name__ == "__main__":
    wrap(Path(sys.argv[1]))
