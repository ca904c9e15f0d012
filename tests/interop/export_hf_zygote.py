"""A fork server for test_export_hf_processes.py: import the library and MaxText's exporter once,
then fork one child per ``export-hf`` command line.

A process importing MaxText takes 10-30 s to start on the shared 2-core VM, an export of the tiny
model a few seconds (MaxText's config and model shapes) plus milliseconds of writing; the crash
tests need a dozen processes, so each runs in a child forked from this server, which imported
everything but never touched a jax backend or tensorstore (so forking it is safe). The child runs
exactly what the command line runs (`orbax_maxtext_layout.cli.main`), as the tests/reliability
fork server (rel_zygote.py) does.

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout.

* ``{"op": "start", "argv": [...], "stdout": PATH, "stderr": PATH, "kill": KILL | null}``
  -> ``{"pid": PID}``.
* ``{"op": "poll", "pid": PID}`` -> ``{"rc": RC | null}`` (null: still running).
* ``{"op": "wait", "pid": PID, "timeout": SECONDS}`` -> ``{"rc": RC}`` (SIGKILLed at the timeout).
* ``{"op": "exit"}``.

``KILL`` is ``{"call": "replace" | "rename" | "pwrite", "match": REGEX | null, "occurrence": K,
"when": "before" | "after"}``: the child SIGKILLs itself right before (or right after) its K-th
call of ``os.<call>`` whose destination path (``os.replace``/``os.rename``) matches ``match``
(``os.pwrite``: every call counts). The library calls these through the ``os`` module, so the
child wraps them there; nothing in the library is changed or told. That puts kills exactly on
the export's boundaries: a tensor written into a part file, a shard renamed into place, a
marker, the index, ``config.json``, the final rename of the work directory.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import select
import signal
import sys
import threading


def _preload() -> None:
    with contextlib.redirect_stdout(sys.stderr):
        import jax  # noqa: F401
        import maxtext.checkpoint_conversion.to_huggingface  # noqa: F401
        import orbax.checkpoint  # noqa: F401
        import tensorstore  # noqa: F401
        import transformers  # noqa: F401
        from maxtext.checkpoint_conversion.utils import utils  # noqa: F401
        from maxtext.configs import pyconfig  # noqa: F401
        from maxtext.utils import globals  # noqa: F401

        import orbax_maxtext_layout.cli
        import orbax_maxtext_layout.hf.export_hf  # noqa: F401


def _install_kill(spec: dict) -> None:
    name, when = spec["call"], spec.get("when", "before")
    pattern = re.compile(spec["match"]) if spec.get("match") else None
    want = int(spec.get("occurrence", 1))
    real = getattr(os, name)
    lock = threading.Lock()
    seen = [0]

    def hit(args: tuple) -> bool:
        if name in ("replace", "rename"):
            dst = os.path.basename(str(args[1]))
            if pattern is not None and not pattern.search(dst):
                return False
        with lock:
            seen[0] += 1
            return seen[0] == want

    def wrapped(*args, **kwargs):
        now = hit(args)
        if now and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if now:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(os, name, wrapped)


def _child(req: dict, proto_fd: int) -> None:
    os.close(proto_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    rc = 1
    try:
        if req.get("kill"):
            _install_kill(req["kill"])
        from orbax_maxtext_layout.cli import main

        rc = main(req["argv"]) or 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(int(rc) & 0xFF)


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the protocol
    gc.disable()  # the imports' objects all live on: nothing to collect while they load
    _preload()
    gc.enable()
    gc.collect()
    gc.freeze()  # the children's collections never walk the imports' heap (maxtext_zygote.py)
    proto.write(json.dumps({"ready": os.getpid()}) + "\n")
    children: dict[int, int] = {}  # pid -> pidfd
    done: dict[int, int] = {}  # pid -> exit code, reaped by a poll
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
            children[pid] = os.pidfd_open(pid)
            proto.write(json.dumps({"pid": pid}) + "\n")
            continue
        pid = req["pid"]
        if pid not in done:
            pidfd = children[pid]
            timeout = 0 if op == "poll" else req.get("timeout", 600)
            if not select.select([pidfd], [], [], timeout)[0]:
                if op == "poll":
                    proto.write(json.dumps({"rc": None}) + "\n")
                    continue
                os.kill(pid, signal.SIGKILL)  # not reaped yet: the pid is still ours
            _, status = os.waitpid(pid, 0)
            os.close(children.pop(pid))
            done[pid] = os.waitstatus_to_exitcode(status)
        proto.write(json.dumps({"rc": done[pid]}) + "\n")
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
