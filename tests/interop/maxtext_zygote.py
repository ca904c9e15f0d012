"""A fork server for the interop suite's children (`hf_export_support.run` and `run_cli`):
import MaxText once, then fork one child per command line ``python -m MODULE ARGS``,
``python SCRIPT ARGS`` or ``python -c CODE ARGS``.

A fresh interpreter spends about 10 s of CPU here importing MaxText (its models, transformers,
tokamax) and walking, at each of its full collections, the 0.5 million objects that leaves;
the interop suite starts dozens of children: MaxText's own programs on the tiny models, its
references (``to_huggingface``, ``to_maxtext`` through import_hf_reference.py, the LoRA logits
children, the SFT trainer, stock pre-training runs), and this library's command line where a
test is of what the command does. This server imports what they import and never touches a jax
backend or tensorstore, so forking it is safe (as `export_hf_zygote.py` does for the export
kills). It then freezes its heap (`gc.freeze`): a child's collections walk only what the child
made (the collector was a third of an export's CPU time). An export of the tiny model takes
about 2 s of CPU this way, 6.5 s forked from an unfrozen server and 17 s in a fresh
interpreter; a ``to_maxtext`` reference 5 s, against 22 s. Each child does what a fresh
interpreter does with its command line, in the job's directory and environment, its output in
the job's log (or its two files): the same program, without a second interpreter start.

- ``-m maxtext.checkpoint_conversion.to_huggingface``: the module is imported here (its absl
  flags are defined once), so the child runs its ``__main__`` block, verbatim below (its jax
  settings, ``XLA_FLAGS``, then ``app.run(main)`` with the command line's arguments).
- any other ``-m MODULE``, ``SCRIPT`` or ``-c CODE``: ``runpy`` (``exec`` for ``-c``) runs it
  as ``__main__``, as ``python`` does; a module must not be one this server imported (its top
  level would run twice). ``sys.path`` is a fresh interpreter's for that command (the script's
  directory, or the working directory for ``-m`` and ``-c``, then the job's ``PYTHONPATH``,
  then the site's): with this checkout on it, ``-m orbax_maxtext_layout`` imports the library
  in the child (about 1 s), which this server never imports. A ``sitecustomize`` on that path
  is imported first, as `site` imports it at a fresh interpreter's start (the probe of
  maxtext_loop_support, in MaxText's training runs).

The child's environment is the job's, set exactly. What a fork cannot change is what an
interpreter and JAX read when they start (``PYTHON*`` but ``PYTHONPATH``, ``JAX_*``, ``XLA_*``,
``TF_*``, ...): `hf_export_support.run` starts a fresh process for a job whose environment
changes one of those from the server's. ``XLA_FLAGS`` set by the program itself before it
starts the backend (``to_huggingface``, ``to_maxtext``, ``chunked_step.py``) take effect, since
no backend is started here.

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout.

* ``{"op": "start", "argv": [ARGS after the interpreter], "cwd": DIR, "log": PATH,
  "env": {...}}`` -> ``{"pid": PID}`` (``"stdout": PATH, "stderr": PATH`` instead of
  ``"log"``: the two apart). Its stdin is ``/dev/null``. With ``"stop": true`` the child stops
  itself (SIGSTOP) right before it runs the command line, for the caller to attach strace and
  resume it (SIGCONT).
* ``{"op": "poll", "pid": PID}`` -> ``{"rc": RC | null}`` (null: still running).
* ``{"op": "kill", "pid": PID}`` -> ``{"rc": RC}``.
* ``{"op": "exit"}``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import traceback

EXPORT_MODULE = "maxtext.checkpoint_conversion.to_huggingface"


def _preload() -> None:
    with contextlib.redirect_stdout(sys.stderr):
        import jax  # noqa: F401
        import maxtext.checkpoint_conversion.to_huggingface  # noqa: F401
        import ml_dtypes  # noqa: F401
        import safetensors  # noqa: F401
        from absl import app  # noqa: F401


def _sys_path(argv: list[str], env: dict[str, str]) -> list[str]:
    """``sys.path`` of a fresh interpreter started on ``argv`` with ``env``: the script's
    directory (the working directory for ``-m``), the ``PYTHONPATH`` entries, then this
    server's own entries past its script directory and its ``PYTHONPATH``."""
    if argv[0] in ("-m", "-c"):
        first = os.getcwd() if argv[0] == "-m" else ""
    else:
        first = os.path.dirname(os.path.abspath(argv[0]))
    ours = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    site = sys.path[1 + len(ours) :]
    return [first, *[os.path.abspath(p) for p in theirs], *site]


def _sitecustomize() -> None:
    """What `site` does when a fresh interpreter starts: import ``sitecustomize`` from
    ``sys.path`` (the job's: e.g. maxtext_loop_support's probe), unless it is the one this
    server imported; an error in it is reported and the interpreter goes on, as `site` does."""
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    had = sys.modules.get("sitecustomize")
    if spec is None or (had is not None and getattr(had, "__file__", None) == spec.origin):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # site.execsitecustomize's report
        err = f"{type(e).__name__}: {e}"
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{err}", file=sys.stderr)
        sys.modules.pop("sitecustomize", None)


def _run(argv: list[str]) -> None:
    """What ``python ARGV`` runs, in this (forked) interpreter."""
    import runpy

    if argv[0] == "-m" and argv[1] == EXPORT_MODULE:
        import jax
        from absl import app

        th = sys.modules[EXPORT_MODULE]
        sys.argv = [th.__file__, *argv[2:]]
        # what `python -m` runs under ``if __name__ == "__main__":``, verbatim
        jax.config.update("jax_default_prng_impl", "unsafe_rbg")
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
        jax.config.update("jax_platforms", "cpu")
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        app.run(th.main, argv=sys.argv)
        return
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        return
    if argv[0] == "-m":
        if argv[1] in sys.modules:
            raise RuntimeError(f"{argv[1]} is imported by the fork server: run a real process")
        sys.argv = ["-m", *argv[2:]]  # runpy sets sys.argv[0] to the module's file
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def _child(req: dict) -> None:
    """The forked child: ``req``'s command line, as a fresh interpreter runs it."""
    code = 1
    try:
        os.chdir(req["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            f = os.open(req.get(name) or req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        # sys.stdout and sys.stderr stay the objects they are (now on the job's files): the
        # handler a log call made before ``absl.app.run`` added for sys.stderr is the one absl
        # then removes, as in a fresh interpreter (a new object would log every line twice)
        env = req["env"]
        sys.path[:] = _sys_path(req["argv"], env)
        os.environ.clear()
        os.environ.update(env)
        if req.get("stop"):  # held until the caller has attached its tracer, then resumed
            os.kill(os.getpid(), signal.SIGSTOP)
        _sitecustomize()
        try:
            _run(req["argv"])
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:  # what Python does with a message
                print(e.code, file=sys.stderr)
                code = 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code & 0xFF)


def _status(pid: int, *, block: bool) -> int | None:
    got, status = os.waitpid(pid, 0 if block else os.WNOHANG)
    if got == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def main() -> None:
    gc.disable()  # the imports' objects all live on: nothing to collect while they load
    _preload()
    gc.enable()
    gc.collect()
    gc.freeze()  # the children's collections never walk the imports' heap
    out = sys.stdout
    done: dict[int, int] = {}
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
