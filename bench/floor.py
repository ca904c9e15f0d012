"""The floor of a streaming operation on this machine: every stored chunk of a step decoded
once, on both cores, and nothing else (issue 30).

    PYTHONPATH=$PWD python bench/floor.py STEP_DIR [--encode LEVEL] [--threads 2]

decodes each array of each Orbax item under ``STEP_DIR`` with the package's own chunk reader
(`chunks.pieces`, each stored chunk's zstd frame streamed into a reused per-thread buffer,
as `export-hf`, `convert` and `verify` read), ``--threads`` arrays at a time, largest first;
with ``--encode LEVEL`` it also compresses every decoded piece at that zstd level (a writer's
encode: the writers write zstd level 1 for zarr2 items, Orbax's level 3 for zarr3 ones). It
writes no file and compares nothing, so its time is what any operation that reads (and,
with ``--encode``, rewrites) every byte of the step spends at least on this machine:

- ``export-hf`` decodes the step once: its floor is the decode;
- ``verify`` of a ``convert`` output decodes both sides: about twice the decode;
- ``convert --unroll`` decodes and re-encodes every byte: the decode with ``--encode 1``.

Prints one JSON line: ``decoded_bytes``, ``encoded_bytes``, ``wall_s`` (the passes alone,
after imports) and the process's ``user_s``/``sys_s``. `bench/realsize.py` runs it as the
ops ``floor-decode`` and ``floor-codec``, beside ``cp -r`` of the same step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zstandard
from _internal import chunk_reader
from etils import epath

ts_context, keys_by_array, ItemReader = chunk_reader()  # the package's own reader

PIECE = 64 << 20  # bytes per decoded piece (the streaming readers' order of size)


def items(step: Path) -> list[Path]:
    """The Orbax items of a step: its subdirectories that hold ``_METADATA``."""
    return sorted(d for d in step.iterdir() if (d / "_METADATA").is_file())


def arrays(src: ItemReader) -> list[tuple[int, str]]:
    """``(decoded bytes, name)`` of every array the item stores, largest first."""
    out = []
    for name in keys_by_array(src.kv):
        lay = src.layout(name)
        if lay is not None:
            out.append((lay.nbytes, name))
    return sorted(out, reverse=True)


def one(src: ItemReader, name: str, ctx, level: int | None) -> tuple[int, int]:
    """Decode array ``name`` once (and encode each piece at ``level``): bytes in and out."""
    comp = zstandard.ZstdCompressor(level=level) if level is not None else None
    decoded = encoded = 0
    for piece in src.pieces(name, max_bytes=PIECE, reuse=True):
        decoded += piece.data.nbytes
        if comp is not None:
            encoded += len(comp.compress(np.ascontiguousarray(piece.data)))
    return decoded, encoded


def run(step: Path, level: int | None, threads: int) -> dict:
    ctx = ts_context()
    work = []
    for item in items(step):
        src = ItemReader.open(epath.Path(item), ctx)
        work += [(n, src, name) for n, name in arrays(src)]
    work.sort(key=lambda w: -w[0])
    lock, totals = threading.Lock(), [0, 0]

    def task(w) -> None:
        d, e = one(w[1], w[2], ctx, level)
        with lock:
            totals[0] += d
            totals[1] += e

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(task, work))
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "step": os.fspath(step),
        "arrays": len(work),
        "threads": threads,
        "encode_level": level,
        "decoded_bytes": totals[0],
        "encoded_bytes": totals[1],
        "wall_s": round(wall, 2),
        "user_s": round(ru.ru_utime, 2),
        "sys_s": round(ru.ru_stime, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", type=Path, help="a step directory (its items are read)")
    ap.add_argument("--encode", type=int, default=None, metavar="LEVEL")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    print(json.dumps(run(a.step, a.encode, a.threads)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
