"""Run by test_truncation in a fresh process: reads during which the files read shrink.

    python truncation_child.py JOB_JSON

``JOB_JSON``: ``{"op": OP, "pristine": DIR, "work": DIR, "cases": [{"at": F, "cut": CUT},
...]}``. The operation is timed first on two untouched copies (the shorter, ``T``; both
must give the pristine values). Then for each case the pristine directory is copied to
``work/<k>``, a thread cuts its files ``F * T`` seconds after the operation starts, and
the operation runs on the copy:

- ``restore``: ``oml.load_params_from_path`` of a MaxText step (`tree`'s arrays) onto host
  arrays; the files cut are the item's data files (``items/d/*``);
- ``convert``: ``convert_step`` of bench/synth's Tunix step to a separate ``out`` (``copy``:
  its own data files), then the output read back by stock Orbax and compared; the files
  cut are the source's data files;
- ``import``: ``import_hf`` (MaxText's mapping: the interop venv) of a Hugging Face
  directory into ``work/<k>-out``, with ``job["maxtext_config"]``; right is the output
  of the first untouched import, read back by stock Orbax, and after an error nothing
  under ``work/<k>-out`` (no work directory left behind); the files cut are the shards;
- ``export``: ``export_hf`` of the step an import of ``job["hf"]`` writes (made once,
  first) into ``work/<k>-out``; right is the first untouched export's tensors, and after
  an error nothing named ``<k>-out...`` beside it; the files cut are the step's data files;
- ``hf``: each tensor of a Hugging Face directory (`hf_tensors`) read as ``import-hf``
  reads it (`import_hf._read`: a view of the file's pages where it maps them) and cast to
  float32 as the import casts it; the files cut are the safetensors shards.

``CUT``: ``zero`` (truncated to 0 bytes), ``half``, ``tail`` (one byte short) or
``delete`` (unlinked; an open file reads on). A cut by a thread of this process is a cut
by another process as far as the kernel is concerned: a mapped page past a file's new end
raises SIGBUS in whichever thread touches it, and that ends this process; the test sees
the exit status.

One JSON line per case on stdout, written as it ends: ``outcome`` ("ok" with ``correct``:
the values equal the pristine ones; or "error" with ``error``, the exception's type,
``read_error``, whether it is a `CheckpointReadError`, ``message``, and ``named``, whether
the message names a file that was cut, and for any other error its ``trace``); ``seconds``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

SHAPES = {"a": (1024, 2048), "b": (2048, 1024), "c": (512, 4096), "d": (4096, 512)}


def tree() -> dict:
    """The restore step's params: four float32 arrays of 8 MiB, random (zstd keeps them
    about as large), ``{"params": {"params": {...}}}`` as MaxText saves them."""
    rng = np.random.default_rng(58)
    leaves = {k: rng.standard_normal(s, np.float32) for k, s in SHAPES.items()}
    return {"params": {"params": leaves}}


def hf_tensors() -> dict[str, np.ndarray]:
    """The Hugging Face directory's tensors: bfloat16 and float32, 4 MiB each."""
    import ml_dtypes

    rng = np.random.default_rng(59)
    out = {}
    for i in range(6):
        x = rng.standard_normal((1024, 1024), np.float32)
        out[f"t{i}"] = x.astype(ml_dtypes.bfloat16) if i % 2 else x
    return out


def _data_files(root: Path, op: str) -> list[Path]:
    if op in ("hf", "import"):
        return sorted(root.glob("*.safetensors"))
    return sorted(p for p in root.rglob("*") if p.is_file() and p.parent.name == "d")


def _cut(files: list[Path], how: str) -> None:
    for f in files:
        try:
            if how == "delete":
                f.unlink()
            else:
                size = f.stat().st_size
                os.truncate(f, {"zero": 0, "half": size // 2, "tail": max(0, size - 1)}[how])
        except OSError:
            pass


def _flat(tree: dict) -> dict[tuple[str, ...], np.ndarray]:
    from orbax_maxtext_layout.base.treepaths import flatten, norm_key

    flat = flatten(tree, is_leaf=lambda x: hasattr(x, "dtype"))
    return {tuple(norm_key(k) for k in p): np.asarray(v) for p, v in flat.items()}


def _equal(got: dict, want: dict) -> bool:
    g, w = _flat(got), _flat(want)
    return g.keys() == w.keys() and all(np.array_equal(g[k], w[k]) for k in w)


def _restore(copy: Path, want: dict) -> bool:
    import orbax_maxtext_layout as oml

    abstract = {"params": {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}}
    got = oml.load_params_from_path(copy / "items", abstract)
    return _equal(got, want["params"])


def _convert(copy: Path, want: dict, job: dict) -> bool:
    sys.path.insert(0, job["bench"])
    import synth

    from orbax_maxtext_layout import convert_step

    out = copy.parent / f"{copy.name}-out"
    # private copies of the data files: a hard-linked output shares the source's inodes,
    # so a cut of the source after the conversion would cut the output too
    convert_step(copy, synth.target_for(Path(job["pristine"])), out=out, copy=True)
    # the output's params, read back by stock Orbax, against the pristine step's
    from conftest import restore_flat

    got = {
        p[2:]: v for p, v in restore_flat(out / "items").items() if p[:2] == ("params", "params")
    }
    return got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def _hf(copy: Path, want: dict) -> bool:
    from orbax_maxtext_layout.formats.safetensors_reader import HfDir
    from orbax_maxtext_layout.hf import import_hf

    scratch = import_hf._SliceScratch()
    ok = True
    with HfDir.open(copy) as hf:
        for name in sorted(want):
            x = import_hf.cast(import_hf._read(hf, name, scratch), np.float32)
            ok &= np.array_equal(x, want[name].astype(np.float32))
            if hasattr(hf, "release"):  # as the import did while it mapped shards
                hf.release(name)
    return ok


def _import(copy: Path, want: dict, job: dict) -> bool:
    from conftest import restore_flat

    from orbax_maxtext_layout import import_hf

    out = copy.parent / f"{copy.name}-out"
    try:
        import_hf(copy, out, maxtext_config=job["maxtext_config"])
    except Exception:
        if out.exists():  # the import's work directory (or its step) left behind
            left = sorted(str(p.relative_to(out)) for p in out.iterdir())
            raise AssertionError(f"{out}: an import that failed left {left}") from None
        raise
    got = restore_flat(out / "0" / "items")
    if not want:  # the first, untouched import: what every other must give
        want.update(got)
    left = sorted(p.name for p in out.iterdir())
    return (
        left == ["0"]
        and got.keys() == want.keys()
        and all(np.array_equal(got[k], want[k]) for k in want)
    )


def _export(copy: Path, want: dict, job: dict) -> bool:
    from safetensors.numpy import load_file

    from orbax_maxtext_layout import export_hf

    out = copy.parent / f"{copy.name}-out"
    try:
        export_hf(copy, out, maxtext_config=job["maxtext_config"], override_model_architecture=True)
    except Exception:
        left = sorted(p.name for p in copy.parent.iterdir() if p.name.startswith(out.name))
        if left:  # the export's work directory (or its output) left behind
            raise AssertionError(f"{out}: an export that failed left {left}") from None
        raise
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got |= {f"{f.name}/{k}": v for k, v in load_file(str(f)).items()}
    if not want:  # the first, untouched export: what every other must give
        want.update(got)
    return got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def _exported_step(job: dict) -> str:
    """``export``'s source: the Hugging Face directory ``job["hf"]`` imported once."""
    from orbax_maxtext_layout import import_hf

    out = Path(job["work"]) / "imported"
    import_hf(job["hf"], out, maxtext_config=job["maxtext_config"])
    return str(out / "0")


def _want(job: dict):
    if job["op"] in ("import", "export"):
        return {}  # filled by the first untouched run
    if job["op"] == "restore":
        return tree()
    if job["op"] == "hf":
        return hf_tensors()
    # convert: the pristine step's params as stock Orbax restores them, without the
    # ``base``/``value`` levels the MaxText layout drops (its RNG state goes to nnx_aux)
    from conftest import restore_flat

    flat = restore_flat(Path(job["pristine"]) / "model_params")
    return {p[1:-1]: v for p, v in flat.items() if "rngs" not in p}


def run(job: dict, repo: Path, timeout: int) -> list[dict]:
    """The campaign ``job`` run in a child process (this file, with ``repo``'s package): its
    case lines, after checking that the child finished, never killed by SIGBUS, and reported
    every case (the callers check each case's outcome)."""
    from conftest import child_env

    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), json.dumps(job)],
        capture_output=True,
        text=True,
        env=child_env({"PYTHONPATH": str(repo)}),  # this tree's package, not an installed one
        timeout=timeout,
    )
    return outcomes(job, proc)


def outcomes(job: dict, proc: subprocess.CompletedProcess) -> list[dict]:
    """The case lines of the finished child ``proc`` (``returncode``, ``stdout`` and
    ``stderr`` as `subprocess.run` gives them) that ran ``job``, after checking that it
    finished, never killed by SIGBUS, and reported every case (`run`; the interop suite forks
    its children: tests/interop/test_import_hf_truncation.py)."""
    import signal

    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    done = f"after {len(lines)} lines: {lines[-1] if lines else None}"
    op = job["op"]
    assert proc.returncode != -signal.SIGBUS, f"{op}: the child died of SIGBUS {done}"
    assert proc.returncode == 0, f"{op}: exit {proc.returncode} {done}\n{proc.stderr[-3000:]}"
    got = lines[1:]
    assert len(got) == len(job["cases"]), done
    return got


def main() -> None:
    job = json.loads(sys.argv[1])
    if job["op"] == "export":
        job["pristine"] = _exported_step(job)
    from orbax_maxtext_layout.errors import CheckpointReadError

    want = _want(job)
    run = {
        "restore": _restore,
        "convert": lambda c, w: _convert(c, w, job),
        "import": lambda c, w: _import(c, w, job),
        "export": lambda c, w: _export(c, w, job),
        "hf": _hf,
    }[job["op"]]
    took = []
    for k in ("calibrate-0", "calibrate-1"):
        copy = Path(job["work"]) / k
        shutil.copytree(job["pristine"], copy)
        start = time.monotonic()
        if not run(copy, want):
            raise SystemExit(f"{copy}: the untouched copy read other values")
        took.append(time.monotonic() - start)
        _clean(copy)
    print(json.dumps({"calibrated": min(took)}), flush=True)
    for k, case in enumerate(job["cases"]):
        copy = Path(job["work"]) / str(k)
        shutil.copytree(job["pristine"], copy)
        files = _data_files(copy, job["op"])
        cutter = threading.Timer(case["at"] * min(took), _cut, (files, case["cut"]))
        got: dict = {"case": case, "outcome": "ok", "correct": None}
        start = time.monotonic()
        cutter.start()
        try:
            got["correct"] = bool(run(copy, want))
        except Exception as e:
            msg = str(e)
            got |= {
                "outcome": "error",
                "error": type(e).__name__,
                "read_error": isinstance(e, CheckpointReadError),
                "message": msg[:2000],
                "named": any(f.name in msg for f in files),
            }
            if not got["read_error"]:  # what the test will show
                got["trace"] = traceback.format_exc()[-3000:]
        finally:
            cutter.join()
        got["seconds"] = round(time.monotonic() - start, 3)
        print(json.dumps(got), flush=True)
        _clean(copy)


def _clean(copy: Path) -> None:
    shutil.rmtree(copy, ignore_errors=True)
    shutil.rmtree(copy.parent / f"{copy.name}-out", ignore_errors=True)


if __name__ == "__main__":
    main()
