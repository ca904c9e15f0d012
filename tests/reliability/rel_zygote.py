"""A fork server for the reliability suite: import the library once, fork a child per job.

Starting Python and importing jax/orbax takes ~1.5 s on the CI machine, longer than a
conversion of the test checkpoints. Crash tests need kills that land *inside* the
conversion, and dozens of them, so each job runs in a child forked from this
process, which has imported everything but never touched tensorstore or a jax
backend (so forking it is safe). The child runs exactly what the command line runs
(`orbax_maxtext_layout.cli.main`) or a job function of `rel_jobs`.

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout.

* ``{"op": "start", "job": {...}, "stdout": PATH, "stderr": PATH, "env": {...}, "cwd": DIR}``
  -> ``{"id": ID, "pid": PID}``.  ``job`` is ``{"kind": "cli", "argv": [...]}`` or
  ``{"kind": "call", "func": "module:function", "kwargs": {...}}`` (``module``: a name on
  this server's path, or a ``.py`` file's path).
* ``{"op": "wait", "id": ID, "kill_after": SECONDS | null, "timeout": SECONDS}``
  -> ``{"rc": RC, "killed": BOOL, "elapsed": SECONDS}``. ``kill_after`` counts from the
  fork; the child is sent SIGKILL then unless it has exited. The kill is sent before
  the child is reaped, so its pid cannot have been reused.
  With ``"env_exact": true`` the child's environment is ``env`` alone (what a fresh process
  would get: `tests/forked_cli.py`), not this process's updated with it.
* ``{"op": "exit"}``.

A job with ``"stop": true`` stops itself (SIGSTOP) right before it runs, for the caller to
attach a tracer (strace ``-p PID``) and resume it (SIGCONT): traced from its first step, none
of the imports. A job may carry ``"fsize_limit": BYTES`` (RLIMIT_FSIZE with SIGXFSZ ignored, so a write
past it fails with EFBIG) and ``"kill_on_call": {"calls": [NAMES], "at": K, "count_file": PATH}``: the child
then SIGKILLs itself (or sends itself ``"signal"``, e.g. SIGSTOP) right before its K-th call of one of the named file-system functions
(``os.rename``, ``os.unlink``, ``io.open``, ...), seen through `sys.setprofile`, and writes
the calls it made (``<library function>><call>``, in order) to ``count_file`` as JSON. That puts kills exactly
on every boundary between two file-system mutations made from Python (the OCDBT writes
inside tensorstore happen between them).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback
from pathlib import Path

# Printed after the traceback of an exception that escaped the job (what would end a real
# process); tracebacks that libraries print from background threads do not count.
UNCAUGHT = "rel_zygote: uncaught exception"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(HERE), str(REPO / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)


def _module(name: str):
    """The module ``name`` (on this server's path), or the file ``name`` (``*.py``: a module
    of a test package that another directory on the path would shadow, ``tests/gcs``)."""
    import importlib
    import importlib.util

    if not name.endswith(".py"):
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(Path(name).stem, name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _preload() -> None:
    import jax  # noqa: F401
    import orbax.checkpoint  # noqa: F401
    import rel_jobs  # noqa: F401
    import synth  # noqa: F401
    import tensorstore  # noqa: F401

    import orbax_maxtext_layout
    import orbax_maxtext_layout.cli

    try:
        import orbax_maxtext_layout.integration.manager  # noqa: F401
    except ImportError:
        pass


def _child(req: dict, proto_fd: int) -> None:
    os.close(proto_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    if req.get("env_exact"):  # the whole environment, as a fresh process would get it
        os.environ.clear()
    os.environ.update(req.get("env") or {})
    if req["job"].get("fsize_limit"):  # writes past it fail with EFBIG (SIGXFSZ ignored)
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = int(req["job"]["fsize_limit"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    if req.get("cwd"):
        os.chdir(req["cwd"])
    rc = 0
    job = req["job"]
    hook = job.get("kill_on_call")
    calls = _install_kill_hook(hook) if hook else None
    if job.get("stop"):  # held until the caller has attached its tracer, then resumed
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        if job["kind"] == "cli":
            import orbax_maxtext_layout
            from orbax_maxtext_layout.cli import main

            # sys.argv as ``python -m orbax_maxtext_layout`` sets it
            package = os.path.dirname(orbax_maxtext_layout.__file__)
            sys.argv = [os.path.join(package, "__main__.py"), *job["argv"]]
            rc = main(job["argv"]) or 0
        else:
            module, _, fn = job["func"].partition(":")
            rc = getattr(_module(module), fn)(**job.get("kwargs", {})) or 0
    except SystemExit as e:  # what Python exits with (argparse's usage errors: 2)
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException:
        traceback.print_exc()  # what Python prints for an uncaught exception
        print(UNCAUGHT, file=sys.stderr)
        rc = 1
    finally:
        if calls is not None and hook.get("count_file"):
            sys.setprofile(None)
            with open(hook["count_file"], "w") as f:
                json.dump(calls, f)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(int(rc) & 0xFF)


def _install_kill_hook(spec: dict) -> list[str]:
    import io
    import threading

    funcs = {id(io.open if n == "io.open" else getattr(os, n)): n for n in spec["calls"]}
    at = spec.get("at")
    # Or: the n-th call of one label. Unlike an absolute position, this does not move
    # when helper threads (Orbax, tensorstore) interleave their own calls differently.
    at_label, occurrence = spec.get("at_label"), spec.get("occurrence", 1)
    sig = getattr(signal, spec.get("signal", "SIGKILL"))
    seen: list[str] = []

    def hook(frame, event, arg):
        if event == "c_call" and id(arg) in funcs:
            label = f"{_caller(frame)}>{funcs[id(arg)]}"
            seen.append(label)
            hit = len(seen) == at
            if at_label is not None and label == at_label:
                hit = seen.count(label) == occurrence
            if hit:
                os.kill(os.getpid(), sig)  # SIGSTOP: the test resumes it with SIGCONT

    threading.setprofile(hook)
    sys.setprofile(hook)
    return seen


def _caller(frame) -> str:
    """The innermost library function on the stack (where the mutation comes from)."""
    f = frame
    while f is not None:
        if "orbax_maxtext_layout" in f.f_code.co_filename:
            return f.f_code.co_name
        f = f.f_back
    return frame.f_code.co_name


def _pidfd(pid: int) -> int | None:
    """A pidfd of the child, or None where the kernel has none (gVisor: the TPU host)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _exited(pid: int, pidfd: int | None, deadline: float) -> tuple[bool, int | None]:
    """Waits until the child exits or ``deadline``: ``(exited, wait status)``. Through a
    pidfd the child is not reaped (status None); polling ``waitpid`` reaps it."""
    remaining = deadline - time.monotonic()
    if pidfd is not None:
        return remaining > 0 and bool(select.select([pidfd], [], [], remaining)[0]), None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return True, status
        if time.monotonic() >= deadline:
            return False, None
        time.sleep(0.005)


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints of the server itself go to stderr, never into the protocol
    _preload()
    proto.write(json.dumps({"ready": os.getpid()}) + "\n")
    jobs: dict[int, tuple[int, float, int]] = {}  # id -> (pid, start, pidfd)
    next_id = 0
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "exit":
            break
        if op == "start":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(req, proto.fileno())
            jobs[next_id] = (pid, time.monotonic(), _pidfd(pid))
            proto.write(json.dumps({"id": next_id, "pid": pid}) + "\n")
            next_id += 1
        elif op == "wait":
            pid, start, pidfd = jobs.pop(req["id"])
            kill_after = req.get("kill_after")
            limit = kill_after if kill_after is not None else req.get("timeout", 600)
            ready, status = _exited(pid, pidfd, start + limit)
            killed = False
            if not ready:
                try:
                    os.kill(pid, signal.SIGKILL)  # not reaped yet: the pid is still ours
                    killed = True
                except ProcessLookupError:
                    pass
            if status is None:
                _, status = os.waitpid(pid, 0)
            elapsed = time.monotonic() - start
            if pidfd is not None:
                os.close(pidfd)
            rc = os.waitstatus_to_exitcode(status)
            killed = killed and rc == -signal.SIGKILL
            reply = {"rc": rc, "killed": killed, "elapsed": elapsed}
            reply["timed_out"] = killed and kill_after is None
            proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
