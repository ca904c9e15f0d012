"""A fork server for MaxText's own ``to_huggingface`` (`hf_export_support.run`): import MaxText's
exporter once, then fork one child per ``python -m maxtext.checkpoint_conversion.to_huggingface``
command line.

A process importing MaxText's exporter spends 6 s of CPU on it here before it does anything
(its models, transformers, tokamax), and the interop suite runs dozens of these exports of the
tiny models as its references; two at a time on 2 cores they were most of its wall time. This
server imports what the module imports and never touches a jax backend or tensorstore, so
forking it is safe (as `export_hf_zygote.py` does for this library's own CLI). Each child then
does exactly what the module's ``__main__`` block does (its jax settings, ``XLA_FLAGS``, then
``app.run(main)`` with the command line's arguments), in the job's directory, its output in the
job's log: the same reference, without a second interpreter start.

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout.

* ``{"op": "start", "argv": [ARGS after the module], "cwd": DIR, "log": PATH}`` -> ``{"pid": PID}``.
* ``{"op": "poll", "pid": PID}`` -> ``{"rc": RC | null}`` (null: still running).
* ``{"op": "kill", "pid": PID}`` -> ``{"rc": RC}``.
* ``{"op": "exit"}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import traceback

MODULE = "maxtext.checkpoint_conversion.to_huggingface"


def _preload() -> None:
    with contextlib.redirect_stdout(sys.stderr):
        import jax  # noqa: F401
        import maxtext.checkpoint_conversion.to_huggingface  # noqa: F401
        from absl import app  # noqa: F401


def _child(req: dict) -> None:
    """The forked child: the module's ``__main__`` block on ``req``'s command line."""
    code = 1
    try:
        os.chdir(req["cwd"])
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        import jax
        from absl import app

        th = sys.modules[MODULE]
        sys.argv = [th.__file__, *req["argv"]]
        # what `python -m` runs under ``if __name__ == "__main__":``, verbatim
        jax.config.update("jax_default_prng_impl", "unsafe_rbg")
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
        jax.config.update("jax_platforms", "cpu")
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        try:
            app.run(th.main, argv=sys.argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _status(pid: int, *, block: bool) -> int | None:
    got, status = os.waitpid(pid, 0 if block else os.WNOHANG)
    if got == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def main() -> None:
    _preload()
    out = sys.stdout
    done: dict[int, int] = {}
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "exit":
            break
        if op == "start":
            pid = os.fork()
            if pid == 0:
                sys.stdin.close()
                _child(req)
            reply = {"pid": pid}
        elif op == "poll":
            pid = req["pid"]
            if pid not in done:
                rc = _status(pid, block=False)
                if rc is not None:
                    done[pid] = rc
            reply = {"rc": done.get(pid)}
        elif op == "kill":
            pid = req["pid"]
            if pid not in done:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                done[pid] = _status(pid, block=True)
            reply = {"rc": done[pid]}
        else:
            reply = {"error": f"unknown op {op!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
