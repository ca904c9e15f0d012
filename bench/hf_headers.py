"""Benchmark: what a safetensors header costs `HfDir.open` to accept or refuse (issue 58).

    python bench/hf_headers.py [--before DIR] [--repeats 3]

Each case is one ``model.safetensors`` (beside a ``config.json``) written once under a
temporary directory, then opened in a fresh child process by `HfDir.open` (this checkout,
and with ``--before DIR`` the package of another checkout: ``git worktree add DIR
<commit>``) and by the safetensors library's ``safe_open`` (its header parser, for scale).
Printed per case and reader: the median wall seconds of the open and the growth of the
child's peak RSS (``VmHWM``) over what it held before the open, and whether it was refused.

Cases: ``nested`` (a 100 MB header whose ``shape`` is a list of 33 M empty lists: refused),
``tensors-20k`` (a real-shaped header of 20,000 one-float tensors, ~1.6 MB: accepted) and
``tensors-1m`` (a 70 MB header of 1,000,000 empty tensors: a header's shape, accepted by both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from inproc import python  # noqa: E402  (each child a fresh interpreter, but in a smoke run)

CHILD = r"""
import json, sys, time
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) << 10
reader, hf = sys.argv[1], sys.argv[2]
if reader == "safe_open":
    from safetensors import safe_open
    before, t = hwm(), time.perf_counter()
    try:
        with safe_open(hf + "/model.safetensors", "np") as f:
            n = len(list(f.keys()))
        refused = None
    except Exception as e:
        refused, n = type(e).__name__, 0
else:
    sys.path.append(sys.argv[3])  # this bench's _internal; last: PYTHONPATH's package wins
    from _internal import hf_dir

    HfDir, HfInputError = hf_dir()
    before, t = hwm(), time.perf_counter()
    try:
        with HfDir.open(hf) as d:
            n = len(d.tensors)
        refused = None
    except HfInputError as e:
        refused, n = str(e).split(": ", 1)[1][:70], 0
print(json.dumps({"s": time.perf_counter() - t, "grew": hwm() - before, "n": n, "refused": refused}))
"""


def _write(path: Path, header: bytes, data: bytes = b"") -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        f.write(data)


def _tensors(n: int, floats: int) -> tuple[bytes, bytes]:
    head = {"__metadata__": {"format": "pt"}}
    for i in range(n):
        at = i * 4 * floats
        shape = [floats]
        head[f"model.layers.{i}.mlp.weight"] = {"dtype": "F32", "shape": shape,
                                                "data_offsets": [at, at + 4 * floats]}  # fmt: skip
    return json.dumps(head).encode(), bytes(4 * floats * n)


def cases(root: Path, scale: float = 1.0) -> dict[str, Path]:
    """The cases' directories under ``root``; ``scale`` below 1 shrinks every header (a smoke
    run: the cases keep their kind and their names, not their size)."""
    out = {}
    n = max(int(33_000_000 * scale), 1)
    nested = b'{"w": {"dtype": "F32", "shape": [' + b"[]," * n + b'[]], "x": 1}}'
    _write(root / "nested", nested)
    out["nested"] = root / "nested"
    _write(root / "tensors-20k", *_tensors(max(int(20_000 * scale), 1), 1))
    out["tensors-20k"] = root / "tensors-20k"
    _write(root / "tensors-1m", _tensors(max(int(1_000_000 * scale), 1), 0)[0])
    out["tensors-1m"] = root / "tensors-1m"
    return out


def run(reader: str, hf: Path, pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # cwd: not this checkout, which ``-c`` would put first on the path
    done = python(["-c", CHILD, reader, str(hf), str(REPO / "bench")], env=env, timeout=900, cwd=hf)
    if done.returncode != 0:  # a crash, not a refusal: shown, and the run exits 1
        print(done.stderr[-2000:], file=sys.stderr)
        return {"s": float("nan"), "grew": 0, "n": 0, "refused": f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="another checkout's root, run as 'HfDir@before'")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--scale", type=float, default=1.0, help="header sizes times this (smoke: 0.001)"
    )
    args = ap.parse_args()
    readers = {"HfDir": str(REPO), "safe_open": None}
    if args.before:
        readers["HfDir@before"] = str(Path(args.before).resolve())
    crashed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for case, hf in cases(Path(tmp), args.scale).items():
            for name, path in readers.items():
                reader = "safe_open" if name == "safe_open" else "hfdir"
                got = [run(reader, hf, path) for _ in range(args.repeats)]
                s = statistics.median(g["s"] for g in got)
                grew = statistics.median(g["grew"] for g in got)
                what = got[0]["refused"] or f"{got[0]['n']} tensors"
                crashed += sum(1 for g in got if str(g["refused"]).startswith("exit "))
                print(f"{case:12} {name:13} {s:7.2f} s {grew / 2**20:8.0f} MiB  {what}", flush=True)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
