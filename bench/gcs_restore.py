"""Benchmark: params restore from ``gs://``, stock Orbax against the library, with latency.

    python bench/gcs_restore.py --work /tmp/omtl-gcs-restore [--params 30e6] [--chunks 1 8]
        [--latency 0 20 50 50/50] [--rounds 3] [--before DIR] [--json out.json]

Builds `bench/restore.py`'s MaxText-shaped float32 model (``--params`` parameters) as a
MaxText step and a Tunix step, one chunk and ``N`` chunks per array (Orbax's
``chunk_byte_size``), uploads them to a local GCS emulator (fake-gcs-server) started in its
own process behind the counting proxy (``tests/gcs/emulator.py serve``: the proxy's
threads do not share this process's interpreter), and restores each, onto one device, in
interleaved rounds:

- ``stock``: MaxText 0.2.5's ``load_params_from_path`` call with stock Orbax (as
  `bench/restore.py`);
- ``oml maxtext`` / ``oml tunix``: ``oml.load_params_from_path`` of each layout.

Each latency condition is ``FIRST`` or ``FIRST/BETWEEN`` in ms: the proxy waits ``FIRST``
before each response's first byte and ``BETWEEN`` before each further MiB of its body
(`CountingProxy.set_latency`). gcsfs's listing cache is dropped before each restore (a
restore is the first thing a fresh trainer does). Reports each restore's median time, its
ratio to stock's, and its requests by kind (one restore, counted at the proxy).

``--before DIR`` (a checkout of another version, e.g. ``git worktree add DIR <commit>``)
runs the same measurements with that package, in a second child process, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

from inproc import python  # noqa: E402  (each child a fresh interpreter, but in a smoke run)

OPS = ("stock", "oml maxtext", "oml tunix")


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--params", type=float, default=30e6)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 8])
    p.add_argument("--latency", nargs="+", default=["0", "20", "50"], help="FIRST[/BETWEEN] ms")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", type=Path, metavar="DIR", help="another checkout, side by side")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def _latency(cond: str) -> tuple[float, float]:
    first, _, between = cond.partition("/")
    return float(first) / 1000, float(between or 0) / 1000


# -- the child: one package, every condition ------------------------------------------------
def child(spec: dict) -> dict:
    """Runs in a child process whose environment points at the emulator (and, for
    ``--before``, whose ``PYTHONPATH`` names the other checkout first)."""
    import importlib

    # before bench/restore.py, which puts this tree first on the path
    oml = importlib.import_module("orbax_maxtext_layout")

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from etils import epath
    from gcs.emulator import RemoteProxy, invalidate_gcsfs_caches
    from jax.sharding import SingleDeviceSharding
    from realsize_steps import unflat_tree
    from restore import _shapes

    proxy = RemoteProxy(os.environ["STORAGE_EMULATOR_HOST"])
    shapes = _shapes(spec["params"])
    device = jax.devices()[0]
    abstract = unflat_tree(
        {
            p: jax.ShapeDtypeStruct(s, np.float32, sharding=SingleDeviceSharding(device))
            for p, s in shapes.items()
        }
    )

    def stock(items: epath.Path):
        ckptr = ocp.Checkpointer(
            ocp.PyTreeCheckpointHandler(restore_concurrent_gb=96, use_ocdbt=True, use_zarr3=True)
        )
        try:
            return ckptr.restore(
                items,
                item={"params": abstract},
                transforms={},
                restore_args={"params": ocp.checkpoint_utils.construct_restore_args(abstract)},
            )
        finally:
            ckptr.close()

    rows = []
    for chunks in spec["chunks"]:
        steps = {k: epath.Path(v) for k, v in spec["steps"][str(chunks)].items()}
        ops = {
            "stock": lambda s=steps: stock(s["maxtext"] / "items"),
            "oml maxtext": lambda s=steps: oml.load_params_from_path(
                s["maxtext"] / "items", abstract
            ),
            "oml tunix": lambda s=steps: oml.load_params_from_path(
                s["tunix"] / "model_params", abstract
            ),
        }
        want = None
        for cond in spec["latency"]:
            proxy.set_latency(*_latency(cond))
            times: dict[str, list] = {k: [] for k in ops}
            counts: dict[str, dict] = {}
            for r in range(spec["rounds"]):
                order = list(ops)[r % len(ops) :] + list(ops)[: r % len(ops)]
                for k in order:
                    invalidate_gcsfs_caches()
                    proxy.wait_idle()
                    with proxy.measure() as c:
                        t = time.perf_counter()
                        out = ops[k]()
                        jax.block_until_ready(out)
                        times[k].append(time.perf_counter() - t)
                    counts.setdefault(k, {"requests": c.requests, **c.by_kind})
                    # stock's result holds the params under "params" once more: by path
                    # within the params, each leaf's dtype, shape and bytes
                    got = {
                        jax.tree_util.keystr(p[-3:]): (x.dtype, x.shape, np.asarray(x).tobytes())
                        for p, x in jax.tree_util.tree_flatten_with_path(out)[0]
                    }
                    if want is None:
                        want = got
                    elif got != want:  # every restore bit-identical with the first (stock's)
                        raise SystemExit(f"{k} at {cond} ms, {chunks} chunks: values differ")
                    del out, got
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append(
                {
                    "chunks": chunks,
                    "latency": cond,
                    "seconds": med,
                    "ratio": {k: med[k] / med["stock"] for k in ops},
                    "requests": counts,
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    proxy.set_latency(0, 0)
    return {"package": oml.__file__, "rows": rows}


# -- the parent ------------------------------------------------------------------------------
def _build(work: Path, params: float, chunks_list: list[int]) -> dict[int, dict[str, Path]]:
    from restore import _shapes, _write

    shapes = _shapes(params)
    return {c: _write(work / f"chunks{c}", shapes, c, None) for c in chunks_list}


def _run_child(spec: dict, env: dict, before: Path | None) -> dict:
    spec = {**spec, "package_root": str((before or ROOT).resolve())}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        res = python(
            [str(Path(__file__).resolve()), "child", f.name], env=env, cwd=str(before or ROOT)
        )
    finally:
        os.unlink(f.name)
    if res.returncode != 0:
        raise RuntimeError(f"child ({before or 'this tree'}) failed:\n{res.stderr[-4000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    want = (Path(before) if before else ROOT).resolve() / "orbax_maxtext_layout"
    if Path(out["package"]).resolve().parent != want:
        raise RuntimeError(f"child imported {out['package']}, not {want}")
    return out


def _serve(work: Path) -> tuple[subprocess.Popen, dict]:
    """``emulator.py serve`` in its own process; its client environment."""
    env_file = work / "gcs.env"
    env_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "gcs" / "emulator.py"),
            "serve",
            "--env-file",
            str(env_file),
        ],
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not env_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the emulator did not start")
        time.sleep(0.1)
    env = dict(os.environ)
    for line in env_file.read_text().splitlines():
        if line.startswith("export "):
            k, _, v = line[len("export ") :].partition("=")
            env[k] = v.strip("'")
        elif line.startswith("unset "):
            env.pop(line.split()[1], None)
    return proc, env


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        spec = json.loads(Path(argv[1]).read_text())
        sys.path.insert(0, spec["package_root"])  # this tree's package, or --before's
        print(json.dumps(child(spec)))
        return 0
    a = _args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    a.work.mkdir(parents=True, exist_ok=True)
    from gcs.emulator import GcsEmulator  # before bench/restore.py puts bench/ (gcs.py) first

    built = _build(a.work, a.params, a.chunks)
    proc, env = _serve(a.work)
    try:
        emu = GcsEmulator.attach(env)
        steps = {}
        for c, s in built.items():
            prefix = emu.new_prefix(f"c{c}")
            steps[str(c)] = {
                k: emu.upload_tree(p.parent, f"{prefix}/{k}") + f"/{p.name}" for k, p in s.items()
            }
        spec = {
            "params": a.params,
            "chunks": a.chunks,
            "latency": a.latency,
            "rounds": a.rounds,
            "steps": steps,
        }
        results = {}
        for version, tree in (("this tree", None), ("before", a.before)):
            if version == "this tree" or tree is not None:
                results[version] = _run_child(spec, env, tree)
                _print({version: results[version]})
    finally:
        proc.terminate()
        proc.wait(30)
    if len(results) > 1:
        _print(results)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


def _print(results: dict) -> None:
    print(
        "| version | chunks | latency ms | stock s | oml maxtext (x stock) | oml tunix (x stock) "
        "| requests: stock / maxtext / tunix |"
    )
    print("|---|---|---|---|---|---|---|")
    for version, out in results.items():
        for r in out["rows"]:
            s, x = r["seconds"], r["ratio"]
            req = " / ".join(
                f"{r['requests'][k]['requests']} ("
                + ", ".join(
                    f"{kind} {n}"
                    for kind, n in sorted(r["requests"][k].items())
                    if kind != "requests"
                )
                + ")"
                for k in OPS
            )
            print(
                f"| {version} | {r['chunks']} | {r['latency']} | {s['stock']:.2f} | "
                f"{s['oml maxtext']:.2f} ({x['oml maxtext']:.2f}) | "
                f"{s['oml tunix']:.2f} ({x['oml tunix']:.2f}) | {req} |"
            )


if __name__ == "__main__":
    raise SystemExit(main())
