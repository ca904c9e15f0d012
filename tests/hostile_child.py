"""Run by test_hostile_data in a fresh process under a memory cap: reads of hostile checkpoints.

    python hostile_child.py CAP_BYTES JOBS_JSON

The address space is capped (``RLIMIT_AS``, before JAX or tensorstore is imported), so a
read that tries to allocate what a forged shape asks for fails here, and an abort
(``std::bad_alloc``) ends this process, not the test worker: the test sees the exit status.
Each job is ``{"cli": [ARGV...]}`` (`orbax_maxtext_layout.cli.main`, its stdout and stderr
captured) or ``{"call": FUNC, "item": DIR, "name": ARRAY}`` with FUNC one of ``read_whole``,
``pieces``, ``read_chunk``, ``read_specs``, ``step_metadata`` (``item``: the step),
``restore`` or ``stock_restore`` (array ``name`` of the item restored as a host array, by
the library's `restore_pytree`, whose engine reads it, or by stock Orbax). One JSON
line per job on stdout, written as it ends (what was done before an abort is kept): ``rc``
(CLI), ``stderr``, ``error`` (the type of an exception that escaped, or None), ``read_error``
(whether it is a `CheckpointReadError`), ``message``,
``seconds`` and ``peak_rss_kib`` (this process's so far).
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import sys
import time
import traceback


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _call(job: dict) -> None:
    from etils import epath

    from orbax_maxtext_layout.orbax_io import (
        item_writer,
        stepmeta,
    )
    from orbax_maxtext_layout.orbax_io.reader import ItemReader
    from orbax_maxtext_layout.orbax_io.spec import read_specs

    func, item = job["call"], epath.Path(job["item"])
    if func in ("restore", "stock_restore"):
        _restore(item, job["name"], stock=func == "stock_restore")
    elif func == "read_specs":
        read_specs(item)
    elif func == "step_metadata":
        stepmeta.read(item)
    else:
        ctx = item_writer.ts_context()
        src = ItemReader.open(item, ctx)
        name = job["name"]
        if func == "read_whole":
            src.read_whole(name)
        elif func == "pieces":
            for _ in src.pieces(name, max_bytes=1 << 20):
                pass
        elif func == "read_chunk":
            lay = src.layout(name)
            shape = tuple(min(c, n) for c, n in zip(lay.chunk, lay.shape, strict=True))
            src.read_chunk(name, (0,) * len(shape), shape)


def _restore(item, name: str, *, stock: bool) -> None:
    import numpy as np
    import orbax.checkpoint as ocp

    from orbax_maxtext_layout.execute.restore import restore_pytree

    def through_stock(path, args):
        return ocp.PyTreeCheckpointHandler().restore(path, args=args)

    rargs = {name: ocp.RestoreArgs(restore_type=np.ndarray)}
    args = ocp.args.PyTreeRestore(item=rargs, restore_args=rargs, partial_restore=True)
    (through_stock if stock else lambda p, a: restore_pytree(p, a, through_stock))(item, args)


def _run(job: dict) -> dict:
    out, err = io.StringIO(), io.StringIO()
    got: dict = {"job": job, "rc": None, "error": None, "message": ""}
    start = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if "cli" in job:
                from orbax_maxtext_layout import cli

                got["rc"] = cli.main(job["cli"])
            else:
                _call(job)
        except BaseException as e:  # what would end a real process with a traceback
            from orbax_maxtext_layout.errors import CheckpointReadError

            got["error"] = type(e).__name__
            got["read_error"] = isinstance(e, CheckpointReadError)
            got["message"] = str(e)[:2000]
            traceback.print_exc()
    got.update(
        stdout=out.getvalue()[-4000:],
        stderr=err.getvalue()[-4000:],
        seconds=round(time.monotonic() - start, 2),
        peak_rss_kib=_peak_rss_kib(),
    )
    return got


def main(cap: int, jobs: list[dict]) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import orbax_maxtext_layout.cli  # noqa: F401  (imported before the first job is timed)

    print(json.dumps({"started": True, "peak_rss_kib": _peak_rss_kib()}), flush=True)
    for job in jobs:
        print(json.dumps(_run(job)), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), json.loads(sys.argv[2]))
