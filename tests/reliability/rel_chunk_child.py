"""Child of test_rel_chunk_fuzz.py: reads arrays whose zarr metadata or chunk was edited.

``python rel_chunk_child.py CAP CASES_JSON OUT_JSON``: the address space is capped at CAP
bytes first (``RLIMIT_AS``), so an allocation a forged shape asks for fails, and an abort
ends this process, which the parent sees. Each case is ``{"item", "key", "value" (hex),
"array", "kind"}``: the stored value ``key`` of the item's database (OCDBT, or the directory
of a Pathways-style item) is replaced by ``value``, then array ``array`` is read by
`chunks.read_whole` and `chunks.pieces`, through tensorstore (as stored) and through the
streamed path (`zarr.SMALL` set to 0, the path of every array past 1 MiB), and by stock
tensorstore where it is safe to (the library accepted the metadata); the value is then put
back. Each read's outcome is ``refused`` (a `CheckpointReadError`), ``escaped: ...``, or the
values' sha256, compared in the parent with the original's and stock's.
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
from pathlib import Path

SAFE_BYTES = 64 << 20  # stock tensorstore reads only arrays the library took, of this much


def _kv(item: str):
    import tensorstore as ts

    if (Path(item) / "manifest.ocdbt").exists():
        return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
    return ts.KvStore.open(f"file://{item}/").result()


def _digest(a) -> str:
    import numpy as np

    a = np.ascontiguousarray(a, a.dtype.newbyteorder("="))  # values, not their byte order
    return hashlib.sha256(str((a.shape, a.dtype.str)).encode() + a.tobytes()).hexdigest()


def _whole(src, name: str, ctx) -> str:

    return _digest(src.read_whole(name))


def _pieces(src, name: str, ctx) -> str:
    """The pieces assembled (each box once, tiling the array), or ``wrong: ...``."""
    import numpy as np

    lay = src.layout(name)
    if lay.nbytes > SAFE_BYTES:  # a walk may start; it must be refused before it ends
        for _ in src.pieces(name, max_bytes=4096):
            pass
        return f"wrong: the walk of {lay.shape} ended"
    out = np.zeros(lay.shape, lay.dtype)
    seen = np.zeros(lay.shape, np.int8)
    for p in src.pieces(name, max_bytes=4096):
        out[p.box] = p.data
        seen[p.box] += 1
    if not (seen == 1).all():
        return "wrong: the pieces do not tile the array"
    return _digest(out)


def _stock(item: str, name: str, zarr3: bool) -> str:
    import numpy as np
    import tensorstore as ts

    kv = _kv(item).spec().to_json()
    where = {**kv, "path": kv.get("path", "") + name + "/"}
    spec = {"driver": "zarr3" if zarr3 else "zarr", "kvstore": where}
    spec["fill_missing_data_reads"] = False
    try:
        return _digest(np.asarray(ts.open(spec, open=True).result().read().result()))
    except Exception as e:  # tensorstore refuses with ValueError (and others)
        return f"stock refused: {type(e).__name__}"


def _outcome(fn, *args) -> str:
    from orbax_maxtext_layout import CheckpointReadError

    try:
        return fn(*args)
    except CheckpointReadError:
        return "refused"
    except BaseException as e:  # the finding
        return f"escaped: {type(e).__name__}: {e}"[:400]


def _reads(case: dict) -> dict:
    from etils import epath

    from orbax_maxtext_layout.orbax_io import (
        item_writer,
        zarr,
    )
    from orbax_maxtext_layout.orbax_io.reader import ItemReader

    out = {}
    for path, small in (("tensorstore", 1 << 20), ("streamed", 0)):
        zarr.SMALL = small
        ctx = item_writer.ts_context()
        try:
            src = ItemReader.open(epath.Path(case["item"]), ctx)
        except Exception as e:  # the case's item is the parent's copy: it must open
            return {"open": f"escaped: {type(e).__name__}: {e}"[:400]}
        out[f"whole/{path}"] = _outcome(_whole, src, case["array"], ctx)
        out[f"pieces/{path}"] = _outcome(_pieces, src, case["array"], ctx)
        if path == "tensorstore":
            lay = _outcome(lambda s, n: s.layout(n), src, case["array"])
            safe = hasattr(lay, "nbytes") and max(lay.nbytes, lay.chunk_bytes) <= SAFE_BYTES
            out["stock"] = _stock(case["item"], case["array"], src.use_zarr3) if safe else None
    zarr.SMALL = 1 << 20
    return out


def main(cap: int, cases: list[dict], out: Path) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    results = []
    for case in cases:
        kv = _kv(case["item"])
        original = kv.read(case["key"]).result().value
        kv.write(case["key"], bytes.fromhex(case["value"])).result()
        try:
            results.append(_reads(case))
        finally:
            kv.write(case["key"], original).result()
        out.write_text(json.dumps(results))  # what was done, should the next case abort


if __name__ == "__main__":
    main(int(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3]))
