"""Child of test_rel_hostile_fuzz.py: reads one OCDBT item under many data-file tables.

``python rel_hostile_child.py ITEM TABLES_JSON OUT_JSON``: ``TABLES_JSON`` holds a list of
tables, each ``{key (hex): [base, rel]}`` for the item's indirect values. For each table, in
order: the item's B-tree is rewritten with it (`ocdbt_craft`), a marker path is stat'ed
(``/omtl-hostile-fuzz/<i>``, so a system-call trace tells the tables apart), then
`ocdbt.damaged_value_files`, `ItemReader.open` and `chunks.read_whole` of every array run.
Each outcome is recorded; anything other than `CheckpointReadError` is recorded as escaped.
Run in its own process so that the parent can trace it (strace) and survive whatever it does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

MARKER = "/omtl-hostile-fuzz"


def _escaped(where: str, e: BaseException) -> str:
    return f"{where}: {type(e).__name__}: {e}"[:500]


def run(item: Path, tables: list[dict], out: Path) -> int:
    import numpy as np
    import ocdbt_craft as C
    from etils import epath

    from orbax_maxtext_layout import CheckpointReadError
    from orbax_maxtext_layout.orbax_io import (
        item_writer,
        ocdbt,
    )
    from orbax_maxtext_layout.orbax_io.reader import ItemReader

    ctx = item_writer.ts_context()
    pristine = C.leaf_entries(item)
    src = ItemReader.open(epath.Path(item), ctx)
    names = sorted({e.key.decode().rsplit("/", 1)[0] for e in pristine})
    want = {n: src.read_whole(n) for n in names}
    results = []
    for i, table in enumerate(tables):
        entries = [
            dataclasses.replace(e, base=table[e.key.hex()][0], rel=table[e.key.hex()][1])
            if e.inline is None
            else e
            for e in pristine
        ]
        C.write_tree(item, entries)
        try:
            os.stat(f"{MARKER}/{i}")
        except OSError:
            pass
        rec: dict = {"escaped": []}
        try:
            rec["damaged"] = ocdbt.damaged_value_files(epath.Path(item))
        except CheckpointReadError as e:
            rec["damaged_error"] = str(e)
        except BaseException as e:
            rec["escaped"].append(_escaped("damaged_value_files", e))
        try:
            src = ItemReader.open(epath.Path(item), ctx)
        except CheckpointReadError as e:
            rec["open"] = f"refused: {e}"
        except BaseException as e:
            rec["escaped"].append(_escaped("ItemReader.open", e))
        else:
            rec["open"] = "ok"
            rec["reads"] = {}
            for n in names:
                try:
                    got = src.read_whole(n)
                except CheckpointReadError:
                    rec["reads"][n] = "refused"
                except BaseException as e:
                    rec["escaped"].append(_escaped(f"read_whole({n})", e))
                else:
                    same = got.dtype == want[n].dtype and np.array_equal(got, want[n])
                    rec["reads"][n] = "equal" if same else "differs"
        results.append(rec)
    try:
        os.stat(f"{MARKER}/end")
    except OSError:
        pass
    out.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent), str(here)]
    sys.exit(run(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])))
